"""A dcr store's record format (format_spec/store-v1.md): names, limits and the strict parse of a record.

Pure (no I/O), so that both the store package, which writes and reads records, and the delta layer,
which reads the few records a delta opened by its store location needs (``delta.source``), parse
them with one mechanism.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import FormatError
from .strict_json import load_json

STORE_FORMAT = "dcr.store"  # the marker's kind
VERSION_KIND = "dcr.store.version"
SHORTCUT_KIND = "dcr.store.shortcut"
STORE_MAJOR = 1
STORE_MINOR = 1
MARKER = "dcr-store.json"
VERSIONS = "versions"
SHORTCUTS = "shortcuts"
COMPLETE = "complete"  # complete/<version>: every block of the version, repair blocks included, is uploaded (1.1)
MAX_RECORD_BYTES = 1 << 20

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # store-v1 §1.1 (and not ending in .json)


def redo_shortcut(url: str, base: str, target: str) -> str:
    """The fix for shortcut ``base..target`` (store-v1 §6.2) whose manifest or blocks are lost or damaged.
    dcr push cannot restore it (dcr compact wrote it), and dcr compact keeps a shortcut whose record is
    there: the record goes first. Here, below the store and the delta layer, so that both say it alike."""
    return f"remove {SHORTCUTS}/{base}/{target}.json from {url} and publish it anew with dcr compact {url} --every K"


def is_label(text: str) -> bool:
    """Whether ``text`` is a valid version or receiver label (store-v1 §1.1)."""
    return bool(LABEL.fullmatch(text)) and not text.endswith(".json")


def parse_record(raw: bytes, kind: str, where: str) -> dict[str, Any]:
    """Parse a store record of the given kind, refusing unknown majors and malformed JSON."""
    if len(raw) > MAX_RECORD_BYTES:
        raise FormatError(f"{where}: record of {len(raw)} bytes is over the {MAX_RECORD_BYTES} byte limit")
    obj = load_json(raw, where)  # duplicate keys, deep nesting, huge integers...: refused
    if not isinstance(obj, dict) or obj.get("format") != kind:
        raise FormatError(f"{where}: not a {kind} record")
    version = obj.get("format_version")
    if not (isinstance(version, list) and len(version) == 2 and all(isinstance(v, int) for v in version)):
        raise FormatError(f"{where}: format_version must be [major, minor]")
    if version[0] != STORE_MAJOR:
        raise FormatError(
            f"{where}: store format major version {version[0]} is not supported by this dcr "
            f"(reads {STORE_MAJOR}.x); upgrade dcr"
        )
    return obj
