"""Where a delta's blocks come from: a block source reads byte ranges of content-addressed blocks.

A delta directory (format_spec/delta-v1.md §3) and a dcr store (format_spec/store-v1.md §1) keep
blocks the same way, as ``<root>/blocks/<id>``. The plain source below reads them through any
fsspec filesystem (local files with pread, refusing anything that is not a plain file); the store
gives its own source, which goes through the store's calls (``dcr_cli/store/repo.py``). Both retry
transient errors with one policy, ``io/retry.calling`` and the client library's table of transient
errors (``io/retry.transient_for``): a delta opened by its location (a delta directory URL, a store
manifest) is read as patiently as one opened through its store. A missing object and a digest
mismatch are not retried.

Reads are bounded by what the manifest declares: a block is fetched in ranges up to its declared
size plus one byte, so an object larger than declared is refused after reading at most that much,
and its digest is computed as the ranges arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import DcrError, IntegrityError, NotReadyError
from ..format.digest import StreamingDigest
from ..format.manifest import BLOCKS_DIR, BlockEntry
from ..format.store_records import (
    COMPLETE,
    MARKER,
    MAX_RECORD_BYTES,
    SHORTCUT_KIND,
    SHORTCUTS,
    STORE_FORMAT,
    VERSION_KIND,
    VERSIONS,
    is_label,
    parse_record,
    redo_shortcut,
)
from ..io.reading import RegularFiles, read_regular_file
from ..io.retry import calling, transient_for

T = TypeVar("T")
CHUNK_BYTES = 16 << 20  # one ranged read while a whole block is verified


class BlockSource:
    """Blocks under ``<root>/blocks/`` of an fsspec filesystem."""

    # What a receiver is told to do when a torn item needs a repair block this source does not have.
    missing_repair_advice = "fetch the delta with its repair blocks and re-run"
    # What a reader is told when a block's bytes are not the ones its name (their digest) says.
    damaged_advice = "fetch the delta again (dcr pull checks every block it downloads) or re-run dcr diff, then re-run"
    # Whether a receiver checks the repair blocks here whole before its first write (a delta directory on
    # this machine: cheap, and damage is caught up front). A store's are read only by a torn item
    # (delta-v1 §7.3), wherever the store lives: a file:// store on a shared mount is a transfer too.
    checks_repairs_up_front = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, label: str | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or root
        self.label = label or root
        self.local = isinstance(fs, LocalFileSystem)
        self._files = RegularFiles()  # local block files stay open across the many small section reads
        self._transient = transient_for(fs.protocol)  # the client library's transient errors, as the store's

    def path(self, block: BlockEntry) -> str:
        return f"{self.root}/{BLOCKS_DIR}/{block.id}"

    def missing_repair(self, what: str) -> DcrError:
        """The error for a torn item whose repair block this source lacks (``what``: the item and that fact).

        A delta directory either has its repair blocks or was fetched without them: bad input (exit 2).
        A store's source tells a repair upload still to come (exit 4) from a lost block (store-v1 §4.1)."""
        return IntegrityError(f"{what}; {self.missing_repair_advice}")

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run one read, retried on transient errors as a store's calls are; a client-library error that
        is not an OSError becomes one DcrError line (FileNotFoundError and the like pass through)."""
        return calling(fn, f"{self.label}: {what}", self._transient)

    def read(self, block: BlockEntry, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a block (fewer if the object is shorter); FileNotFoundError if absent."""
        path = self.path(block)
        if self.local:
            return self.call(lambda: self._files.read(path, start, end), f"read {path}")
        return self.call(lambda: bytes(self.fs.cat_file(path, start=start, end=end)), f"read {path}")

    def exists(self, block: BlockEntry) -> bool:
        path = self.path(block)
        return bool(self.call(lambda: self.fs.exists(path), f"check {path}"))

    @property
    def remote(self) -> bool:
        """Whether reading a block costs a transfer (then a verified block is worth keeping)."""
        return not self.local

    def chunks(self, block: BlockEntry, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The whole block in ranges, checked against its declared size and its id as they arrive.

        Reads at most the declared size plus one byte. The block is valid only once the iterator is
        exhausted: it raises IntegrityError (or FileNotFoundError) instead of finishing otherwise.
        """
        digest = StreamingDigest()
        for lo in range(0, max(block.size, 1), chunk_bytes):
            hi = min(lo + chunk_bytes, block.size)
            last = hi == block.size
            data = self.read(block, lo, hi + 1 if last else hi)  # one byte more: is the object longer?
            if len(data) > hi - lo:
                raise IntegrityError(
                    f"block {block.id[:16]}… in {self.label} is larger than the {block.size} bytes the manifest says"
                )
            if len(data) < hi - lo:
                raise IntegrityError(f"block {block.id[:16]}… in {self.label} is truncated")
            digest.update(data)
            yield data
        if digest.hexdigest() != block.id:
            raise IntegrityError(
                f"block {block.id[:16]}… in {self.label} is corrupt (digest mismatch); {self.damaged_advice}"
            )


class StoreManifestSource(BlockSource):
    """The blocks of a manifest opened by its location in a dcr store, ``STORE/manifests/<digest>.json``
    (``Delta.open``; the location a Delta opened through the store gives, e.g. to a vLLM worker).

    It reads blocks as the plain source does. Only a torn item whose repair block is absent asks the
    store which version (or shortcut) this manifest is, so that the answer agrees with opening it through
    the store (store-v1 §4.1, ``StoreBlockSource.missing_repair``): not ready (exit 4) while that
    version's push may still be uploading its repair blocks, lost (exit 2) once it is complete. A delta
    knows its labels but not the store's record, so the record is looked up by them
    (``versions/<target>.json``, then ``shortcuts/<base>/<target>.json``) and taken only if it names this
    manifest's digest: no listing, and nothing is asked on the normal path.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        *,
        label: str,
        store_url: str,
        manifest_id: str,
        base_version: str,
        target_version: str,
    ) -> None:
        super().__init__(fs, root, label=label)
        self.store_url = store_url
        self.manifest_id = manifest_id
        self.base_version = base_version
        self.target_version = target_version

    def missing_repair(self, what: str) -> DcrError:
        url, target = self.store_url, self.target_version
        try:
            if self._record(MARKER, STORE_FORMAT) is None:  # laid out like a store, but not one
                return super().missing_repair(what)
            record, kind = self._naming_record()
            if record is None:
                return IntegrityError(
                    f"{what}; {url} publishes no version or shortcut with this manifest (not yet, or no longer): "
                    f"open it through the store (dcr apply {url} --version VERSION), or fetch the delta with "
                    "its repair blocks (dcr pull --repair), then re-run"
                )
            promised = kind == "shortcut" or record["format_version"][1] < 1 or self._exists(f"{COMPLETE}/{target}")
        except DcrError as exc:  # fail closed either way; the line says what could not be asked
            return IntegrityError(f"{what}; asking {url} whether its push is still uploading it failed: {exc}")
        if promised:
            if kind == "shortcut":  # written by dcr compact, which keeps a shortcut whose record is there
                base = self.base_version
                return IntegrityError(
                    f"{what}; {url} lost it although shortcut {base}..{target} is complete there: "
                    f"{redo_shortcut(url, base, target)}, then re-run"
                )
            return IntegrityError(
                f"{what}; {url} lost it although version {target!r} is complete there: "
                f"restore it with dcr push DELTA {url}, then re-run"
            )
        return NotReadyError(
            f"{what}; {url} does not have it yet: the producer's dcr push of {target!r} is still uploading "
            f"repair blocks or was stopped after publishing; wait for it to finish, or re-run dcr push DELTA {url}, "
            "then re-run"
        )

    def _naming_record(self) -> tuple[dict[str, Any] | None, str]:
        """The version or shortcut record that names this manifest, and which kind it is (None if neither)."""
        base, target = self.base_version, self.target_version
        if not is_label(target):
            return None, ""
        record = self._record(f"{VERSIONS}/{target}.json", VERSION_KIND)
        if record is not None and record.get("manifest") == self.manifest_id:
            return record, "version"
        if is_label(base):
            record = self._record(f"{SHORTCUTS}/{base}/{target}.json", SHORTCUT_KIND)
            if record is not None and record.get("manifest") == self.manifest_id:
                return record, "shortcut"
        return None, ""

    def _record(self, rel: str, kind: str) -> dict[str, Any] | None:
        """A store record of ``kind`` (parsed as the store parses it), or None if absent."""
        path = f"{self.root}/{rel}"
        where = f"{self.store_url}/{rel}"
        end = MAX_RECORD_BYTES + 1  # one byte more: is it larger?
        try:
            if self.local:  # a plain file only (a FIFO would block the read)
                raw = read_regular_file(path, 0, end)
            else:
                raw = self.call(lambda: bytes(self.fs.cat_file(path, start=0, end=end)), f"read {path}")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise DcrError(f"{where}: {exc.strerror or exc}") from None
        return parse_record(raw, kind, where)

    def _exists(self, rel: str) -> bool:
        path = f"{self.root}/{rel}"
        try:
            return bool(self.call(lambda: self.fs.isfile(path), f"check {path}"))
        except (FileNotFoundError, NotADirectoryError):
            return False
