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

Keyframes (store-v1 §6.1) are checked too: each record under ``keyframes/``
parses strictly and is of a committed state with its fingerprint, and every file
it names is present under ``keyframes/<v>/`` with its size (one listing per
keyframe); ``read_data`` also reads each file and checks its BLAKE3, which the
object's name (``<BLAKE3>-<name>``) states. Files no record names (a publish
stopped before its record) are reported as leftovers, like unreferenced blocks.

Shortcuts (store-v1 §6.2) are checked as versions are: each record under ``shortcuts/<base>/`` parses, is
named for its base and target, joins two committed states with their fingerprints, and its manifest (when
present) has its digest and fingerprints and lists blocks that are present with their size (``read_data``:
their BLAKE3). A receiver catching up takes the cheapest route, so one damaged shortcut fails every lagging
receiver; a shortcut whose manifest is absent is not damage (receivers do not take it).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import DcrError, IntegrityError
from ..format.manifest import BlockEntry, parse_manifest
from ..format.store_records import SHORTCUTS
from ..io.pool import parallel
from .backends import TMP_PREFIX
from .repo import (
    BLOCKS,
    COMMITS,
    COMPLETE,
    MANIFESTS,
    VERSIONS,
    CommitRecord,
    ObjectBlockSource,
    Ref,
    Store,
    StoreBlockSource,
    VersionRecord,
    check_label,
)
from .transfer import DEFAULT_WORKERS, block_intact

if TYPE_CHECKING:
    from .keyframes import KeyframeFile

_DIGEST_NAMED = re.compile(r"([0-9a-f]{64})-.+", re.DOTALL)  # a keyframe object named by its content: <BLAKE3>-<name>


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
    keyframes: int = 0  # keyframe records read
    keyframe_files: int = 0  # files they name
    keyframe_files_read: int = 0
    keyframe_bytes_read: int = 0
    unreferenced_keyframe_files: list[str] = field(default_factory=list)  # "<v>/<object>" no record names
    shortcuts: int = 0  # shortcut records read
    unavailable_shortcuts: list[str] = field(default_factory=list)  # "<base>..<target>" whose manifest is absent
    # versions whose manifest is present but damaged: the blocks it lists are unknown, so some "unreferenced"
    # blocks may be theirs (gc stops on such a manifest rather than remove them)
    unreadable_manifests: list[str] = field(default_factory=list)

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
    # A .tmp-* object is an upload in progress (or killed): no block yet (store-v1 §1: readers ignore it).
    blocks = {e.name: e.size for e in store.list(BLOCKS) if not e.name.startswith(TMP_PREFIX)}
    complete = {e.name for e in store.list(COMPLETE)}
    repair_pending: dict[str, int] = {}
    referenced: dict[str, int] = {}
    unavailable: list[str] = []
    unreadable: list[str] = []  # versions whose manifest is there but damaged: their blocks are unknown
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
            unreadable.append(record.version)
            continue
        if (manifest.base.fingerprint, manifest.target.fingerprint) != (
            record.base.fingerprint,
            record.target.fingerprint,
        ):
            problems.append(
                f"the manifest of version {record.version!r} does not match its version record; "
                f"{store.record_fix(record)}"
            )
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

    shortcut_count, shortcut_manifests, unavailable_shortcuts = _check_shortcuts(
        store, genesis, chain, manifest_names, blocks, referenced, problems
    )
    published = {f"{r.manifest}.json" for r in records.values()} | shortcut_manifests
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
        shortcuts=shortcut_count,
        unavailable_shortcuts=unavailable_shortcuts,
        unreadable_manifests=unreadable,
    )

    frames, present, unreferenced_files = _check_keyframes(store, genesis, chain, problems)
    result.keyframes = len(frames)
    result.keyframe_files = sum(len(files) for files in frames.values())
    result.unreferenced_keyframe_files = unreferenced_files

    if read_data or subset is not None:
        candidates = sorted(b for b in referenced if blocks.get(b) == referenced[b])
        if subset is not None:
            count = subset if isinstance(subset, int) else max(1, round(len(candidates) * subset))
            candidates = sorted(random.Random(seed).sample(candidates, min(count, len(candidates))))
        # Keyframe files are sampled apart (the same N or P% of them): one is a whole checkpoint file.
        files = present
        if subset is not None:
            count = subset if isinstance(subset, int) else max(1, round(len(files) * subset))
            files = sorted(random.Random(seed).sample(files, min(count, len(files))))
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

        from .keyframes import keyframe_object

        def verify_file(version: str, f: KeyframeFile) -> bool:
            ok = block_intact(
                ObjectBlockSource(store, keyframe_object(version, f)), BlockEntry(f.digest, f.size, "data")
            )
            if progress is not None:
                progress(f.size)
            return ok

        intact = parallel((functools.partial(verify_file, v, f) for v, f in files), workers)
        result.keyframe_files_read = len(files)
        result.keyframe_bytes_read = sum(f.size for _, f in files)
        problems.extend(
            f"keyframe file {f.name} of {v!r} is corrupt: its bytes do not have the BLAKE3 {f.digest[:16]}… its "
            f"record and name say (keyframes/{v}/{f.stored[:40]}); {_republish(store, v)}"
            for (v, f), ok in zip(files, intact, strict=True)
            if not ok
        )
    return result


