"""The delta manifest: data model, encoding and validation (format_spec/delta-v1.md, delta-v2.md).

Two majors share one data model. 1.x is plain JSON with one object per tensor and item; 2.x is one
zstd frame around a compact JSON document (rows instead of objects, items naming their tensor by
table index, 128-bit section digests). The first bytes tell them apart (the zstd magic); the inner
``format_version`` decides, and a zstd-wrapped 1.x or a plain-JSON 2.x is refused.

Parsing is strict about what a reader needs (required fields, types, limits,
the major version) and lenient about everything else: unknown optional fields
are ignored so that minor versions can add them.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

import blake3
import numpy as np
import zstandard

from ..errors import FormatError
from .digest import digest_bytes, is_digest
from .dtypes import dtype as lookup_dtype
from .dtypes import numel
from .strict_json import load_json

FORMAT_NAME = "dcr.delta"
FORMAT_MAJOR = 2  # what dcr writes
FORMAT_MINOR = 0
READ_MAJORS = (1, 2)  # what dcr reads
# Section digests: full 256-bit in 1.x, a 128-bit BLAKE3 output (the prefix of the full one) in 2.x.
SECTION_DIGEST_BYTES = {1: 32, 2: 16}
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# measured on an MoE manifest of 6k tensors: level 1 is 8% smaller than level 3 (961 vs 1,041 kB) and 2x as fast
MANIFEST_ZSTD_LEVEL = 1

MANIFEST_NAME = "manifest.json"
BLOCKS_DIR = "blocks"

# Limits a reader enforces before allocating anything (format_spec §8).
MAX_MANIFEST_BYTES = 256 << 20
MAX_BLOCK_BYTES = 1 << 30
MAX_REGION_ELEMENTS = 1 << 31  # positions are coded as u32 gaps
MAX_TENSOR_BYTES = (1 << 63) - 1  # a tensor's stored bytes must be addressable with a signed 64-bit offset
TARGET_BLOCK_BYTES = 64 << 20

Op = Literal["xor", "overwrite", "replace"]
OPS: tuple[str, ...] = ("xor", "overwrite", "replace")
BlockRole = Literal["data", "repair"]


@dataclass(frozen=True)
class Region:
    """A part of a canonical tensor: a flat element range or an N-d box.

    Positions inside an item are indices into the region's own C-order
    enumeration, so one region type serves whole tensors, flat chunks and
    the per-rank boxes of training shards alike.
    """

    start: int | None = None  # flat range [start, stop)
    stop: int | None = None
    offsets: tuple[int, ...] | None = None  # box
    sizes: tuple[int, ...] | None = None

    @staticmethod
    def range(start: int, stop: int) -> Region:
        return Region(start=int(start), stop=int(stop))

    @staticmethod
    def box(offsets: tuple[int, ...] | list[int], sizes: tuple[int, ...] | list[int]) -> Region:
        return Region(offsets=tuple(int(o) for o in offsets), sizes=tuple(int(s) for s in sizes))

    @property
    def is_box(self) -> bool:
        return self.offsets is not None

    @property
    def size(self) -> int:
        if self.is_box:
            assert self.sizes is not None
            return numel(self.sizes)
        assert self.start is not None and self.stop is not None
        return self.stop - self.start

    def to_canonical(self, positions: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Map region-local positions to flat C-order indices of the whole tensor."""
        positions = positions.astype(np.int64, copy=False)
        if not self.is_box:
            assert self.start is not None
            return positions + self.start if self.start else positions
        assert self.offsets is not None and self.sizes is not None
        if len(shape) == 0:
            return positions
        coords = np.unravel_index(positions, self.sizes)
        shifted = tuple(c + o for c, o in zip(coords, self.offsets, strict=True))
        return np.ravel_multi_index(shifted, shape).astype(np.int64, copy=False)

    def check_within(self, shape: tuple[int, ...], where: str) -> None:
        total = numel(shape)
        if self.is_box:
            assert self.offsets is not None and self.sizes is not None
            if len(self.offsets) != len(shape) or len(self.sizes) != len(shape):
                raise FormatError(f"{where}: box rank does not match tensor rank {len(shape)}")
            for o, s, d in zip(self.offsets, self.sizes, shape, strict=True):
                if o < 0 or s < 0 or o + s > d:
                    raise FormatError(f"{where}: box {self.offsets}+{self.sizes} outside shape {shape}")
        else:
            assert self.start is not None and self.stop is not None
            if not 0 <= self.start <= self.stop <= total:
                raise FormatError(f"{where}: range [{self.start}, {self.stop}) outside {total} elements")
        if self.size > MAX_REGION_ELEMENTS:
            raise FormatError(f"{where}: region of {self.size} elements exceeds the 2^31 limit")

    def to_json(self) -> dict[str, Any]:
        if self.is_box:
            return {"offsets": list(self.offsets or ()), "sizes": list(self.sizes or ())}
        return {"start": self.start, "stop": self.stop}

    @staticmethod
    def from_json(obj: Any, where: str) -> Region:
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: region must be an object")
        is_box = "offsets" in obj or "sizes" in obj
        if is_box and ("start" in obj or "stop" in obj):
            raise FormatError(f"{where}: a region is a range (start, stop) or a box (offsets, sizes), not both")
        if is_box:
            offsets, sizes = obj.get("offsets"), obj.get("sizes")
            if not (_int_list(offsets) and _int_list(sizes)) or len(offsets) != len(sizes):
                raise FormatError(f"{where}: box region needs integer lists offsets and sizes of one length")
            return Region.box(offsets, sizes)
        start, stop = obj.get("start"), obj.get("stop")
        if not (_is_int(start) and _is_int(stop)):
            raise FormatError(f"{where}: region needs integer start and stop, or offsets and sizes")
        return Region.range(start, stop)


