"""Running dcr as real processes and measuring them: wall time, peak anonymous memory, profiles.

* ``run(argv, env)``: one subprocess, timed; its RssAnon (anonymous resident memory, from
  /proc/PID/status) is sampled every 5 ms for the peak, and so is VmHWM (the kernel's high-water
  mark of the whole resident set, which also counts the memory-mapped checkpoint pages it touched).
  (ru_maxrss is no use here: it counts the pages of the forking parent.)
* ``dcr(*args)``: the argv of ``python -m dcr_cli ARGS`` with this checkout's dcr_cli first on the path.
* ``python benchmarks/harness.py profile OUT.pstats -- ARGS``: runs ``dcr ARGS`` in-process with a
  cProfile profiler in every thread (worker pools included) and writes the merged stats.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def env_with_repo(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}
    env.update(extra or {})
    return env


def dcr(*args: str) -> list[str]:
    return [sys.executable, "-m", "dcr_cli", *args]


@dataclass
class Proc:
    argv: list[str]
    seconds: float
    returncode: int
    stdout: str
    stderr: str
    peak_anon: int  # bytes, sampled RssAnon high-water
    hwm: int  # bytes, VmHWM (whole resident set, file-backed pages included) at the last sample
    started: float = 0.0  # perf_counter at start
    name: str = ""

    def check(self) -> Proc:
        if self.returncode != 0:
            cmd = " ".join(self.argv[2:] if self.argv[1:2] == ["-m"] else self.argv)
            raise RuntimeError(f"{cmd} exited {self.returncode}: {self.stderr.strip()[-2000:]}")
        return self


_RSS_ANON = re.compile(rb"RssAnon:\s+(\d+) kB")
_HWM = re.compile(rb"VmHWM:\s+(\d+) kB")


def _memory(pid: int) -> tuple[int, int]:
    """(RssAnon, VmHWM) of a live process in bytes; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            raw = f.read()
    except OSError:
        return 0, 0
    anon, hwm = _RSS_ANON.search(raw), _HWM.search(raw)
    return (int(anon.group(1)) * 1024 if anon else 0), (int(hwm.group(1)) * 1024 if hwm else 0)


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    *,
    name: str = "",
    timeout: float = 3600,
    cwd: Path | None = None,
) -> Proc:
    """Run ``argv`` to completion, measuring wall time and sampled peak RssAnon and VmHWM."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or env_with_repo(), cwd=cwd or REPO
    )
    out: dict[str, bytes] = {}

    def drain(key: str, stream: Any) -> None:
        out[key] = stream.read()

    readers = [threading.Thread(target=drain, args=(k, s), daemon=True) for k, s in (("o", p.stdout), ("e", p.stderr))]
    for r in readers:
        r.start()
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            anon, hwm = _memory(p.pid)
            peak[0], peak[1] = max(peak[0], anon), max(peak[1], hwm)
            done.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    deadline = t0 + timeout
    while True:
        pid, status, _usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            p.kill()
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    done.set()
    p.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    for r in readers:
        r.join()
    return Proc(
        argv=argv,
        seconds=seconds,
        returncode=p.returncode,
        stdout=out.get("o", b"").decode(errors="replace"),
        stderr=out.get("e", b"").decode(errors="replace"),
        peak_anon=peak[0],
        hwm=peak[1],
        started=t0,
        name=name,
    )


@dataclass
class Memory:
    """Peak memory per command name over many runs."""

    peaks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, proc: Proc) -> None:
        anon, hwm = self.peaks.get(proc.name, (0, 0))
        self.peaks[proc.name] = (max(anon, proc.peak_anon), max(hwm, proc.hwm))


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- in-process profiling of a dcr command, all threads -------------------------------------------------------------


def profile_main(out: Path, args: list[str]) -> int:
    profilers: list[cProfile.Profile] = []
    lock = threading.Lock()
    original_run = threading.Thread.run

    def run_profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        with lock:
            profilers.append(prof)
        prof.enable()
        try:
            original_run(self)
        finally:
            prof.disable()

    threading.Thread.run = run_profiled  # type: ignore[method-assign]
    main = cProfile.Profile()
    profilers.append(main)
    import runpy

    sys.argv = ["dcr", *args]
    code = 0
    main.enable()
    try:
        runpy.run_module("dcr_cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        main.disable()
    stats = pstats.Stats(profilers[0])
    for prof in profilers[1:]:
        with contextlib.suppress(TypeError):  # a profiler that never ran
            stats.add(prof)
    stats.dump_stats(str(out))
    return code


WAITS = ("acquire", "wait", "get", "sleep", "result", "join", "select", "poll")  # a thread waiting on another


def top_entries(path: Path, n: int = 12, sort: str = "tottime", only: str | None = None) -> list[str]:
    """The top ``n`` functions of a pstats file as text lines (own time, cumulative time, calls).

    By own time, built-in waits (lock acquire, queue get, sleep: a thread idling while another works) are
    left out. ``only``: keep functions whose file path contains this (e.g. "dcr_cli")."""
    stats = pstats.Stats(str(path))
    rows = []
    for func, (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        file, _line, fn = func
        if only is not None and (only not in file or fn == "<module>"):
            continue
        if sort == "tottime" and file == "~" and any(w in fn for w in WAITS):
            continue
        rows.append((tt if sort == "tottime" else ct, tt, ct, nc, func))
    rows.sort(key=lambda r: r[0], reverse=True)
    lines = []
    for _key, tt, ct, nc, (file, line, fn) in rows[:n]:
        where = file.replace(str(REPO) + "/", "")
        where = re.sub(r".*site-packages/", "", where)
        where = re.sub(r".*/lib/python3[.0-9]*/", "", where)
        lines.append(f"{tt:8.3f} s own {ct:8.3f} s cum {nc:>9} calls  {fn} ({where}:{line})")
    return lines


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "profile" and sys.argv[3] == "--":
        sys.exit(profile_main(Path(sys.argv[2]), sys.argv[4:]))
    sys.exit("usage: python benchmarks/harness.py profile OUT.pstats -- DCR-ARGS...")