def _republish(store: Store, version: str) -> str:
    """The fix for a damaged keyframe: a publish stops at an existing record (store-v1 §6.1), so it goes first."""
    return (
        f"a joining receiver refuses it; remove keyframes/{version}.json, then publish it again "
        f"(dcr compact {store.url} --keyframe CHECKPOINT --version {version})"
    )


def _check_keyframes(
    store: Store, genesis: Ref, chain: list[CommitRecord], problems: list[str]
) -> tuple[dict[str, list[KeyframeFile]], list[tuple[str, KeyframeFile]], list[str]]:
    """Keyframe records and their files (store-v1 §6.1); damage goes to ``problems``.

    Returns (the files of each readable record, the files present with their size: what ``read_data``
    reads, the objects under ``keyframes/<v>/`` that no record names)."""
    from .keyframes import KEYFRAME_KIND, KEYFRAMES, KeyframeRecord

    committed = {genesis.version: genesis.fingerprint, **{c.target.version: c.target.fingerprint for c in chain}}
    frames: dict[str, list[KeyframeFile]] = {}
    for entry in sorted(store.list(KEYFRAMES), key=lambda e: e.name):  # findings in name order, on any backend
        if not entry.name.endswith(".json") or entry.name.startswith(TMP_PREFIX):
            continue
        name, rel = entry.name[: -len(".json")], f"{KEYFRAMES}/{entry.name}"
        try:
            check_label(name, "keyframe")
            obj = store.read_record(rel, KEYFRAME_KIND)
            if obj is None:  # removed since the listing (a gc dropping an old keyframe)
                continue
            record = KeyframeRecord.from_json(obj, f"{store.url}/{rel}")
        except DcrError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        if record.version != name:
            problems.append(f"{rel} is the record of another keyframe ({record.version!r})")
            continue
        frames[name] = record.files
        if name not in committed:
            problems.append(f"keyframe {name!r} is not of a committed version (receivers ignore it)")
        elif committed[name] != record.fingerprint:
            problems.append(
                f"keyframe {name!r} holds fingerprint {record.fingerprint[:16]}…, not its committed target "
                f"{committed[name][:16]}… (receivers ignore it)"
            )

    present: list[tuple[str, KeyframeFile]] = []
    unreferenced: list[str] = []
    folders = set(store.list_dirs(KEYFRAMES))
    for name in sorted(folders | set(frames)):
        listed = {e.name: e.size for e in store.list(f"{KEYFRAMES}/{name}")} if name in folders else {}
        files = frames.get(name, [])
        if any(listed.get(f.stored) is None for f in files) and not store.exists(f"{KEYFRAMES}/{name}.json"):
            # A gc dropped this keyframe while check ran (record first, then its files: §6.4); not damage.
            frames.pop(name)
            files = []
        for f in files:
            where = f"keyframe file {f.name} of {name!r}"
            named = _DIGEST_NAMED.fullmatch(f.stored)
            if named is not None and named[1] != f.digest:
                problems.append(
                    f"{where}: its object {f.stored[:40]} is named for BLAKE3 {named[1][:16]}…, but the record "
                    f"says {f.digest[:16]}…"
                )
            size = listed.get(f.stored)
            if size is None:
                problems.append(f"{where} is missing (keyframes/{name}/{f.stored[:40]}); {_republish(store, name)}")
            elif size != f.size:
                problems.append(f"{where} has {size} bytes, expected {f.size}; {_republish(store, name)}")
            else:
                present.append((name, f))
        stored = {f.stored for f in files}
        unreferenced.extend(f"{name}/{obj}" for obj in sorted(listed) if obj not in stored)
    return frames, present, unreferenced