@dataclass(frozen=True)
class Section:
    """A byte range of one block file, with the digest of exactly those bytes."""

    block: int  # index into Manifest.blocks
    offset: int
    length: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"block": self.block, "offset": self.offset, "length": self.length, "digest": self.digest}

    @staticmethod
    def from_json(obj: Any, where: str) -> Section:
        """A 1.x section object."""
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: section must be an object")
        return Section.checked(obj.get("block"), obj.get("offset"), obj.get("length"), obj.get("digest"), 1, where)

    @staticmethod
    def checked(block: Any, offset: Any, length: Any, digest: Any, major: int, where: str) -> Section:
        if not (_is_int(block) and _is_int(offset) and _is_int(length)) or min(block, offset, length) < 0:
            raise FormatError(f"{where}: section needs non-negative integers block, offset, length")
        hex_len = 2 * SECTION_DIGEST_BYTES[major]
        if not is_digest(digest, hex_len):
            raise FormatError(f"{where}: section digest must be {hex_len} lowercase hex characters")
        return Section(block, offset, length, digest)


def section_digest(data: bytes | bytearray | memoryview | np.ndarray, major: int) -> str:
    """THE section digest of a delta of format major ``major``: what writers record and readers compare."""
    if type(data) is bytes and len(data) <= _SMALL_SECTION:  # a section's bytes, as read: one BLAKE3 call
        return blake3.blake3(data).hexdigest(length=SECTION_DIGEST_BYTES[major])
    return digest_bytes(data, SECTION_DIGEST_BYTES[major])


# Sections up to this size are digested by one single-threaded BLAKE3 call (digest_bytes' own
# threshold for its thread pool is larger): the same digest, without the wrapper's conversions.
_SMALL_SECTION = 1 << 20


@dataclass(frozen=True)
class Item:
    """One change to one region of one canonical tensor."""

    tensor: str
    region: Region
    op: Op
    count: int  # affected elements (for replace: the region size)
    data: Section  # zstd(positions) ++ zstd(values); positions absent for replace
    positions_length: int  # bytes of data that hold the positions frame
    pre: str  # digest of the affected elements' bytes before
    post: str  # digest of the affected elements' bytes after
    repair: Section | None = None  # zstd(target values); present on every xor item
    residual: str | None = None  # why a producer took the residual (assembled) path
    changed: int | None = None  # replace only: how many of the region's elements differ

    @property
    def changed_elements(self) -> int:
        return self.changed if self.changed is not None else self.count

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "tensor": self.tensor,
            "region": self.region.to_json(),
            "op": self.op,
            "count": self.count,
            "data": {**self.data.to_json(), "positions_length": self.positions_length},
            "pre": self.pre,
            "post": self.post,
        }
        if self.repair is not None:
            obj["repair"] = self.repair.to_json()
        if self.residual is not None:
            obj["residual"] = self.residual
        if self.changed is not None:
            obj["changed"] = self.changed
        return obj


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    digest: str  # of the whole tensor's stored bytes, C order, little-endian

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * lookup_dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "digest": self.digest}


@dataclass(frozen=True)
class BlockEntry:
    id: str  # digest of the block file; the file is blocks/<id>
    size: int
    role: BlockRole

    @property
    def path(self) -> str:
        return f"{BLOCKS_DIR}/{self.id}"


@dataclass(frozen=True)
class VersionRef:
    version: str
    fingerprint: str


