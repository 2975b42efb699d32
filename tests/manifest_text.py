"""Tests that edit a delta's manifest by hand work on its 1.0 JSON form (delta-v1.md).

dcr writes 2.0 manifests (one zstd frame around compact rows, delta-v2.md). A test that damages a
manifest field by field takes the same manifest at 1.0: ``manifest_v1(delta)`` rewrites the delta's
manifest as 1.0 (section digests recomputed at full length from the blocks) and returns its JSON
object, which the test edits and writes back as plain JSON. Every rule such a test probes is the
same in both majors (format/manifest.py ``_item`` holds them once); the 2.0 structure has its own
vectors (format_spec/vectors/bad/v2-*) and tests (tests/test_manifest_v2.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from dcr_cli.format.manifest import MANIFEST_NAME, Manifest, Section, manifest_json, parse_manifest, section_digest


def as_major(manifest: Manifest, root: Path, major: int) -> Manifest:
    """The same manifest at another major: section digests recomputed from the blocks under ``root``."""

    def resign(s: Section) -> Section:
        block = manifest.blocks[s.block]
        data = (root / block.path).read_bytes()[s.offset : s.offset + s.length]
        return dataclasses.replace(s, digest=section_digest(data, major))

    items = [
        dataclasses.replace(it, data=resign(it.data), repair=None if it.repair is None else resign(it.repair))
        for it in manifest.items
    ]
    return dataclasses.replace(manifest, items=items, major=major, raw=None)


def manifest_v1(delta: Path, rewrite: bool = True) -> dict[str, Any]:
    """The delta's manifest as a 1.0 JSON object; with ``rewrite``, the delta's manifest.json becomes that 1.0."""
    m = as_major(parse_manifest((delta / MANIFEST_NAME).read_bytes()), delta, 1)
    raw = m.to_json_bytes()
    if rewrite:
        (delta / MANIFEST_NAME).write_bytes(raw)
    obj: dict[str, Any] = json.loads(raw)
    return obj


def manifest_text(delta: Path) -> str:
    """The JSON text of the delta's manifest, whatever its major (2.x: the frame's content)."""
    return manifest_json((delta / MANIFEST_NAME).read_bytes()).decode("utf-8")
