"""An independent reader of dcr deltas, written from format_spec/delta-v1.md alone.

It imports nothing of dcr_cli (only json, zstandard, blake3 and numpy), so the test vectors and the
fuzz suite can hold dcr's reader against a second reading of the spec. Every refusal is a
:class:`Refused` carrying the rule it enforces (the ``RULES`` below, each with its section), so a test
can check that a bad vector is refused for the reason its ``reason.txt`` gives and not another.

Entry points:
  ``read_manifest(raw)``          strict JSON (§8) and manifest validation (§4, §5.1, §7.2 step 1)
  ``check_blocks(delta)``         every block present, of its declared size and digest (§3, §5.1)
  ``decode(delta)``               each item's op, canonical flat indices and values (§6; expected.json)
  ``apply(delta, base)``          §7: pre-image check, apply, post-image check, fingerprint of the result
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import zstandard

RULES = {
    "json-syntax": "§3: the manifest is UTF-8 JSON",
    "json-utf8": "§8 JSON: strings are valid UTF-8",
    "json-duplicate": "§8 JSON: no object repeats a member name",
    "json-depth": "§8 JSON: at most 64 levels of nesting",
    "json-integer": "§8 JSON: integers have at most 20 digits",
    "json-number": "§8 JSON: numbers are finite (no NaN, Infinity, overflow)",
    "json-string": "§8 JSON: no NUL, no unpaired surrogate",
    "format": "§4.1: format is dcr.delta",
    "major": "§9: unknown major version",
    "type": "§4, §7.2: a missing or ill-typed field",
    "dtype": "§2: an unknown dtype",
    "op": "§4.4: an unknown op",
    "tensor": "§4.4: an item names a tensor not in the table",
    "region": "§4.5: a region outside its tensor, of both kinds, or over 2^31 elements",
    "count": "§4.4: count outside the region, or replace not covering it",
    "overlap": "§4.4: items of one tensor overlap or mix ranges and boxes",
    "section": "§5.1: a section outside its block, or in a block of the wrong role",
    "repair": "§4.4: an xor item lacks its repair section",
    "limit": "§8: a limit is exceeded",
    "block": "§3, §5.1: a block file is missing, of the wrong size or digest",
    "section-digest": "§5.1: a section's bytes do not match its digest",
    "frame": "§5.2: a section is not exactly one checksummed zstd frame with its content size",
    "frame-size": "§5.2, §6: a frame's declared or decoded size is not what the manifest implies",
    "positions": "§6.1: positions outside the region",
    "pre": "§7.2: the affected elements do not match pre",
    "post": "§7.2: the new values do not match post",
    "fingerprint": "§4.3: the tensor table does not match the fingerprint",
    "wrapping": "v2 §3: a 1.x manifest in a zstd frame, or a 2.x manifest as plain JSON",
    "manifest-frame": "v2 §3: manifest.json (2.x) is not exactly one checksummed zstd frame of its declared size",
    "rows": "v2 §4: a row of the 2.x table or items is malformed (tensor index, section digest length, names)",
}


class Refused(Exception):
    def __init__(self, rule: str, detail: str) -> None:
        assert rule in RULES, rule
        super().__init__(f"{rule}: {detail}")
        self.rule = rule


WIDTH = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "F64"), 8),
}
OPS = ("xor", "overwrite", "replace")
MAX_MANIFEST = 256 << 20
MAX_BLOCK = 1 << 30
MAX_REGION = 1 << 31
HEX = set("0123456789abcdef")


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


# --------------------------------------------------------------------------- §8 JSON


def _depth(text: str) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        raise Refused("json-duplicate", "an object repeats a member name")
    return dict(pairs)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 20:
        raise Refused("json-integer", f"an integer of {len(text)} characters")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Refused("json-number", f"{text} overflows")
    return value


def _constant(name: str) -> Any:
    raise Refused("json-number", f"{name}")


def _strings(value: Any) -> None:
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.values())
            todo.extend(v.keys())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str):
            if "\x00" in v:
                raise Refused("json-string", "a NUL character")
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise Refused("json-string", "an unpaired surrogate") from None


def strict_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("json-utf8", "not UTF-8") from None
    if _depth(text) > 64:
        raise Refused("json-depth", f"{_depth(text)} levels")
    try:
        obj = json.loads(
            text, object_pairs_hook=_no_dupes, parse_int=_int, parse_float=_float, parse_constant=_constant
        )
    except json.JSONDecodeError as exc:
        raise Refused("json-syntax", str(exc)) from None
    _strings(obj)
    return obj


# --------------------------------------------------------------------------- §4 manifest


def _is_int(v: Any) -> bool:
    return type(v) is int  # bool is not an integer (§8)


def _is_uint(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_hex(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and set(v) <= HEX


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise Refused("type", what)


@dataclass
class Region:
    start: int | None
    stop: int | None
    offsets: list[int] | None
    sizes: list[int] | None

    @property
    def size(self) -> int:
        if self.offsets is not None:
            return math.prod(self.sizes or [])
        return (self.stop or 0) - (self.start or 0)

    def flat(self, local: np.ndarray, shape: list[int]) -> np.ndarray:
        """Canonical flat indices of region positions (§4.5), computed with Python integers."""
        if self.offsets is None:
            return local.astype(np.int64) + int(self.start or 0)
        assert self.sizes is not None
        out = np.empty(len(local), dtype=np.int64)
        for k, p in enumerate(local.tolist()):
            coords = []
            for size in reversed(self.sizes):
                coords.append(p % size if size else 0)
                p = p // size if size else 0
            coords.reverse()
            index = 0
            for c, o, dim in zip(coords, self.offsets, shape, strict=True):
                index = index * dim + c + o
            out[k] = index
        return out

    def elements(self, shape: list[int]) -> set[int]:
        return set(self.flat(np.arange(self.size), shape).tolist())


def _region(obj: Any, shape: list[int], where: str) -> Region:
    _need(isinstance(obj, dict), f"{where}.region is not an object")
    kinds = ({"start", "stop"} & obj.keys(), {"offsets", "sizes"} & obj.keys())
    if kinds[0] and kinds[1]:
        raise Refused("region", f"{where}: a region of both kinds")
    if kinds[1]:
        off, siz = obj.get("offsets"), obj.get("sizes")
        _need(isinstance(off, list) and isinstance(siz, list), f"{where}: box needs offsets and sizes lists")
        _need(all(_is_int(x) for x in off + siz), f"{where}: box entries must be integers")
        if not (len(off) == len(siz) == len(shape)):
            raise Refused("region", f"{where}: box rank differs from the tensor's")
        for o, s, d in zip(off, siz, shape, strict=True):
            if o < 0 or s < 0 or o + s > d:
                raise Refused("region", f"{where}: box outside the tensor")
        r = Region(None, None, off, siz)
    else:
        start, stop = obj.get("start"), obj.get("stop")
        _need(_is_int(start) and _is_int(stop), f"{where}: range needs integer start and stop")
        if not 0 <= start <= stop <= math.prod(shape):
            raise Refused("region", f"{where}: range outside the tensor")
        r = Region(start, stop, None, None)
    if r.size > MAX_REGION:
        raise Refused("region", f"{where}: over 2^31 elements")
    return r


def _section(obj: Any, where: str) -> dict[str, Any]:
    _need(isinstance(obj, dict), f"{where} is not an object")
    for k in ("block", "offset", "length"):
        _need(_is_uint(obj.get(k)), f"{where}.{k} must be a non-negative integer")
    d = obj.get("digest")
    _need(isinstance(d, str) and len(d) == obj.get("_hex", 64) and set(d) <= HEX, f"{where}.digest length/hex")
    return obj


def _unwrap(raw: bytes) -> bytes:
    """delta-v2 §3: one zstd frame, checksummed, its declared size within 256 MiB (checked first)."""
    try:
        size = check_frame(raw)
    except Refused as exc:
        raise Refused("manifest-frame", str(exc)) from None
    dict_bytes = (0, 1, 2, 4)[raw[4] & 3]
    start = 5 + (0 if raw[4] & 0x20 else 1)
    if dict_bytes and int.from_bytes(raw[start : start + dict_bytes], "little"):
        raise Refused("manifest-frame", "the frame names a dictionary")
    if size > MAX_MANIFEST:
        raise Refused("limit", f"manifest frame declares {size} bytes")
    try:
        out = zstandard.ZstdDecompressor().decompress(raw, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise Refused("manifest-frame", f"corrupt ({exc})") from None
    if len(out) != size:
        raise Refused("manifest-frame", f"decoded {len(out)} of {size}")
    return out


def _v2_to_v1(m: dict[str, Any]) -> None:
    """Rewrite a 2.x document's rows (delta-v2 §4) as the 1.x objects the checks below read."""
    blocks, tensors, items = m.get("blocks"), m.get("tensors"), m.get("items")
    _need(isinstance(blocks, list) and isinstance(tensors, list) and isinstance(items, list), "2.x lists")
    for i, b in enumerate(blocks):
        _need(isinstance(b, list) and len(b) >= 3, f"blocks[{i}] row")
        blocks[i] = {"id": b[0], "size": b[1], "role": b[2]}
    table: dict[str, Any] = {}
    names = []
    for i, t in enumerate(tensors):
        _need(isinstance(t, list) and len(t) >= 4 and isinstance(t[0], str), f"tensors[{i}] row")
        if t[0] in table:
            raise Refused("rows", f"tensor {t[0]!r} twice")
        table[t[0]] = {"dtype": t[1], "shape": t[2], "digest": t[3]}
        names.append(t[0])
    m["tensors"] = table
    for i, row in enumerate(items):
        _need(isinstance(row, list) and len(row) >= 8, f"items[{i}] row")
        t, op, count, region, data, repair, pre, post = row[:8]
        opt = row[8] if len(row) > 8 else {}
        _need(isinstance(opt, dict), f"items[{i}] optional members")
        if not (_is_int(t) and 0 <= t < len(names)):
            raise Refused("rows", f"items[{i}] tensor index {t!r}")
        _need(isinstance(region, list) and len(region) == 2, f"items[{i}] region")
        if all(_is_int(v) for v in region):
            reg = {"start": region[0], "stop": region[1]}
        else:
            reg = {"offsets": region[0], "sizes": region[1]}
        _need(isinstance(data, list) and len(data) == 5, f"items[{i}] data")
        it = {"tensor": names[t], "region": reg, "op": op, "count": count, "pre": pre, "post": post}
        it.update({k: opt[k] for k in ("residual", "changed") if k in opt})  # others are ignored
        it["data"] = {"block": data[0], "offset": data[1], "length": data[2], "positions_length": data[3]}
        it["data"].update(digest=data[4], _hex=32)
        if repair is not None:
            _need(isinstance(repair, list) and len(repair) == 4, f"items[{i}] repair")
            it["repair"] = {
                "block": repair[0],
                "offset": repair[1],
                "length": repair[2],
                "digest": repair[3],
                "_hex": 32,
            }
        for sec in (it["data"], it.get("repair")):
            if sec is not None and not (isinstance(sec["digest"], str) and len(sec["digest"]) == 32):
                raise Refused("rows", f"items[{i}] section digest of {len(str(sec['digest']))} characters")
        items[i] = it


