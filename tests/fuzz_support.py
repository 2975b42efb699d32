"""Shared parts of the fuzz suite (tests/test_fuzz_*.py, benchmarks/fuzz_campaign.py).

* ``World``: small real checkpoints v0 -> v1 -> v2, the deltas dcr diff wrote between them and a local store
  holding both, built once per session.
* ``mutate_json``: structural mutations of any JSON document (retype, delete, duplicate, swap, nudge an
  integer, add an unknown member) and raw-text ones json.dumps cannot write (duplicate key, 1,000 levels,
  4,301 digits, NaN, a lone surrogate, NUL, truncation).
* ``Oracle``: the one property of the whole suite. For every case the real CLI either refuses with ONE
  line ``dcr: error: ...`` and exit 2 (1 for a verify mismatch) and leaves the receiver byte-identical, or
  exits 0 with the receiver bit-identical to the target. Never exit 0 with other bits; never a traceback
  or an internal error.

There is no leniency: a case that exits 0 with other bits, or refuses after writing, fails the suite.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner
from helpers_checkpoints import write_checkpoint

from dcr_cli.cli import main

EXAMPLES = int(os.environ.get("DCR_FUZZ_EXAMPLES", "120"))  # per test; the campaign raises it
RANDOM = os.environ.get("DCR_FUZZ_RANDOM", "") not in ("", "0")  # the campaign explores new cases each run
COUNTS: Counter[str] = Counter()  # "family/outcome" -> cases, for the closing note


def dump_counts() -> None:
    """Add this process's case counts to the JSON file named by DCR_FUZZ_REPORT (if set)."""
    path = os.environ.get("DCR_FUZZ_REPORT")
    if not path or not COUNTS:
        return
    total: Counter[str] = Counter()
    with contextlib.suppress(FileNotFoundError, ValueError):
        total.update(json.loads(Path(path).read_text()))
    total.update(COUNTS)
    Path(path).write_text(json.dumps(dict(sorted(total.items())), indent=1) + "\n")
    COUNTS.clear()


# --------------------------------------------------------------------------- the world


@dataclass
class World:
    root: Path
    versions: list[Path]  # v0, v1, v2 checkpoint directories
    deltas: list[Path]  # d01, d12
    store: Path  # local store holding d01 and d12 (file:// URL: store_url)

    @property
    def store_url(self) -> str:
        return f"file://{self.store}"

    def model_bytes(self, i: int) -> bytes:
        return (self.versions[i] / "model.safetensors").read_bytes()


def _tensors(rng: np.random.Generator) -> list[dict[str, tuple[str, tuple[int, ...], np.ndarray]]]:
    v0 = {
        "a.bf16": ("BF16", (16, 16), rng.integers(0, 1 << 16, 256, dtype=np.uint16)),
        "b.f32": ("F32", (40,), rng.integers(0, 1 << 32, 40, dtype=np.uint32)),
        "c.i64": ("I64", (10,), rng.integers(0, 1 << 62, 10, dtype=np.uint64)),
        "d.u8": ("U8", (4, 16), rng.integers(0, 256, 64, dtype=np.uint8)),
        "e.f16": ("F16", (8,), rng.integers(0, 1 << 16, 8, dtype=np.uint16)),  # never changes
    }
    out = [v0]
    for step in (1, 2):
        prev = out[-1]
        new = {k: (d, s, v.copy()) for k, (d, s, v) in prev.items()}
        new["a.bf16"][2][[1, 5, 200 + step, 250]] ^= np.uint16(3 * step)  # sparse: xor
        new["b.f32"][2][:] = step  # dense: replace
        new["c.i64"][2][[0, 9]] ^= np.uint64(step)  # --overwrite: overwrite
        new["d.u8"][2][[0, 17, 63]] ^= np.uint8(0x80)
        out.append(new)
    return out


@cache
def world() -> World:
    """Built once per process (fixtures cannot be shared with hypothesis' repeated calls)."""
    from dcr_cli.produce import diff

    root = Path(tempfile.mkdtemp(prefix="dcr-fuzz-world-"))
    tensors = _tensors(np.random.default_rng(20261201))
    versions = [write_checkpoint(root / f"v{i}", t) for i, t in enumerate(tensors)]
    deltas = []
    for i in (0, 1):
        out = root / f"d{i}{i + 1}"
        labels = {"base_version": f"v{i}", "target_version": f"v{i + 1}"}
        diff(versions[i], versions[i + 1], out, **labels, workers=1, overwrite=["c.*"])
        deltas.append(out)
    store = root / "store"
    for i, d in enumerate(deltas):
        result = run("push", str(d), f"file://{store}")
        assert result.code == 0, result.stderr
        if i == 0:  # a receiver acknowledges v1 and v1 becomes the baseline, so that v2 can be pushed
            recv = copy_receiver(versions[0], root / "acked")
            result = run("apply", str(d), "--into", str(recv), "--ack", f"file://{store}", "--receiver", "fuzz")
            assert result.code == 0, result.stderr
            result = run("commit", f"file://{store}", "v1", "--receiver", "fuzz")
            assert result.code == 0, result.stderr
    return World(root, versions, deltas, store)