@dataclass(frozen=True)
class Manifest:
    """A delta's manifest. Never changed once made: a process shares one parse of the same bytes between
    every delta opened from them (``delta.reader``), so its table, items and blocks are read-only too."""

    base: VersionRef
    target: VersionRef
    tensors: dict[str, TensorEntry]
    items: list[Item]
    blocks: list[BlockEntry]
    created: str = ""
    producer: str = ""
    minor: int = FORMAT_MINOR
    extra: dict[str, Any] = field(default_factory=dict)  # unknown optional fields, kept verbatim
    major: int = FORMAT_MAJOR  # 1: plain JSON (delta-v1.md); 2: compact JSON in one zstd frame (delta-v2.md)
    # The manifest.json bytes this manifest was parsed from or written as (set by parse_manifest and
    # DeltaWriter), so that a summary need not encode and compress it again; never compared.
    raw: bytes | None = field(default=None, compare=False, repr=False)

    def file_bytes(self) -> bytes:
        """The bytes of its manifest.json: those it was read from or written as, else encoded now."""
        return self.raw if self.raw is not None else self.to_json_bytes()

    @property
    def format_version(self) -> str:
        return f"{self.major}.{self.minor}"

    def section_digest(self, data: bytes | bytearray | memoryview | np.ndarray) -> str:
        """The digest a section of this manifest records for ``data`` (compare with ``Section.digest``)."""
        return section_digest(data, self.major)

    def to_json_bytes(self, level: int = MANIFEST_ZSTD_LEVEL) -> bytes:
        """The bytes of ``manifest.json`` in this manifest's major: plain JSON (1.x) or one zstd frame (2.x)
        compressed at zstd ``level`` (a writer's choice, delta-v2 §3.1)."""
        text = self.json_text()
        if self.major == 1:
            return text
        compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        return compressor.compress(text)

    def json_text(self) -> bytes:
        """The manifest's JSON document (for 2.x: the content of the zstd frame)."""
        head: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": [self.major, self.minor],
            "producer": self.producer,
            "created": self.created,
            "base": {"version": self.base.version, "fingerprint": self.base.fingerprint},
            "target": {"version": self.target.version, "fingerprint": self.target.fingerprint},
        }
        if self.major == 1:
            obj = {
                **head,
                "blocks": [{"id": b.id, "size": b.size, "role": b.role} for b in self.blocks],
                "tensors": {name: t.to_json() for name, t in self.tensors.items()},
                "items": [it.to_json() for it in self.items],
            }
        elif self.major == 2:
            return self._json_text_v2(head)
        else:
            raise ValueError(f"cannot write delta format major {self.major}")
        for key, value in self.extra.items():
            obj.setdefault(key, value)
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def _json_text_v2(self, head: dict[str, Any]) -> bytes:
        """The 2.x document, byte for byte ``json.dumps`` of its object (compact separators, no ASCII
        escaping), with the tensor table and the items written row by row from templates: an MoE
        manifest has 100k of each, which the generic encoder takes several microseconds apiece for."""
        index = {name: i for i, name in enumerate(self.tensors)}
        if any(type(key) is not str for key in self.extra):  # keys json.dumps would convert: its own way
            return self._json_text_v2_generic(head, index)
        dumps = _compact_dumps
        enc = _encode_string
        shapes: dict[Any, str] = {}
        tensor_rows = []
        for name, t in self.tensors.items():
            shape = t.shape
            try:
                text = shapes.get(shape)
            except TypeError:  # an unhashable shape (not a tuple of ints): the generic encoder says what it is
                text = None
            if text is None:
                text = dumps(list(shape))
                if type(shape) is tuple and all(type(d) is int for d in shape):
                    shapes[shape] = text
            try:
                tensor_rows.append(f"[{enc(name)},{enc(t.dtype)},{text},{enc(t.digest)}]")
            except TypeError:  # a field that is no string: as the generic encoder writes (or refuses) it
                tensor_rows.append(dumps([name, t.dtype, list(t.shape), t.digest]))
        obj: dict[str, Any] = {
            **head,
            "blocks": [[b.id, b.size, b.role] for b in self.blocks],
            "tensors": _Rows(tensor_rows),
            "items": _Rows([_item_text(it, index[it.tensor]) for it in self.items]),
        }
        for key, value in self.extra.items():
            obj.setdefault(key, value)
        parts = [
            f"{enc(key)}:{','.join(value).join('[]') if type(value) is _Rows else dumps(value)}"
            for key, value in obj.items()
        ]
        return ("{" + ",".join(parts) + "}").encode("utf-8")

    def _json_text_v2_generic(self, head: dict[str, Any], index: dict[str, int]) -> bytes:
        """The 2.x document from its object by ``json.dumps`` (what ``_json_text_v2`` writes faster)."""
        obj: dict[str, Any] = {
            **head,
            "blocks": [[b.id, b.size, b.role] for b in self.blocks],
            "tensors": [[name, t.dtype, list(t.shape), t.digest] for name, t in self.tensors.items()],
            "items": [_item_row(it, index[it.tensor]) for it in self.items],
        }
        for key, value in self.extra.items():
            obj.setdefault(key, value)
        return _compact_dumps(obj).encode("utf-8")

    def payload_bytes(self) -> int:
        """Bytes a receiver fetches for a normal apply: manifest excluded, repair blocks excluded."""
        return sum(b.size for b in self.blocks if b.role == "data")

    def repair_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.role == "repair")

    def total_elements(self) -> int:
        return self._sizes()[0]

    def changed_elements(self) -> int:
        return sum(it.changed if it.changed is not None else it.count for it in self.items)

    def full_bytes(self) -> int:
        """Stored size of the whole target model: what a dense refit moves."""
        return self._sizes()[1]

    def _sizes(self) -> tuple[int, int]:
        """(elements, stored bytes) of the tensor table, each (dtype, shape) sized once (an MoE table
        repeats a few of them 100k times)."""
        sizes: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
        elements = nbytes = 0
        for t in self.tensors.values():
            try:
                known = sizes.get((t.dtype, t.shape))
            except TypeError:  # an unhashable shape (a damaged record): sized as before, not remembered
                known = (t.numel, t.nbytes)
            if known is None:
                known = sizes[(t.dtype, t.shape)] = (t.numel, t.nbytes)
            elements += known[0]
            nbytes += known[1]
        return elements, nbytes


class _Rows(list):  # type: ignore[type-arg]
    """Rows already written as JSON text (``Manifest._json_text_v2``)."""


def _compact_dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_encode_string = json.encoder.encode_basestring  # type: ignore[attr-defined]  # what json.dumps uses for str (no ASCII escaping)


