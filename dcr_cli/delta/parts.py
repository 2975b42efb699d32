"""Producer parts: one process per rank writes its share of a delta; ``assemble`` merges them.

Layout (format_spec/producers.md): ``OUT/parts/rank-<R>/part.json`` + ``blocks/``.
A part is complete when its ``part.json`` exists (written last, atomically).
Assembly moves blocks (content-addressed, so a name collision is the same bytes)
into ``OUT/blocks/``, checks that the parts fit together (one world size, every
rank once, every canonical tensor digested exactly once, no two items overlap),
writes ``OUT/manifest.json`` last, then removes ``OUT/parts``. Re-running it
after a crash finishes the job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import ConflictError, FormatError
from ..format.digest import is_digest
from ..format.dtypes import dtype as lookup_dtype
from ..format.manifest import (
    BLOCKS_DIR,
    MANIFEST_NAME,
    READ_MAJORS,
    BlockEntry,
    Item,
    Manifest,
    Section,
    TensorEntry,
    VersionRef,
    fingerprint,
    parse_manifest,
)
from ..format.strict_json import load_json
from ..io.files import fsync_dir, write_atomic
from ..io.reading import read_regular_file
from .writer import DeltaWriter

PARTS_DIR = "parts"
PART_NAME = "part.json"
PART_FORMAT = "dcr.delta-part"
LOCK_NAME = ".assemble.lock"


def part_dir(out: str | os.PathLike[str], rank: int) -> Path:
    return Path(out) / PARTS_DIR / f"rank-{rank:05d}"


def finish_part(
    writer: DeltaWriter,
    *,
    rank: int,
    world_size: int,
    layout: dict[str, tuple[str, tuple[int, ...]]],
    base_digests: dict[str, str],
    target_digests: dict[str, str],
    residual: dict[str, str],
    base_version: str | None,
    target_version: str | None,
) -> None:
    with writer._lock:
        items = writer.placed_items()
        obj = {
            "format": PART_FORMAT,
            "format_version": [1, 1],
            "delta_major": writer.major,  # the sections' digests are those of this manifest major
            "rank": rank,
            "world_size": world_size,
            "base_version": base_version,
            "target_version": target_version,
            "tensors": {n: {"dtype": d, "shape": list(s)} for n, (d, s) in sorted(layout.items())},
            "base_digests": dict(sorted(base_digests.items())),
            "target_digests": dict(sorted(target_digests.items())),
            "residual_tensors": residual,
            "blocks": [{"id": b.id, "size": b.size, "role": b.role} for b in writer.blocks],
            "items": [it.to_json() for it in items],
        }
        writer.commit(PART_NAME, json.dumps(obj, separators=(",", ":")).encode())


def complete_parts(out: str | os.PathLike[str]) -> tuple[int, list[Path]] | None:
    """(world size, part dirs) when every rank's part is written, else None."""
    root = Path(out) / PARTS_DIR
    parts = sorted(p for p in root.glob("rank-*") if (p / PART_NAME).is_file()) if root.is_dir() else []
    if not parts:
        return None
    world = _load_part(parts[0])["world_size"]
    return (world, parts) if len(parts) == world else None


