"""Shared fixtures. Checkpoints are built locally with torch + safetensors; nothing is downloaded."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_dcr(*args: str, check: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real ``dcr`` command line in a subprocess (as users and cron do)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "dcr_cli", *args], capture_output=True, text=True, env=full_env, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"dcr {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def require_or_skip(module: str) -> None:
    """Import a real part a test needs. Under CI (CI=true, as .ci/run installs everything) a missing
    part fails the run instead of skipping, so no real part is ever reported as covered when it is not."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        importlib.import_module(module)
    else:
        pytest.importorskip(module, reason=f"{module} is not installed (.ci/setup --with-vllm installs it)")


@pytest.fixture
def dcr():
    return run_dcr


@pytest.fixture(autouse=True)
def _shut_down_vllm_engines():
    """After every test, shut down the in-process vLLM engines it started (vllm_support.shut_down_engines):
    one kept alive by a reference cycle would otherwise be collected during a later test's engine start,
    in this file or the next, and take the distributed state that engine is setting up with it."""
    yield
    support = sys.modules.get("vllm_support")  # imported only by the vLLM tests
    if support is not None:
        support.shut_down_engines()


@pytest.fixture
def shared_qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A real ``vllm serve`` of step-0 of the session's 3-step tiny Qwen3 chain (vllm_support.qwen3_run), in
    the state a fresh server starts in: one server serves every test that asks for it, reset to step-0
    through dcr before each test after the first (vllm_support.shared_server)."""
    from vllm_support import qwen3_run, shared_server

    return shared_server(qwen3_run(tmp_path_factory, "qwen3"), tmp_path_factory)


# The last test of the run that uses shared_qwen3_server (pytest_collection_finish finds it).
_LAST_SHARED_SERVER_TEST: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if "shared_qwen3_server" in getattr(item, "fixturenames", ())]
    _LAST_SHARED_SERVER_TEST[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """Stop the shared vLLM servers once the last test that uses them is done: no idle server through the
    rest of the run (on 2 cores, one beside an in-process engine slows both)."""
    yield
    support = sys.modules.get("vllm_support")
    if support is not None and (nextitem is None or item.nodeid in _LAST_SHARED_SERVER_TEST):
        support.close_shared_servers()


# Tests never read or write the user's digest cache.
os.environ.setdefault("DCR_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"dcr-test-cache-{os.getpid()}"))


pytest_plugins = ["store_fixtures"]