def _item_text(it: Item, tensor: int) -> str:
    """``_compact_dumps(_item_row(it, tensor))``: from a template where every field has its usual type."""
    r, d, rp = it.region, it.data, it.repair
    if (
        r.offsets is not None
        or it.residual is not None
        or it.changed is not None
        or type(r.start) is not int
        or type(r.stop) is not int
        or type(it.count) is not int
        or type(d.block) is not int
        or type(d.offset) is not int
        or type(d.length) is not int
        or type(it.positions_length) is not int
        or type(tensor) is not int
        or (rp is not None and not (type(rp.block) is type(rp.offset) is type(rp.length) is int))
    ):
        return _compact_dumps(_item_row(it, tensor))
    enc = _encode_string
    try:
        repair = "null" if rp is None else f"[{rp.block},{rp.offset},{rp.length},{enc(rp.digest)}]"
        return (
            f"[{tensor},{enc(it.op)},{it.count},[{r.start},{r.stop}],"
            f"[{d.block},{d.offset},{d.length},{it.positions_length},{enc(d.digest)}],{repair},"
            f"{enc(it.pre)},{enc(it.post)}]"
        )
    except TypeError:  # a field that is no string: as the generic encoder writes (or refuses) it
        return _compact_dumps(_item_row(it, tensor))


def _item_row(it: Item, tensor: int) -> list[Any]:
    """A 2.x item: [tensor, op, count, region, data, repair, pre, post(, optional members)] (delta-v2 §4.4)."""
    r = it.region
    region: list[Any] = [list(r.offsets or ()), list(r.sizes or ())] if r.is_box else [r.start, r.stop]
    d, rp = it.data, it.repair
    row: list[Any] = [
        tensor,
        it.op,
        it.count,
        region,
        [d.block, d.offset, d.length, it.positions_length, d.digest],
        None if rp is None else [rp.block, rp.offset, rp.length, rp.digest],
        it.pre,
        it.post,
    ]
    optional: dict[str, Any] = {}
    if it.residual is not None:
        optional["residual"] = it.residual
    if it.changed is not None:
        optional["changed"] = it.changed
    if optional:
        row.append(optional)
    return row


def fingerprint(tensors: dict[str, TensorEntry]) -> str:
    """Model fingerprint: the digest of the canonical tensor table (format_spec §4.3)."""
    # Sorted by the names' UTF-8 bytes: the order of their code points (UTF-8 keeps it), so a plain
    # sort of the names; a name that cannot be encoded fails the final encode as it failed the key.
    shapes: dict[tuple[int, ...], str] = {}  # an MoE table repeats a few shapes 100k times
    lines = []
    for name in sorted(tensors):
        t = tensors[name]
        try:
            shape = shapes.get(t.shape)
        except TypeError:  # a shape that is no tuple of ints (a damaged record): spelled as before, not cached
            shape = ",".join(str(s) for s in t.shape)
        if shape is None:
            shape = shapes[t.shape] = ",".join(str(s) for s in t.shape)
        lines.append(f"{name}\t{t.dtype}\t{shape}\t{t.digest}\n")
    return digest_bytes("".join(lines).encode("utf-8"))