def _check_shortcuts(
    store: Store,
    genesis: Ref,
    chain: list[CommitRecord],
    manifest_names: set[str],
    blocks: dict[str, int],
    referenced: dict[str, int],
    problems: list[str],
) -> tuple[int, set[str], list[str]]:
    """Shortcut records, their manifests and blocks (store-v1 §6.2); damage goes to ``problems``, and the
    blocks the shortcuts list join ``referenced`` (what ``read_data`` reads; no longer "unreferenced").

    Returns (records read, the manifest file names they name, "<base>..<target>" of those whose manifest is
    absent). A finding is dropped if the record is gone when it is made: gc removed it meanwhile (§6.4)."""
    from .keyframes import DamagedShortcut, read_shortcut

    committed = {genesis.version: genesis.fingerprint, **{c.target.version: c.target.fingerprint for c in chain}}
    count, manifests, unavailable = 0, set[str](), list[str]()
    for base in sorted(store.list_dirs(SHORTCUTS)):
        for entry in sorted(store.list(f"{SHORTCUTS}/{base}"), key=lambda e: e.name):
            if not entry.name.endswith(".json") or entry.name.startswith(TMP_PREFIX):
                continue
            rel = f"{SHORTCUTS}/{base}/{entry.name}"
            found: list[str] = []
            try:
                shortcut = read_shortcut(store, rel)
            except DamagedShortcut as exc:  # derived data: gc drops it, receivers leave it out meanwhile
                problems.append(
                    f"{exc} (a damaged shortcut record); receivers leave it out; dcr gc {store.url} drops it, "
                    f"dcr compact {store.url} --every K makes it anew"
                )
                continue
            except DcrError as exc:
                problems.append(f"{rel}: {exc}")
                continue
            if shortcut is None:
                continue
            record = shortcut.record
            count += 1
            fix = (
                f"receivers catching up fail on it; remove {rel}: they then take the chain "
                "(dcr compact --every K makes it anew)"
            )
            if (record.base.version, f"{record.version}.json") != (base, entry.name):
                found.append(f"{rel} is the record of another shortcut ({record.base.version}..{record.version})")
            for end in (record.base, record.target):
                if committed.get(end.version) != end.fingerprint:
                    found.append(
                        f"{rel} names {end.version!r} with fingerprint {end.fingerprint[:16]}…, which is not a "
                        "committed state (receivers ignore it)"
                    )
            name = f"{record.manifest}.json"
            manifests.add(name)
            if name not in manifest_names:
                unavailable.append(f"{record.base.version}..{record.version}")
            else:
                try:
                    manifest = parse_manifest(store.manifest_bytes(record, shortcut=True))
                except IntegrityError as exc:  # names the shortcut and its fix
                    found.append(f"{exc} (receivers catching up fail on it)")
                    manifest = None
                except DcrError as exc:
                    found.append(f"{rel}: {exc}; {fix}")
                    manifest = None
                if manifest is not None:
                    if (manifest.base.fingerprint, manifest.target.fingerprint) != (
                        record.base.fingerprint,
                        record.target.fingerprint,
                    ):
                        found.append(f"the manifest of {rel} does not match its record; {fix}")
                    for block in manifest.blocks:  # all of a shortcut's blocks precede its record
                        referenced[block.id] = block.size
                        if block.id not in blocks:
                            found.append(f"block {block.id[:16]}… of {rel} is missing; {fix}")
                        elif blocks[block.id] != block.size:
                            found.append(
                                f"block {block.id[:16]}… of {rel} has {blocks[block.id]} bytes, expected "
                                f"{block.size}; {fix}"
                            )
            if found and store.exists(rel):
                problems.extend(found)
    return count, manifests, unavailable


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