def read_manifest(raw: bytes) -> dict[str, Any]:
    """The validated manifest object, with each item's region parsed into ``item["_region"]``."""
    if len(raw) > MAX_MANIFEST:
        raise Refused("limit", "manifest over 256 MiB")
    wrapped = raw[:4] == b"\x28\xb5\x2f\xfd"
    m = strict_json(_unwrap(raw) if wrapped else raw)
    if not isinstance(m, dict) or m.get("format") != "dcr.delta":
        raise Refused("format", "not dcr.delta")
    fv = m.get("format_version")
    _need(isinstance(fv, list) and len(fv) == 2 and all(_is_int(v) for v in fv), "format_version")
    if fv[0] not in (1, 2):
        raise Refused("major", f"major version {fv[0]}")
    if wrapped != (fv[0] == 2):
        raise Refused("wrapping", f"major {fv[0]} {'in a zstd frame' if wrapped else 'as plain JSON'}")
    if fv[0] == 2:
        _v2_to_v1(m)
    for k in ("producer", "created"):
        _need(k not in m or isinstance(m[k], str), f"{k} must be a string")
    for k in ("base", "target"):
        ref = m.get(k)
        _need(isinstance(ref, dict) and isinstance(ref.get("version"), str), f"{k}.version")
        _need(_is_hex(ref.get("fingerprint")), f"{k}.fingerprint")
    blocks = m.get("blocks")
    _need(isinstance(blocks, list), "blocks must be a list")
    for i, b in enumerate(blocks):
        _need(isinstance(b, dict) and _is_hex(b.get("id")) and _is_uint(b.get("size")), f"blocks[{i}]")
        _need(b.get("role", "data") in ("data", "repair"), f"blocks[{i}].role")
        if b["size"] > MAX_BLOCK:
            raise Refused("limit", f"blocks[{i}] over 1 GiB")
    tensors = m.get("tensors")
    _need(isinstance(tensors, dict), "tensors must be an object")
    for name, t in tensors.items():
        _need(isinstance(t, dict), f"tensor {name!r}")
        _need(isinstance(t.get("dtype"), str), f"tensor {name!r} dtype")
        if t["dtype"] not in WIDTH:
            raise Refused("dtype", t["dtype"])
        _need(isinstance(t.get("shape"), list) and all(_is_uint(s) for s in t["shape"]), f"tensor {name!r} shape")
        if math.prod(t["shape"]) * WIDTH[t["dtype"]] >= 1 << 63:
            raise Refused("limit", f"tensor {name!r} over 2^63 bytes")
        _need(_is_hex(t.get("digest")), f"tensor {name!r} digest")
    items = m.get("items")
    _need(isinstance(items, list), "items must be a list")
    for i, it in enumerate(items):
        where = f"items[{i}]"
        _need(isinstance(it, dict), where)
        _need(isinstance(it.get("tensor"), str), f"{where}.tensor must be a string")
        if it["tensor"] not in tensors:
            raise Refused("tensor", f"{where}: {it['tensor']!r}")
        shape = tensors[it["tensor"]]["shape"]
        region = _region(it.get("region"), shape, where)
        it["_region"] = region
        _need(isinstance(it.get("op"), str), f"{where}.op must be a string")
        if it["op"] not in OPS:
            raise Refused("op", it["op"])
        _need(_is_uint(it.get("count")), f"{where}.count must be a non-negative integer")
        if it["count"] > region.size or (it["op"] == "replace" and it["count"] != region.size):
            raise Refused("count", where)
        data = _section(it.get("data"), f"{where}.data")
        _need(_is_uint(data.get("positions_length")), f"{where}.data.positions_length")
        if data["positions_length"] > data["length"] or (it["op"] == "replace" and data["positions_length"]):
            raise Refused("section", f"{where}: positions_length")
        if it.get("repair") is not None:
            _section(it["repair"], f"{where}.repair")
        elif it["op"] == "xor":
            raise Refused("repair", where)
        for key, role in (("data", "data"), ("repair", "repair")):
            sec = it.get(key)
            if sec is None:
                continue
            if sec["block"] >= len(blocks):
                raise Refused("section", f"{where}.{key}: no block {sec['block']}")
            block = blocks[sec["block"]]
            if block.get("role", "data") != role:
                raise Refused("section", f"{where}.{key} in a {block.get('role', 'data')} block")
            if sec["offset"] + sec["length"] > block["size"]:
                raise Refused("section", f"{where}.{key} runs past its block")
        _need(_is_hex(it.get("pre")) and _is_hex(it.get("post")), f"{where}.pre/post")
        _need("residual" not in it or isinstance(it["residual"], str), f"{where}.residual")
        _need("changed" not in it or _is_uint(it["changed"]), f"{where}.changed")
    # Items of one tensor never overlap and never mix ranges with boxes (brute force: vectors are small).
    by_tensor: dict[str, list[Region]] = {}
    for it in items:
        by_tensor.setdefault(it["tensor"], []).append(it["_region"])
    for name, regions in by_tensor.items():
        if len({r.offsets is None for r in regions}) > 1:
            raise Refused("overlap", f"{name!r} mixes ranges and boxes")
        seen: set[int] = set()
        for r in regions:
            elems = r.elements(tensors[name]["shape"])
            if elems & seen:
                raise Refused("overlap", f"{name!r}")
            seen |= elems
    return m