def manifest_json(raw: bytes) -> bytes:
    """The JSON document of ``manifest.json`` bytes: 2.x unwrapped from its zstd frame (checked), 1.x as is."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
    return _unwrap(raw) if raw[:4] == ZSTD_MAGIC else bytes(raw)


def _unwrap(raw: bytes) -> bytes:
    """The content of the one zstd frame that a 2.x manifest.json is (delta-v2 §3: the §5.2 frame rules).

    The declared size is checked against the manifest limit before anything is decompressed.
    """
    what = MANIFEST_NAME
    try:
        params = zstandard.get_frame_parameters(raw)
        pos = zstandard.frame_header_size(raw)
    except zstandard.ZstdError:
        raise FormatError(f"{what}: starts with the zstd magic but holds no valid zstd frame header") from None
    declared = params.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        raise FormatError(f"{what}: the zstd frame does not declare its content size")
    if declared > MAX_MANIFEST_BYTES:
        raise FormatError(f"{what}: the zstd frame declares {declared} bytes, over the {MAX_MANIFEST_BYTES} byte limit")
    if not params.has_checksum:
        raise FormatError(f"{what}: the zstd frame carries no content checksum")
    if params.dict_id:
        raise FormatError(f"{what}: the zstd frame needs a dictionary; a manifest frame uses none")
    while True:  # the frame's end, from its block headers (RFC 8878 §3.1.1.2)
        if pos + 3 > len(raw):
            raise FormatError(f"{what}: the zstd frame is truncated")
        header = int.from_bytes(raw[pos : pos + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:
            raise FormatError(f"{what}: corrupt zstd frame (reserved block type)")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores its one byte
        if header & 1:  # last block
            break
    pos += 4  # content checksum
    if pos > len(raw):
        raise FormatError(f"{what}: the zstd frame is truncated")
    if pos < len(raw):
        raise FormatError(f"{what}: {len(raw) - pos} bytes follow the zstd frame; manifest.json is exactly one")
    try:
        out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=max(declared, 1))
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd frame ({exc})") from None
    if len(out) != declared:
        raise FormatError(f"{what}: the zstd frame decoded to {len(out)} bytes, it declares {declared}")
    return out


def parse_manifest(raw: bytes) -> Manifest:
    """Parse and validate manifest bytes (1.x or 2.x). Raises FormatError with a one-line reason.

    Every field a reader uses is type-checked here (delta-v1/v2 §7.2 step 1), so that nothing
    downstream meets a value of the wrong type; the JSON itself is read strictly (§8, "JSON").
    Callers that parse large manifests pause the cyclic collector around it (``io.gc_pause.no_collections``):
    the parse builds millions of objects and no cycles.
    """
    return _parse_manifest(raw)


def _parse_manifest(raw: bytes) -> Manifest:
    wrapped = raw[:4] == ZSTD_MAGIC
    obj = load_json(manifest_json(raw), MANIFEST_NAME)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError('not a dcr delta manifest (missing "format": "dcr.delta")')
    version = obj.get("format_version")
    if not (isinstance(version, list) and len(version) == 2 and all(_is_int(v) for v in version)):
        raise FormatError("manifest format_version must be [major, minor]")
    major, minor = version
    if major not in READ_MAJORS:
        raise FormatError(
            f"delta format major version {major} is not supported by this dcr (reads "
            f"{' and '.join(f'{m}.x' for m in READ_MAJORS)}); upgrade dcr"
        )
    if major == 1 and wrapped:
        raise FormatError(
            "manifest.json is a zstd frame holding a format 1.x manifest; a 1.x manifest is plain JSON (delta-v2 §3)"
        )
    if major >= 2 and not wrapped:
        raise FormatError(
            f"manifest.json is plain JSON declaring format major version {major}; "
            "a 2.x manifest is one zstd frame (delta-v2 §3)"
        )
    if minor < 0:
        raise FormatError(f"manifest format_version minor {minor} is negative")
    for key in ("producer", "created"):
        if key in obj and not isinstance(obj[key], str):
            raise FormatError(f"manifest {key} must be a string")

    base = _version_ref(obj.get("base"), "base")
    target = _version_ref(obj.get("target"), "target")
    blocks_raw, tensors_raw, items_raw = obj.get("blocks"), obj.get("tensors"), obj.get("items")
    if not isinstance(blocks_raw, list):
        raise FormatError("manifest blocks must be a list")
    if major == 1:
        if not isinstance(tensors_raw, dict):
            raise FormatError("manifest tensors must be an object")
        if not isinstance(items_raw, list):
            raise FormatError("manifest items must be a list")
        blocks = [_block_v1(b, i) for i, b in enumerate(blocks_raw)]
        tensors = {name: _tensor_v1(name, t) for name, t in tensors_raw.items()}
        items = [_item_v1(it, i, tensors, blocks) for i, it in enumerate(items_raw)]
    else:
        if not isinstance(tensors_raw, list):
            raise FormatError("manifest tensors must be a list of [name, dtype, shape, digest] rows")
        if not isinstance(items_raw, list):
            raise FormatError("manifest items must be a list")
        blocks = [_block_v2(b, i) for i, b in enumerate(blocks_raw)]
        tensors, names = _tensors_v2(tensors_raw)
        items = _items_v2(items_raw, names, tensors, blocks)
    _check_disjoint(items)

    known = {"format", "format_version", "producer", "created", "base", "target", "blocks", "tensors", "items"}
    return Manifest(
        base=base,
        target=target,
        tensors=tensors,
        items=items,
        blocks=blocks,
        created=obj.get("created", ""),
        producer=obj.get("producer", ""),
        minor=minor,
        extra={k: v for k, v in obj.items() if k not in known},
        major=major,
        raw=bytes(raw),
    )


def _block(block_id: Any, size: Any, role: Any, where: str) -> BlockEntry:
    if not is_digest(block_id) or not _is_int(size):
        raise FormatError(f"{where}: needs a 64-hex id and an integer size")
    if not 0 <= size <= MAX_BLOCK_BYTES:
        raise FormatError(f"{where}: size {size} outside 0..{MAX_BLOCK_BYTES}")
    if role not in ("data", "repair"):
        raise FormatError(f"{where}: unknown role {_show(role)}")
    return BlockEntry(block_id, size, role)


def _block_v1(b: Any, i: int) -> BlockEntry:
    if not isinstance(b, dict):
        raise FormatError(f"blocks[{i}]: needs a 64-hex id and an integer size")
    return _block(b.get("id"), b.get("size"), b.get("role", "data"), f"blocks[{i}]")


def _block_v2(b: Any, i: int) -> BlockEntry:
    if not (isinstance(b, list) and len(b) >= 3):
        raise FormatError(f"blocks[{i}]: must be a row [id, size, role]")
    return _block(b[0], b[1], b[2], f"blocks[{i}]")


def _tensor(name: str, dt: Any, shape: Any, digest: Any) -> TensorEntry:
    where = f"tensor {_show(name)}"
    if not _int_list(shape) or any(s < 0 for s in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative integers")
    if not isinstance(dt, str):
        raise FormatError(f"{where}: dtype must be a string")
    if numel(shape) * lookup_dtype(dt).itemsize > MAX_TENSOR_BYTES:
        raise FormatError(f"{where}: shape {shape} is over the 2^63 byte limit")
    if not is_digest(digest):
        raise FormatError(f"{where}: digest must be 64 lowercase hex characters")
    return TensorEntry(dt, tuple(shape), digest)


def _tensor_v1(name: str, t: Any) -> TensorEntry:
    if not isinstance(t, dict):
        raise FormatError(f"tensor {_show(name)}: must be an object")
    return _tensor(name, t.get("dtype"), t.get("shape"), t.get("digest"))


def _tensors_v2(rows: list[Any]) -> tuple[dict[str, TensorEntry], list[str]]:
    """The 2.x table: rows [name, dtype, shape, digest]; a (dtype, shape) seen before is not checked again."""
    tensors: dict[str, TensorEntry] = {}
    names: list[str] = []
    layouts: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for i, row in enumerate(rows):
        if type(row) is not list or len(row) < 4:
            raise FormatError(f"tensors[{i}]: must be a row [name, dtype, shape, digest]")
        name, dt, shape, digest = row[0], row[1], row[2], row[3]
        if type(name) is not str:
            raise FormatError(f"tensors[{i}]: name must be a string")
        if name in tensors:
            raise FormatError(f"tensors[{i}]: tensor {_show(name)} is in the table twice")
        key = None
        if type(dt) is str and type(shape) is list and all(type(s) is int for s in shape):
            key = (dt, tuple(shape))
            checked = layouts.get(key)
            if checked is not None:
                tensors[name] = make_entry(dt, checked, digest)  # its digest is checked below, with all
                names.append(name)
                continue
        entry = _tensor(name, dt, shape, digest)
        if key is not None:
            layouts[key] = entry.shape
        tensors[name] = entry
        names.append(name)
    if not _all_hex([t.digest for t in tensors.values()], 64):
        for name, t in tensors.items():
            _tensor(name, t.dtype, list(t.shape), t.digest)  # raises for the first bad digest
    return tensors, names


def _item_v1(obj: Any, index: int, tensors: dict[str, TensorEntry], blocks: list[BlockEntry]) -> Item:
    where = f"items[{index}]"
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: must be an object")
    name = obj.get("tensor")
    if not isinstance(name, str):
        raise FormatError(f"{where}: tensor must be a string (a name in the tensor table)")
    if name not in tensors:
        raise FormatError(f"{where}: tensor {_show(name)} is not in the tensor table")
    region = Region.from_json(obj.get("region"), where)
    data_raw = obj.get("data")
    data = Section.from_json(data_raw, where + ".data")
    assert isinstance(data_raw, dict)  # Section.from_json refuses anything else
    repair = None
    if obj.get("repair") is not None:
        repair = Section.from_json(obj["repair"], where + ".repair")
    return _item(
        index,
        name,
        tensors[name],
        region,
        obj.get("op"),
        obj.get("count"),
        data,
        data_raw.get("positions_length"),
        repair,
        obj.get("pre"),
        obj.get("post"),
        obj.get("residual"),
        obj.get("changed"),
        blocks,
    )


_ITEM_ROW = "[tensor, op, count, region, data, repair, pre, post]"


def _items_v2(
    rows: list[Any], names: list[str], tensors: dict[str, TensorEntry], blocks: list[BlockEntry]
) -> list[Item]:
    """The 2.x items. Digests are checked in bulk after the loop (one regex over all of them), and
    a range met before on a tensor of the same shape is not checked again."""
    items: list[Item] = []
    digests: list[Any] = []  # pre and post of every item, in order
    sections: list[Any] = []  # section digests
    regions: dict[tuple[Any, ...], Region] = {}
    n_names = len(names)
    roles = [b.role for b in blocks]
    sizes = [b.size for b in blocks]
    n_blocks = len(blocks)
    for index, row in enumerate(rows):
        # The common row (a sparse item over a range met before, both sections, no optional members),
        # checked inline by exactly _item_v2's and _item's rules; any other row, or one that breaks a
        # rule, is _item_v2's (which says what is wrong).
        item = None
        if type(row) is list and len(row) == 8:
            t, op, count, region_raw, data_raw, repair_raw, pre, post = row
            if (
                type(t) is int
                and 0 <= t < n_names
                and (op == "xor" or op == "overwrite")
                and type(region_raw) is list
                and len(region_raw) == 2
                and type(data_raw) is list
                and len(data_raw) == 5
                and type(repair_raw) is list
                and len(repair_raw) == 4
            ):
                name = names[t]
                a, b = region_raw
                region = regions.get((a, b, tensors[name].shape)) if type(a) is int and type(b) is int else None
                db, do, dl, pl, dd = data_raw
                rb, ro, rl, rd = repair_raw
                if (
                    region is not None
                    and type(count) is int
                    and 0 <= count <= b - a
                    and type(db) is int
                    and type(do) is int
                    and type(dl) is int
                    and type(pl) is int
                    and do >= 0
                    and 0 <= pl <= dl
                    and type(rb) is int
                    and type(ro) is int
                    and type(rl) is int
                    and ro >= 0
                    and rl >= 0
                    and 0 <= db < n_blocks
                    and 0 <= rb < n_blocks
                    and roles[db] == "data"
                    and roles[rb] == "repair"
                    and do + dl <= sizes[db]
                    and ro + rl <= sizes[rb]
                ):
                    data = _new_object(Section)
                    data.__dict__.update(block=db, offset=do, length=dl, digest=dd)
                    repair = _new_object(Section)
                    repair.__dict__.update(block=rb, offset=ro, length=rl, digest=rd)
                    item = make_item(name, region, op, count, data, pl, pre, post, repair, None, None)
        if item is None:
            item = _item_v2(row, index, names, tensors, blocks, regions)
        items.append(item)
        digests.append(item.pre)
        digests.append(item.post)
        sections.append(item.data.digest)
        if item.repair is not None:
            sections.append(item.repair.digest)
    if not _all_hex(digests, 64):
        bad = next(i for i, d in enumerate(digests) if not is_digest(d))
        raise FormatError(f"items[{bad // 2}]: pre and post must be 64 lowercase hex digests")
    hex_len = 2 * SECTION_DIGEST_BYTES[2]
    if not _all_hex(sections, hex_len):
        for i, it in enumerate(items):
            for role, section in (("data", it.data), ("repair", it.repair)):
                if section is not None and not is_digest(section.digest, hex_len):
                    raise FormatError(f"items[{i}].{role}: section digest must be {hex_len} lowercase hex characters")
    return items


_LOWER_HEX = re.compile("[0-9a-f]*")


def _all_hex(values: list[Any], hex_len: int) -> bool:
    """Whether every value is a string of ``hex_len`` lowercase hex characters (one regex for all)."""
    if not all(type(v) is str and len(v) == hex_len for v in values):
        return False
    return _LOWER_HEX.fullmatch("".join(values)) is not None


def _item_v2(
    row: Any,
    index: int,
    names: list[str],
    tensors: dict[str, TensorEntry],
    blocks: list[BlockEntry],
    regions: dict[tuple[Any, ...], Region],
) -> Item:
    """A 2.x item row (delta-v2 §4.4): the structure here, every rule shared with 1.x in ``_item``
    (pre, post and section digests are checked by the caller, for all items at once)."""
    where = f"items[{index}]" if type(row) is not list or len(row) < 8 else _Where(index)
    if type(row) is not list or len(row) < 8:
        raise FormatError(f"{where}: must be a row {_ITEM_ROW}")
    t, op, count, region_raw, data_raw, repair_raw, pre, post = row[:8]
    optional = row[8] if len(row) > 8 else _NO_MEMBERS
    if not isinstance(optional, dict):
        raise FormatError(f"{where}: the 9th element (optional members) must be an object")
    if type(t) is not int:
        raise FormatError(f"{where}: tensor must be an integer (an index into the tensor table)")
    if not 0 <= t < len(names):
        raise FormatError(f"{where}: tensor index {t} is out of range (the table has {len(names)} tensors)")
    name = names[t]
    entry = tensors[name]
    if type(region_raw) is not list or len(region_raw) != 2:
        raise FormatError(f"{where}: region must be [start, stop] or [offsets, sizes]")
    a, b = region_raw
    if type(a) is int and type(b) is int:
        key: tuple[Any, ...] = (a, b, entry.shape)
        known = regions.get(key)
        if known is None:
            known = regions[key] = Region.range(a, b)
            known.check_within(entry.shape, str(where))
        region = known
    elif _int_list(a) and _int_list(b) and len(a) == len(b):
        region = Region.box(a, b)
        region.check_within(entry.shape, str(where))
    else:
        raise FormatError(f"{where}: region must be two integers [start, stop] or two integer lists of one length")
    if type(data_raw) is not list or len(data_raw) != 5:
        raise FormatError(f"{where}.data: section must be [block, offset, length, positions_length, digest]")
    data = _section_v2(data_raw[0], data_raw[1], data_raw[2], data_raw[4], where, ".data")
    repair = None
    if repair_raw is not None:
        if type(repair_raw) is not list or len(repair_raw) != 4:
            raise FormatError(f"{where}.repair: section must be [block, offset, length, digest] or null")
        rb, ro, rl, rd = repair_raw
        repair = _section_v2(rb, ro, rl, rd, where, ".repair")
    return _item(
        index,
        name,
        entry,
        region,
        op,
        count,
        data,
        data_raw[3],
        repair,
        pre,
        post,
        optional.get("residual"),
        optional.get("changed"),
        blocks,
        checked=True,
    )


def _section_v2(block: Any, offset: Any, length: Any, digest: Any, where: object, field: str) -> Section:
    """A 2.x section; its digest is checked with all the others (``_items_v2``)."""
    if type(block) is int and type(offset) is int and type(length) is int and min(block, offset, length) >= 0:
        return Section(block, offset, length, digest)
    return Section.checked(block, offset, length, digest, 2, f"{where}{field}")  # raises with the reason


class _Where:
    """``items[i]`` for an error message, formatted only if one is raised (100k f-strings cost ~0.1 s)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __str__(self) -> str:
        return f"items[{self.index}]"

    def __format__(self, spec: str) -> str:
        return str(self)