# --------------------------------------------------------------------------- running the CLI


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    exception: BaseException | None = None


def run(*args: str) -> Result:
    """The real ``dcr`` main, in-process (click's runner: the same parsing, error path and exit codes)."""
    r = CliRunner().invoke(main, list(args), catch_exceptions=True)
    exc = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
    return Result(r.exit_code, r.stdout, r.stderr, exc)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dcr-fuzz-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of a receiver (its lock file aside: taking the lock is not a change)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock" and ".tmp-" not in p.name
    }


def tensor_bits(root: Path) -> dict[str, bytes] | None:
    from checkpoints import read_bits

    try:
        return read_bits(root)
    except Exception:
        return None


# --------------------------------------------------------------------------- the oracle


@dataclass
class Oracle:
    """Checks one case: ``expect_bits`` are the target's tensor bits, ``before`` the receiver's files."""

    family: str
    receiver: Path
    expect_bits: dict[str, bytes]
    before: dict[str, bytes] = field(default_factory=dict)
    refusal_codes: tuple[int, ...] = (2,)

    @staticmethod
    def of(
        family: str,
        receiver: Path,
        target: Path,
        refusal_codes: tuple[int, ...] = (2,),
    ) -> Oracle:
        bits = tensor_bits(target)
        assert bits is not None
        return Oracle(family, receiver, bits, snapshot(receiver), refusal_codes)

    def check(self, r: Result, what: str) -> str:
        """Assert the property; returns the outcome ("refused" or "applied") and counts it."""
        assert r.exception is None, f"{what}: {type(r.exception).__name__}: {r.exception}"
        assert "Traceback" not in r.stderr, f"{what}: {r.stderr}"
        assert r.code != 70, f"{what}: internal error: {r.stderr}"
        if r.code == 0:
            if tensor_bits(self.receiver) == self.expect_bits:
                return self._count("applied")
            raise AssertionError(f"{what}: exit 0 but the receiver does not hold the target\n{r.stdout}")
        lines = r.stderr.splitlines()
        assert r.code in self.refusal_codes, f"{what}: exit {r.code}: {r.stderr}"
        assert len(lines) == 1 and lines[0].startswith("dcr: error: "), f"{what}: {r.stderr!r}"
        if snapshot(self.receiver) != self.before:
            raise AssertionError(f"{what}: refused ({lines[0]}) but the receiver was modified")
        return self._count("refused")

    def _count(self, outcome: str) -> str:
        COUNTS[f"{self.family}: {outcome}"] += 1
        COUNTS[f"{self.family}: cases"] += 1
        return outcome


# --------------------------------------------------------------------------- deltas and receivers


def copy_delta(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def copy_receiver(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".dcr"))
    return dst


def write_manifest(delta: Path, m: Any, raw: bytes | None = None) -> None:
    (delta / "manifest.json").write_bytes(raw if raw is not None else json.dumps(m).encode())


def put_section(delta: Path, m: dict[str, Any], item: int, key: str, payload: bytes) -> None:
    """Point ``items[item][key]`` at ``payload``, in a block of its own, with every digest re-signed
    (block id, size, section digest): only the frame checks can refuse it."""
    from dcr_cli.format.digest import digest_bytes

    block_id = digest_bytes(payload)
    (delta / "blocks" / block_id).write_bytes(payload)
    role = "repair" if key == "repair" else "data"
    m["blocks"].append({"id": block_id, "size": len(payload), "role": role})
    section = m["items"][item][key]
    section.update({"block": len(m["blocks"]) - 1, "offset": 0, "length": len(payload), "digest": block_id})


def section_bytes(delta: Path, m: dict[str, Any], section: dict[str, Any]) -> bytes:
    raw = (delta / "blocks" / m["blocks"][section["block"]]["id"]).read_bytes()
    return raw[section["offset"] : section["offset"] + section["length"]]


def resign_fingerprint(m: Any) -> None:
    """Make target.fingerprint match the (mutated) tensor table where the table is still well-formed."""
    from dcr_cli.format.manifest import TensorEntry, fingerprint

    with contextlib.suppress(Exception):
        table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in m["tensors"].items()}
        m["target"]["fingerprint"] = fingerprint(table)


# --------------------------------------------------------------------------- JSON mutations


SPECIAL_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 255, 256, 2**31, 2**32, 2**63, 2**64 - 1, 2**64, 10**20 - 1, 1.5, -0.0, 1e300,
    "", "x", "0", "a" * 64, "f" * 64, "BF16", "xor", "replace", "data", "repair", "../../etc", "\u2028", "\x1b[31m",
    [], [0], [1, 2], [[0]], {}, {"a": 1}, {"start": 0, "stop": 1}, {"offsets": [], "sizes": []},
]  # fmt: skip

