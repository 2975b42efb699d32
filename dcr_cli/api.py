"""The Python API's wiring of layers that do not know each other (produce and store)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .delta.summary import DiffSummary
from .produce.live import Producer as LiveProducer


class _StoreProducer(LiveProducer):
    """A live producer that uploads each block as it is written and publishes each delta on a store."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, root: Path, *args: Any, **kw: Any) -> None:
        super().__init__(root, *args, **kw)
        self.url, self.storage_options = url, storage_options or {}

    def diff(self, state: Mapping[str, Any], version: str) -> DiffSummary | None:
        from .store import BlockUploader, push

        uploader = BlockUploader(self.url, self.storage_options)
        self.on_block = uploader
        try:
            summary = super().diff(state, version)
        finally:
            self.on_block = None
            uploader.wait()
        self.group.barrier()
        if self.group.rank == 0:
            push(self.out / version, self.url, storage_options=self.storage_options)
        self.group.barrier()
        return summary


def Producer(
    out_or_store_url: str | os.PathLike[str],
    baseline: Mapping[str, Any] | str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    staging: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> LiveProducer:
    """A live-tensor producer (``dcr_cli.produce.live.Producer``) writing to a delta directory or a store.

    With a store URL (``s3://…``, ``file://…``) each block is uploaded as soon as it is written and
    the delta is published when complete (as ``dcr diff --push``); deltas are staged in ``staging``
    (a directory every rank can reach; default: a temporary directory).
    """
    if "://" not in str(out_or_store_url):
        return LiveProducer(out_or_store_url, baseline, **kwargs)
    root = Path(staging) if staging is not None else Path(tempfile.mkdtemp(prefix="dcr-live-"))
    return _StoreProducer(str(out_or_store_url), storage_options, root, baseline, **kwargs)