_NO_MEMBERS: dict[str, Any] = {}  # an item row without its optional-members object (read only)


def _item(
    index: int,
    name: str,
    entry: TensorEntry,
    region: Region,
    op: Any,
    count: Any,
    data: Section,
    positions_length: Any,
    repair: Section | None,
    pre: Any,
    post: Any,
    residual: Any,
    changed: Any,
    blocks: list[BlockEntry],
    checked: bool = False,
) -> Item:
    """The rules of an item, the same in every major (delta-v1/v2 §4.4, §5.1).

    ``checked``: the caller has checked the region against the tensor, and checks pre, post and
    the section digests itself (2.x: in bulk).
    """
    if not checked:
        region.check_within(entry.shape, f"items[{index}]")
    if not isinstance(op, str) or op not in OPS:
        raise FormatError(f"items[{index}]: unknown op {_show(op)} (this dcr knows {', '.join(OPS)}); upgrade dcr")
    if type(count) is not int or not 0 <= count <= region.size:
        raise FormatError(f"items[{index}]: count must be an integer within the region size {region.size}")
    if op == "replace" and count != region.size:
        raise FormatError(f"items[{index}]: a replace item must cover its whole region")
    if type(positions_length) is not int or not 0 <= positions_length <= data.length:
        raise FormatError(f"items[{index}]: data.positions_length must be an integer within data.length")
    if op == "replace" and positions_length != 0:
        raise FormatError(f"items[{index}]: a replace item carries no positions")
    if op == "xor" and repair is None:
        raise FormatError(f"items[{index}]: an xor item must carry a repair section")
    for section, role in ((data, "data"), (repair, "repair")):
        if section is None:
            continue
        if section.block >= len(blocks):
            raise FormatError(f"items[{index}]: {role} section names block {section.block}, which does not exist")
        block = blocks[section.block]
        if block.role != role:
            raise FormatError(f"items[{index}]: {role} section points into a {block.role} block")
        if section.offset + section.length > block.size:
            raise FormatError(f"items[{index}]: {role} section runs past the end of its block")
    if not checked and not (is_digest(pre) and is_digest(post)):
        raise FormatError(f"items[{index}]: pre and post must be 64 lowercase hex digests")
    if residual is not None and not isinstance(residual, str):
        raise FormatError(f"items[{index}]: residual must be a string")
    if changed is not None and not (_is_int(changed) and 0 <= changed <= count):
        raise FormatError(f"items[{index}]: changed must be an integer within count {count}")
    changed = changed if op == "replace" else None  # spec §4.4: informative, replace only
    return make_item(name, region, op, count, data, positions_length, pre, post, repair, residual, changed)


