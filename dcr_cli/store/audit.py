"""``dcr check``: is the store consistent, and are the stored bytes intact?

Without ``read_data`` it checks structure only: records parse, the commit
chain is sound, every published manifest is intact and every block it lists is
present with its size. ``read_data`` downloads blocks and checks their
digests, all of them or a random sample. Objects no published version
references (left by a killed push, or by a version gc dropped) are reported,
not treated as damage. Nor are the absent repair blocks of a version whose push
has not marked it complete (store-v1 §4.1: they go up after the version record,
so a push may be uploading them right now, or was stopped after publishing):
they are reported apart, with the fix (re-run dcr push). Absent repair blocks
of a version marked complete, or published by a 1.0 writer (which uploaded
every block before the record), are damage.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DcrError
from ..format.manifest import BlockEntry, parse_manifest
from .backends import TMP_PREFIX
from .repo import (
    BLOCKS,
    COMMITS,
    COMPLETE,
    MANIFESTS,
    VERSIONS,
    CommitRecord,
    Ref,
    Store,
    StoreBlockSource,
    VersionRecord,
)
from .transfer import DEFAULT_WORKERS, block_intact, parallel


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
    # version -> repair blocks absent while its push has not marked it complete (uploading, or stopped after
    # publishing: re-run dcr push); not damage
    repair_pending: dict[str, int] = field(default_factory=dict)

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
    problems: list[str] = []
    records = _records(store, problems)
    try:
        chain = store.chain()
    except DcrError as exc:
        chain = []
        problems.append(str(exc))
    genesis = store.genesis()
    _check_chain(store, genesis, chain, records, problems)
    head = chain[-1].version if chain else genesis.version
    # The head and what waits on it are what receivers fetch: their manifests must be there.
    needed_now = {head} | {r.version for r in records.values() if r.base.version == head}

    manifest_names = {e.name for e in store.list(MANIFESTS)}
    blocks = {e.name: e.size for e in store.list(BLOCKS)}
    complete = {e.name for e in store.list(COMPLETE)}
    repair_pending: dict[str, int] = {}
    referenced: dict[str, int] = {}
    unavailable: list[str] = []
    checked = 0
    for record in sorted(records.values(), key=lambda r: r.version):
        if f"{record.manifest}.json" not in manifest_names:
            if record.version in needed_now:
                role = "head" if record.version == head else "pending version"
                problems.append(
                    f"the manifest of the {role} {record.version!r} is missing (manifests/{record.manifest[:16]}…); "
                    "push its delta again"
                )
            else:
                unavailable.append(record.version)
            continue
        try:
            manifest = parse_manifest(store.manifest_bytes(record))
        except DcrError as exc:
            problems.append(str(exc))
            continue
        if (manifest.base.fingerprint, manifest.target.fingerprint) != (
            record.base.fingerprint,
            record.target.fingerprint,
        ):
            problems.append(f"the manifest of version {record.version!r} does not match its version record")
        checked += 1
        data_ids = {b.id for b in manifest.blocks if b.role == "data"}
        # Repair blocks follow the record (1.1): absent ones are a pending upload until the push marks it complete.
        may_lack_repair = record.minor >= 1 and record.version not in complete
        for block in manifest.blocks:
            referenced[block.id] = block.size
            if block.id not in blocks and may_lack_repair and block.id not in data_ids:
                repair_pending[record.version] = repair_pending.get(record.version, 0) + 1
            elif block.id not in blocks:
                kind = "repair block" if block.id not in data_ids else "block"
                problems.append(f"{kind} {block.id[:16]}… of version {record.version!r} is missing")
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
        repair_pending=repair_pending,
    )

    if read_data or subset is not None:
        candidates = sorted(b for b in referenced if blocks.get(b) == referenced[b])
        if subset is not None:
            count = subset if isinstance(subset, int) else max(1, round(len(candidates) * subset))
            candidates = sorted(random.Random(seed).sample(candidates, min(count, len(candidates))))
        source = StoreBlockSource(store)

        def verify(block_id: str) -> bool:
            ok = block_intact(source, BlockEntry(block_id, referenced[block_id], "data"))  # bounded reads
            if progress is not None:
                progress(referenced[block_id])
            return ok

        intact = parallel((functools.partial(verify, b) for b in candidates), workers)
        result.blocks_read = len(candidates)
        result.bytes_read = sum(referenced[b] for b in candidates)
        problems.extend(
            f"block {b[:16]}… is corrupt (digest mismatch)" for b, ok in zip(candidates, intact, strict=True) if not ok
        )
    return result


def _records(store: Store, problems: list[str]) -> dict[str, VersionRecord]:
    """Every readable version record; an unreadable one is damage, reported, and the check goes on."""
    out: dict[str, VersionRecord] = {}
    for entry in store.list(VERSIONS):
        if not entry.name.endswith(".json") or entry.name.startswith(TMP_PREFIX):
            continue
        name = entry.name[: -len(".json")]
        try:
            record = store.version(name)
        except DcrError as exc:
            problems.append(f"versions/{entry.name}: {exc}")
            continue
        if record is None:
            continue
        if record.version != name:
            problems.append(f"versions/{entry.name} is the record of another version ({record.version!r})")
            continue
        out[name] = record
    return out


def _check_chain(
    store: Store, genesis: Ref, chain: list[CommitRecord], records: dict[str, VersionRecord], problems: list[str]
) -> None:
    """Each commit continues the one before, names a record built on that base with those fingerprints,
    and every commit record and the latest.json hint lie on the chain."""
    previous = genesis
    for c in chain:
        record = records.get(c.version)
        if c.base != previous:
            problems.append(
                f"commits/{previous.version}.json names a base {c.base.version!r} ({c.base.fingerprint[:16]}…) "
                f"that is not the state it follows ({previous.fingerprint[:16]}…)"
            )
        if record is None:
            problems.append(f"committed version {c.version!r} has no version record")
        elif record.base != c.base or record.target != c.target:
            problems.append(
                f"commits/{previous.version}.json commits {c.version!r}, but that version is built on "
                f"{record.base.version!r} ({record.base.fingerprint[:16]}…) -> {record.target.fingerprint[:16]}…, "
                f"not {c.base.version!r} ({c.base.fingerprint[:16]}…) -> {c.target.fingerprint[:16]}…"
            )
        previous = c.target
    on_chain = {genesis.version, *(c.version for c in chain)}
    bases = {genesis.version, *(c.version for c in chain[:-1])}
    for entry in store.list(COMMITS):
        name = entry.name[: -len(".json")] if entry.name.endswith(".json") else None
        if name is not None and not entry.name.startswith(TMP_PREFIX) and name not in bases:
            problems.append(
                f"commits/{entry.name} is not on the commit chain from the genesis (a commit record before it "
                "is missing?)"
            )
    hint = store.latest_hint()
    if hint is not None and hint not in on_chain:
        problems.append(
            f"latest.json names {hint!r}, which is not on the commit chain (it ends at "
            f"{chain[-1].version if chain else genesis.version!r}): a commit record is missing"
        )
