"""``dcr check``: is the store consistent, and are the stored bytes intact?

Without ``read_data`` it checks structure only: records parse, the commit
chain is sound, every published manifest is intact and every block it lists is
present with its size. ``read_data`` downloads blocks and checks their
digests, all of them or a random sample. Objects no published version
references (left by a killed push, or by a version gc dropped) are reported,
not treated as damage.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DcrError
from ..format.digest import digest_bytes
from ..format.manifest import parse_manifest
from .repo import BLOCKS, MANIFESTS, Store
from .transfer import DEFAULT_WORKERS, parallel


@dataclass
class CheckResult:
    store: str
    versions: int
    committed: int
    manifests_checked: int
    blocks: int
    blocks_read: int
    bytes_read: int
    problems: list[str] = field(default_factory=list)
    unavailable_versions: list[str] = field(default_factory=list)  # manifest removed by gc
    unreferenced_blocks: list[str] = field(default_factory=list)
    unreferenced_manifests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def parse_subset(text: str) -> float | int:
    """'10%' -> 0.1 (a fraction of the blocks); '25' -> 25 (a number of blocks)."""
    try:
        if text.endswith("%"):
            value = float(text[:-1]) / 100
            if not 0 < value <= 1:
                raise ValueError
            return value
        count = int(text)
        if count < 1:
            raise ValueError
        return count
    except ValueError:
        raise DcrError(f"--read-data-subset {text!r}: give a percentage (10%) or a number of blocks (25)") from None


def check(
    url: str,
    *,
    read_data: bool = False,
    subset: float | int | None = None,
    seed: int | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckResult:
    store = Store(url, storage_options)
    store.require_marker()
    records = store.versions()
    problems: list[str] = []
    try:
        chain = store.chain()
    except DcrError as exc:
        chain = []
        problems.append(str(exc))
    for c in chain:
        if c.version not in records:
            problems.append(f"committed version {c.version!r} has no version record")

    manifest_names = {e.name for e in store.list(MANIFESTS)}
    blocks = {e.name: e.size for e in store.list(BLOCKS)}
    referenced: dict[str, int] = {}
    unavailable: list[str] = []
    checked = 0
    for record in sorted(records.values(), key=lambda r: r.version):
        if f"{record.manifest}.json" not in manifest_names:
            unavailable.append(record.version)
            continue
        try:
            manifest = parse_manifest(store.manifest_bytes(record))
        except DcrError as exc:
            problems.append(str(exc))
            continue
        checked += 1
        for block in manifest.blocks:
            referenced[block.id] = block.size
            if block.id not in blocks:
                problems.append(f"block {block.id[:16]}… of version {record.version!r} is missing")
            elif blocks[block.id] != block.size:
                problems.append(
                    f"block {block.id[:16]}… of version {record.version!r} has {blocks[block.id]} bytes, "
                    f"expected {block.size}"
                )

    published = {f"{r.manifest}.json" for r in records.values()}
    result = CheckResult(
        store=url,
        versions=len(records),
        committed=len(chain),
        manifests_checked=checked,
        blocks=len(blocks),
        blocks_read=0,
        bytes_read=0,
        problems=problems,
        unavailable_versions=unavailable,
        unreferenced_blocks=sorted(name for name in blocks if name not in referenced),
        unreferenced_manifests=sorted(name for name in manifest_names if name not in published),
    )

    if read_data or subset is not None:
        candidates = sorted(b for b in referenced if blocks.get(b) == referenced[b])
        if subset is not None:
            count = subset if isinstance(subset, int) else max(1, round(len(candidates) * subset))
            candidates = sorted(random.Random(seed).sample(candidates, min(count, len(candidates))))
        corrupt: list[str] = []

        def verify(block_id: str) -> Callable[[], None]:
            def run() -> None:
                data = store.read(f"{BLOCKS}/{block_id}")
                if len(data) != referenced[block_id] or digest_bytes(data) != block_id:
                    corrupt.append(block_id)
                if progress is not None:
                    progress(len(data))

            return run

        parallel((verify(b) for b in candidates), workers)
        result.blocks_read = len(candidates)
        result.bytes_read = sum(referenced[b] for b in candidates)
        problems.extend(f"block {b[:16]}… is corrupt (digest mismatch)" for b in sorted(corrupt))
    return result