_new_object = object.__new__


def make_item(
    tensor: str,
    region: Region,
    op: Any,
    count: int,
    data: Section,
    positions_length: int,
    pre: str,
    post: str,
    repair: Section | None,
    residual: str | None,
    changed: int | None,
) -> Item:
    """``Item(...)`` of fields already checked, without the frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field: 1.4 us of an item's ~9 us parse at 100k items). The instance is
    the same: equal, hashed and printed as ``Item(...)``'s, and as frozen."""
    item = _new_object(Item)
    item.__dict__.update(
        tensor=tensor, region=region, op=op, count=count, data=data, positions_length=positions_length,
        pre=pre, post=post, repair=repair, residual=residual, changed=changed,
    )  # fmt: skip
    return item


def make_entry(dtype: str, shape: tuple[int, ...], digest: str) -> TensorEntry:
    """``TensorEntry(dtype, shape, digest)`` of fields already checked, without the frozen dataclass's
    ``__init__`` (as ``make_item``): the same instance, for tables of 100k tensors."""
    entry = _new_object(TensorEntry)
    entry.__dict__.update(dtype=dtype, shape=shape, digest=digest)
    return entry


def _check_disjoint(items: list[Item]) -> None:
    """No canonical element may be touched by two items (so no element is XORed twice)."""
    first: dict[str, Region] = {}
    by_tensor: dict[str, list[Region]] = {}  # tensors with two items or more: the only ones to check
    for it in items:
        seen = first.get(it.tensor)
        if seen is None:
            first[it.tensor] = it.region
        elif it.tensor in by_tensor:
            by_tensor[it.tensor].append(it.region)
        else:
            by_tensor[it.tensor] = [seen, it.region]
    for name, regions in by_tensor.items():
        if len({r.is_box for r in regions}) > 1:
            raise FormatError(f"tensor {_show(name)}: items mix flat ranges and boxes")
        # Overlap means an element in two items: empty regions hold none.
        ranges = sorted((r.start or 0, r.stop or 0) for r in regions if not r.is_box and r.size > 0)
        for (_, stop_a), (start_b, _) in itertools.pairwise(ranges):
            if start_b < stop_a:
                raise FormatError(f"tensor {_show(name)}: two items overlap")
        if _any_boxes_overlap([r for r in regions if r.is_box and r.size > 0]):
            raise FormatError(f"tensor {_show(name)}: two items overlap")


