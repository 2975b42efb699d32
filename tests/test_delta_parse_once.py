"""A process parses a manifest's bytes once while a parse of them is alive (``delta.reader._parse_once``).

An engine in the caller's process (vLLM's ``LLM``) has the client and the worker open every delta; the
second parse of an MoE manifest cost 160-180 ms. The cache is keyed by the BLAKE3 of the bytes, so bytes
that differ in any way are parsed anew, and it is weak: it never keeps a manifest alive by itself.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
from store_fixtures import make_deltas

from dcr_cli.delta import reader
from dcr_cli.delta.reader import Delta
from dcr_cli.errors import FormatError
from dcr_cli.format.manifest import MANIFEST_NAME, parse_manifest


@pytest.fixture
def deltas(tmp_path: Path) -> list[Path]:
    """Two deltas of this test's own (no other test holds a parse of their bytes)."""
    return make_deltas(tmp_path, 2, size=256)[1]


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The bytes of every manifest parse from here on."""
    seen: list[bytes] = []

    def counting(raw: bytes):  # type: ignore[no-untyped-def]
        seen.append(raw)
        return parse_manifest(raw)

    monkeypatch.setattr(reader, "parse_manifest", counting)  # (the store opens through the reader)
    return seen


def test_two_opens_of_the_same_bytes_share_one_parse(tmp_path: Path, deltas: list[Path], parses: list[bytes]) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(deltas[0], copy)
    first = Delta.open(deltas[0])
    second = Delta.open(copy)  # another location, the same bytes
    assert second.manifest is first.manifest
    assert len(parses) == 1
    assert second is not first and second.url != first.url  # each open is its own delta (source, label)
    assert Delta.open(deltas[1]).manifest is not first.manifest  # other bytes: parsed
    assert len(parses) == 2


def test_changed_bytes_are_parsed_again_and_checked(deltas: list[Path], parses: list[bytes]) -> None:
    delta = deltas[0]
    held = Delta.open(delta)
    raw = (delta / MANIFEST_NAME).read_bytes()
    (delta / MANIFEST_NAME).write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))  # the frame's checksum no longer holds
    with pytest.raises(FormatError):
        Delta.open(delta)
    assert len(parses) == 2 and parses[1] != parses[0]
    assert held.manifest.items  # the first parse is untouched


def test_the_cache_keeps_no_manifest_alive(deltas: list[Path], parses: list[bytes]) -> None:
    opened = Delta.open(deltas[0])
    digest = opened.id
    assert reader._parsed.get(digest) is opened.manifest
    del opened
    gc.collect()
    assert reader._parsed.get(digest) is None
    Delta.open(deltas[0])
    assert len(parses) == 2


def test_a_stored_version_and_its_manifest_location_share_one_parse(
    tmp_path: Path, deltas: list[Path], parses: list[bytes]
) -> None:
    """What a client opens from a store and what an engine worker in its process opens by the manifest's
    location (``STORE/manifests/<digest>.json``): one parse."""
    from dcr_cli.store import push
    from dcr_cli.store.transfer import open_version

    store = str(tmp_path / "store")
    push(deltas[0], store)
    parses.clear()  # (the push reads the delta)
    opened = open_version(store, "v1")
    again = Delta.open(opened.url)
    assert again.manifest is opened.manifest and again.id == opened.id
    assert len(parses) == 1