def try_assemble_last(out: str | os.PathLike[str]) -> Manifest | None:
    """Called by each producer after writing its part: the one that sees all parts (and wins the lock) assembles.

    A producer that finds the delta assembled already (another rank finished at the same moment and
    won) gets that delta's manifest: the same parts make the same delta, so both succeed.
    """
    if (assembled := _assembled(out)) is not None:
        return assembled
    try:
        if complete_parts(out) is None:
            return None
    except FormatError:
        if (assembled := _assembled(out)) is not None:
            return assembled  # the winner removed the parts while this rank read them
        raise
    try:
        fd = os.open(Path(out) / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return None  # another producer is assembling
    os.close(fd)
    try:
        if (assembled := _assembled(out)) is not None:
            return assembled  # it finished between our look at the parts and our lock
        return assemble(out)
    finally:
        (Path(out) / LOCK_NAME).unlink(missing_ok=True)  # a failed assembly can be re-run (dcr assemble)


def _assembled(out: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of the delta at ``out`` if it is assembled already, else None."""
    if not (Path(out) / MANIFEST_NAME).is_file():
        return None
    from .reader import Delta

    return Delta.open(out).manifest


# Top-level fields of part.json and the JSON types assembly relies on.
_PART_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rank": int,
    "world_size": int,
    "tensors": dict,
    "base_digests": dict,
    "target_digests": dict,
    "blocks": list,
    "items": list,
}


def _load_part(path: Path) -> dict[str, Any]:
    """Read and check one part.json: a truncated or foreign file is a FormatError, never a KeyError."""
    file = path / PART_NAME
    try:
        raw = read_regular_file(file)
    except OSError as exc:
        raise FormatError(f"{file} is unreadable ({exc.__class__.__name__}); rerun that rank") from None
    obj = load_json(raw, str(file))
    if not isinstance(obj, dict):
        raise FormatError(f"{file} is not a dcr delta part")
    version = obj.get("format_version")
    if obj.get("format") != PART_FORMAT or not (isinstance(version, list) and version):
        raise FormatError(f"{file} is not a dcr delta part")
    if version[0] != 1:
        raise FormatError(f"{file}: part format major {version[0]} unsupported; upgrade dcr")
    for key, kind in _PART_FIELDS.items():
        if not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
            raise FormatError(f"{file}: field {key!r} is missing or not a {getattr(kind, '__name__', kind)}")
    for t in obj["tensors"].values():
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)):
            raise FormatError(f"{file}: tensors need a dtype string and a shape list")
    for b in obj["blocks"]:
        # Block ids become file names below: only a digest can be one (no path may escape the delta).
        if not isinstance(b, dict) or not is_digest(b.get("id")) or not isinstance(b.get("size"), int):
            raise FormatError(f"{file}: blocks need a 64-hex id and an integer size")
        if b.get("role", "data") not in ("data", "repair"):
            raise FormatError(f"{file}: unknown block role {b.get('role')!r}")
    if obj.get("delta_major", 1) not in READ_MAJORS or isinstance(obj.get("delta_major"), bool):
        raise FormatError(f"{file}: delta_major {obj.get('delta_major')!r} unsupported; upgrade dcr")
    return obj


def assemble(out: str | os.PathLike[str]) -> Manifest:
    """Merge the producers' parts under ``out`` into one delta at ``out``."""
    out = Path(out)
    if (out / MANIFEST_NAME).exists():
        raise ConflictError(f"{out} is already an assembled delta")
    root = out / PARTS_DIR
    parts = sorted(p for p in root.glob("rank-*") if p.is_dir()) if root.is_dir() else []
    if not parts:
        raise FormatError(f"{out} holds no producer parts ({PARTS_DIR}/rank-*/{PART_NAME})")
    objs = [_load_part(p) for p in parts]
    world = objs[0]["world_size"]
    ranks = sorted(o["rank"] for o in objs)
    if any(o["world_size"] != world for o in objs) or ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise FormatError(f"{out}: parts are incomplete (world size {world}, missing ranks {missing}); rerun them")
    layout = objs[0]["tensors"]
    if any(o["tensors"] != layout for o in objs):
        raise FormatError(f"{out}: parts disagree on the canonical tensor table (different checkpoints?)")
    for key in ("base_version", "target_version", "residual_tensors", "delta_major"):  # the manifest takes rank 0's
        if any(o.get(key) != objs[0].get(key) for o in objs):
            raise FormatError(f"{out}: parts disagree on {key} (ranks run with different options?); rerun them")
    base_digests: dict[str, str] = {}
    target_digests: dict[str, str] = {}
    for o in objs:
        for given, table in ((o["base_digests"], base_digests), (o["target_digests"], target_digests)):
            for name, digest in given.items():
                if name in table:
                    raise FormatError(f"{out}: tensor {name!r} was digested by two parts")
                table[name] = digest
    missing = sorted(set(layout) - set(target_digests)) or sorted(set(layout) - set(base_digests))
    if missing:
        raise FormatError(f"{out}: no part digested tensor {missing[0]!r} ({len(missing)} such)")

    (out / BLOCKS_DIR).mkdir(exist_ok=True)
    blocks: list[BlockEntry] = []
    block_index: dict[tuple[str, str], int] = {}
    items: list[Item] = []
    for path, o in zip(parts, objs, strict=True):
        remap = []
        for b in o["blocks"]:
            entry = BlockEntry(b["id"], b["size"], b.get("role", "data"))
            src, dst = path / BLOCKS_DIR / entry.id, out / BLOCKS_DIR / entry.id
            if not dst.exists():
                if not src.exists():
                    raise FormatError(f"{out}: block {entry.id[:16]}… of {path.name} is missing")
                os.replace(src, dst)  # same file system; content-addressed, so never a collision
            if dst.stat().st_size != entry.size:
                raise FormatError(f"{out}: block {entry.id[:16]}… has the wrong size")
            k = (entry.id, entry.role)
            if k not in block_index:
                block_index[k] = len(blocks)
                blocks.append(entry)
            remap.append(block_index[k])
        for i, raw in enumerate(o["items"]):
            try:
                items.append(_remap_item(raw, remap))
            except (KeyError, TypeError, IndexError, AttributeError):
                raise FormatError(f"{path / PART_NAME}: items[{i}] is malformed; rerun that rank") from None
    fsync_dir(out / BLOCKS_DIR)

    tensors = {n: TensorEntry(t["dtype"], tuple(t["shape"]), target_digests[n]) for n, t in sorted(layout.items())}
    base_table = {n: TensorEntry(t["dtype"], tuple(t["shape"]), base_digests[n]) for n, t in sorted(layout.items())}
    for t in tensors.values():
        lookup_dtype(t.dtype)
    base_fp, target_fp = fingerprint(base_table), fingerprint(tensors)
    residual = objs[0].get("residual_tensors") or {}
    from datetime import datetime, timezone

    from .._version import __version__

    manifest = Manifest(
        base=VersionRef(objs[0].get("base_version") or base_fp[:16], base_fp),
        target=VersionRef(objs[0].get("target_version") or target_fp[:16], target_fp),
        tensors=tensors,
        items=items,
        blocks=blocks,
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        producer=f"dcr {__version__} (assembled from {world} parts)",
        extra={"residual_tensors": residual} if residual else {},
        major=objs[0].get("delta_major", 1),  # a part without it is from a 1.x writer: full section digests
    )
    manifest = dataclasses.replace(manifest, raw=manifest.to_json_bytes())
    raw = manifest.file_bytes()
    parse_manifest(raw)  # the same checks a reader makes, overlap included, before anything is published
    write_atomic(out / MANIFEST_NAME, raw)
    fsync_dir(out)
    shutil.rmtree(root, ignore_errors=True)
    return manifest


def _remap_item(raw: dict[str, Any], remap: list[int]) -> Item:
    from ..format.manifest import Region

    def section(obj: dict[str, Any]) -> Section:
        if not isinstance(obj["block"], int) or obj["block"] < 0:
            raise IndexError(obj["block"])  # a negative index would silently name another block
        return Section(remap[obj["block"]], obj["offset"], obj["length"], obj["digest"])

    return Item(
        tensor=raw["tensor"],
        region=Region.from_json(raw["region"], raw["tensor"]),
        op=raw["op"],
        count=raw["count"],
        data=section(raw["data"]),
        positions_length=raw["data"]["positions_length"],
        pre=raw["pre"],
        post=raw["post"],
        repair=section(raw["repair"]) if raw.get("repair") else None,
        residual=raw.get("residual"),
        changed=raw.get("changed"),
    )