def _any_boxes_overlap(regions: list[Region]) -> bool:
    """A sweep along the axis the boxes are split on most, so that a box meets only its neighbours there.

    Tensor-parallel and per-layer boxes tile a tensor along one or two axes:
    on the most-split axis a box meets only the few boxes that share its span
    there, where comparing all pairs would take ~n^2 for ~100k boxes.
    """
    boxes = [(r.offsets or (), r.sizes or ()) for r in regions]
    if len(boxes) < 2:
        return False
    ndim = len(boxes[0][0])
    if ndim == 0:
        return True  # two scalar boxes hold the same element
    axis = max(range(ndim), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    open_boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        open_boxes = [o for o in open_boxes if o[0][axis] + o[1][axis] > start]
        if any(_boxes_overlap(o, box) for o in open_boxes):
            return True
        open_boxes.append(box)
    return False


def _boxes_overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(*a, *b, strict=True))


def _version_ref(obj: Any, where: str) -> VersionRef:
    if not isinstance(obj, dict) or not isinstance(obj.get("version"), str) or not is_digest(obj.get("fingerprint")):
        raise FormatError(f"manifest {where} needs a string version and a 64-hex fingerprint")
    return VersionRef(obj["version"], obj["fingerprint"])


def _show(value: Any) -> str:
    """A short, printable rendering of a manifest value for an error message (names may be hostile)."""
    text = repr(value)
    text = text[:60] + "…" if len(text) > 60 else text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(v: Any) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def make_section(block: int, offset: int, length: int, digest: str) -> Section:
    """``Section(...)`` of fields already known good (a writer's), without the frozen dataclass's
    ``__init__``: the same instance, as ``make_item`` makes items (a writer places 100k sections)."""
    section = _new_object(Section)
    object.__setattr__(section, "__dict__", {"block": block, "offset": offset, "length": length, "digest": digest})
    return section