# Raw-text attacks, spliced in where a marker string was put (json.dumps cannot write these).
RAW_ATTACKS: dict[str, str] = {
    "deep-nesting": "[" * 1000 + "]" * 1000,
    "very-deep-nesting": "[" * 100_000 + "]" * 100_000,  # hypothesis raises the recursion limit while it runs
    "65-levels": "[" * 65 + "]" * 65,
    "huge-integer": "7" * 4301,
    "21-digits": "1" * 21,
    "nan": "NaN",
    "infinity": "-Infinity",
    "overflow": "1e400",
    "lone-surrogate": '"tensor\\ud800"',
    "nul": '"a\\u0000b"',
    "float-int": "2.0",
}
STRUCTURAL = ("retype", "delete", "duplicate", "swap", "nudge", "add-unknown", "shuffle")
RAW = ("raw-value", "duplicate-key", "truncate", "not-utf8")
MUTATIONS = STRUCTURAL + RAW


def _nodes(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out: list[tuple[tuple[Any, ...], Any]] = []
    stack = [(path, obj)]
    while stack:
        p, v = stack.pop()
        out.append((p, v))
        if isinstance(v, dict):
            stack.extend(((*p, k), c) for k, c in v.items())
        elif isinstance(v, list):
            stack.extend(((*p, i), c) for i, c in enumerate(v))
    out.sort(key=lambda pv: [str(x) for x in pv[0]])
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def mutate_json(
    doc: Any, ops: list[tuple[str, int, int]], prefer: Callable[[tuple[Any, ...]], bool] | None = None
) -> tuple[Any, bytes, str]:
    """Apply ``ops`` (mutation name, node seed, value seed) to a copy of ``doc``.

    Returns the mutated object (None where the raw text is no JSON object any more), its bytes and a
    description. ``prefer`` narrows the nodes to mutate (e.g. to one record's fields) when it matches any.
    """
    obj = json.loads(json.dumps(doc))
    raw_splices: list[tuple[str, str]] = []
    text_edits: list[Callable[[bytes], bytes]] = []
    described = []
    for n, (name, node_seed, value_seed) in enumerate(ops):
        rnd = random.Random(value_seed)
        nodes = [pv for pv in _nodes(obj) if pv[0]]
        if prefer is not None and any(prefer(p) for p, _ in nodes):
            nodes = [pv for pv in nodes if prefer(pv[0])]
        if not nodes:
            continue
        path, value = nodes[node_seed % len(nodes)]
        parent, key = _get(obj, path[:-1]), path[-1]
        described.append(f"{name} at {'/'.join(map(str, path))}")
        if name == "retype":
            choices = [v for v in SPECIAL_VALUES if type(v) is not type(value)]
            parent[key] = json.loads(json.dumps(rnd.choice(choices)))
        elif name == "delete":
            del parent[key]
        elif name == "duplicate":
            if isinstance(parent, list):
                parent.insert(key, json.loads(json.dumps(value)))
            else:
                parent[f"{key}-copy"] = json.loads(json.dumps(value))
        elif name == "swap":
            siblings = list(parent) if isinstance(parent, dict) else list(range(len(parent)))
            other = siblings[rnd.randrange(len(siblings))]
            parent[key], parent[other] = parent[other], parent[key]
        elif name == "nudge":
            if isinstance(value, int) and not isinstance(value, bool):
                parent[key] = value + rnd.choice([-2, -1, 1, 2, value, -value - 1, 1 << 31])
            elif isinstance(value, str) and value:
                i = rnd.randrange(len(value))
                parent[key] = value[:i] + chr((ord(value[i]) + 1) % 0x10000 or 1) + value[i + 1 :]
            else:
                parent[key] = rnd.choice(SPECIAL_VALUES)
        elif name == "add-unknown":
            target = value if isinstance(value, dict) else parent if isinstance(parent, dict) else None
            if target is not None:
                target[f"x-fuzz-{n}"] = json.loads(json.dumps(rnd.choice(SPECIAL_VALUES)))
        elif name == "shuffle":
            target = value if isinstance(value, list) else parent if isinstance(parent, list) else None
            if target is not None:
                rnd.shuffle(target)
        elif name == "raw-value":
            attack = sorted(RAW_ATTACKS)[value_seed % len(RAW_ATTACKS)]
            marker = f"@@raw{n}@@"
            parent[key] = marker
            raw_splices.append((json.dumps(marker), RAW_ATTACKS[attack]))
            described[-1] += f" ({attack})"
        elif name == "duplicate-key":
            if isinstance(parent, dict):
                marker = f"@@dup{n}@@"
                parent[marker] = 0
                raw_splices.append((json.dumps(marker), json.dumps(key)))
        elif name == "truncate":
            text_edits.append(lambda raw, s=value_seed: raw[: s % max(1, len(raw))])
        elif name == "not-utf8":
            text_edits.append(
                lambda raw, s=value_seed: raw[: s % max(1, len(raw))] + b"\xff" + raw[s % max(1, len(raw)) :]
            )
    text = json.dumps(obj)
    for marker, replacement in raw_splices:
        text = text.replace(marker, replacement)
    raw = text.encode("utf-8")
    for edit in text_edits:
        raw = edit(raw)
    return (obj if not (raw_splices or text_edits) else None), raw, "; ".join(described)