# --------------------------------------------------------------------------- §5 blocks and frames


def check_frame(frame: bytes) -> int:
    """Exactly one zstd frame (RFC 8878 §3.1.1) with Frame_Content_Size and the checksum; returns the size."""
    if len(frame) < 6 or int.from_bytes(frame[:4], "little") != 0xFD2FB528:
        raise Refused("frame", "no zstd frame magic")
    fhd = frame[4]
    fcs_flag, single, reserved, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 3) & 1, (fhd >> 2) & 1, fhd & 3
    if reserved:
        raise Refused("frame", "reserved bit set")
    if not checksum:
        raise Refused("frame", "no content checksum")
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise Refused("frame", "no content size")
    if pos + fcs_size > len(frame):
        raise Refused("frame", "truncated header")
    size = int.from_bytes(frame[pos : pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    pos += fcs_size
    while True:
        if pos + 3 > len(frame):
            raise Refused("frame", "truncated block header")
        header = int.from_bytes(frame[pos : pos + 3], "little")
        last, kind, bsize = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            raise Refused("frame", "reserved block type")
        pos += 3 + (1 if kind == 1 else bsize)
        if last:
            break
    pos += 4
    if pos != len(frame):
        raise Refused("frame", "truncated" if pos > len(frame) else "bytes after the frame")
    return size


def decompress(frame: bytes, least: int, most: int) -> bytes:
    size = check_frame(frame)
    if not least <= size <= most:
        raise Refused("frame-size", f"declares {size}, allowed {least}..{most}")
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise Refused("frame", f"corrupt ({exc})") from None
    if len(out) != size:
        raise Refused("frame-size", f"decoded {len(out)} of {size}")
    return out


def check_blocks(delta: Path, m: dict[str, Any]) -> None:
    for b in m["blocks"]:
        path = delta / "blocks" / b["id"]
        if not path.is_file():
            raise Refused("block", f"{b['id'][:12]} missing")
        if path.stat().st_size != b["size"]:
            raise Refused("block", f"{b['id'][:12]} has {path.stat().st_size} bytes, not {b['size']}")
        if digest(path.read_bytes()) != b["id"]:
            raise Refused("block", f"{b['id'][:12]} digest")


def _read_section(delta: Path, m: dict[str, Any], sec: dict[str, Any]) -> bytes:
    raw = (delta / "blocks" / m["blocks"][sec["block"]]["id"]).read_bytes()[
        sec["offset"] : sec["offset"] + sec["length"]
    ]
    if len(raw) != sec["length"] or digest(raw)[: sec.get("_hex", 64)] != sec["digest"]:
        raise Refused("section-digest", "section bytes do not match")
    return raw


def _unplane(raw: bytes, width: int) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, -1)
    return np.ascontiguousarray(planes.T).reshape(-1).view(f"<u{width}")


def _positions(raw: bytes, count: int, region_size: int) -> np.ndarray:
    out = decompress(raw, count, 5 * count)
    gaps = [int(b) for b in out[:count]]
    escaped = [i for i, g in enumerate(gaps) if g == 255]
    if len(out) != count + 4 * len(escaped):
        raise Refused("frame-size", f"{len(escaped)} escapes need {count + 4 * len(escaped)} bytes")
    rest = _unplane(out[count:], 4) if escaped else np.zeros(0, dtype="<u4")
    for k, i in enumerate(escaped):
        gaps[i] += int(rest[k])
    positions, p = [], -1
    for g in gaps:
        p += g + 1
        positions.append(p)
    if positions and positions[-1] >= region_size:
        raise Refused("positions", f"{positions[-1]} outside a region of {region_size}")
    return np.array(positions, dtype=np.int64)


@dataclass
class Decoded:
    tensor: str
    op: str
    indices: np.ndarray  # canonical flat indices
    values: np.ndarray  # xor masks or target values
    item: dict[str, Any]


def decode(delta: Path) -> tuple[dict[str, Any], list[Decoded]]:
    """Validate the whole delta (manifest, every block) and decode every item."""
    delta = Path(delta)
    m = read_manifest((delta / "manifest.json").read_bytes())
    check_blocks(delta, m)
    out = []
    for it in m["items"]:
        t = m["tensors"][it["tensor"]]
        width, region, count = WIDTH[t["dtype"]], it["_region"], it["count"]
        data = _read_section(delta, m, it["data"])
        pl = it["data"]["positions_length"]
        if it["op"] == "replace":
            local = np.arange(region.size, dtype=np.int64)
            values_frame = data
        else:
            local = _positions(data[:pl], count, region.size)
            values_frame = data[pl:]
        values = _unplane(decompress(values_frame, width * count, width * count), width)
        out.append(Decoded(it["tensor"], it["op"], region.flat(local, t["shape"]), values, it))
        if it.get("repair") is not None:
            repair = _read_section(delta, m, it["repair"])
            it["_repair"] = _unplane(decompress(repair, width * count, width * count), width)
    return m, out


def fingerprint(table: dict[str, dict[str, Any]]) -> str:
    lines = "".join(
        f"{name}\t{t['dtype']}\t{','.join(str(s) for s in t['shape'])}\t{t['digest']}\n"
        for name, t in sorted(table.items(), key=lambda kv: kv[0].encode("utf-8"))
    )
    return digest(lines.encode("utf-8"))


def expected_json(delta: Path) -> list[dict[str, Any]]:
    """What format_spec/vectors/<name>/expected.json holds for ``delta`` (§10)."""
    _, items = decode(delta)
    return [
        {"tensor": d.tensor, "op": d.op, "indices": d.indices.tolist(), "values_hex": d.values.tobytes().hex()}
        for d in items
    ]


def apply(delta: Path, base: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Apply to a model given as base.json/target.json do ({name: {dtype, shape, hex}}); returns the target."""
    m, items = decode(delta)
    table = {
        n: {"dtype": t["dtype"], "shape": t["shape"], "digest": digest(bytes.fromhex(t["hex"]))}
        for n, t in base.items()
    }
    if fingerprint(table) != m["base"]["fingerprint"]:
        raise Refused("fingerprint", "the model is not at the delta's base")
    for name, t in m["tensors"].items():
        if name not in base or (base[name]["dtype"], base[name]["shape"]) != (t["dtype"], t["shape"]):
            raise Refused("fingerprint", f"{name!r} differs in layout from the base")
    state = {n: np.frombuffer(bytes.fromhex(t["hex"]), dtype=f"<u{WIDTH[t['dtype']]}").copy() for n, t in base.items()}
    for d in items:
        arr = state[d.tensor]
        current = arr[d.indices]
        if digest(current.tobytes()) != d.item["pre"]:
            raise Refused("pre", d.tensor)
        new = current ^ d.values if d.op == "xor" else d.values
        if digest(new.tobytes()) != d.item["post"]:
            raise Refused("post", d.tensor)
        if "_repair" in d.item and d.item["_repair"].tobytes() != new.tobytes():
            raise Refused("post", f"{d.tensor}: repair values are not the target values")
        arr[d.indices] = new
    out = {
        n: {"dtype": base[n]["dtype"], "shape": base[n]["shape"], "hex": a.tobytes().hex()} for n, a in state.items()
    }
    result_table = {n: {**table[n], "digest": digest(state[n].tobytes())} for n in state}
    declared = {n: {k: t[k] for k in ("dtype", "shape", "digest")} for n, t in m["tensors"].items()}
    if result_table != declared or fingerprint(result_table) != m["target"]["fingerprint"]:
        raise Refused("fingerprint", "the result does not match the target table")
    return out
