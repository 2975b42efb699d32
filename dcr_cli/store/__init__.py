"""dcr stores: publishing, fetching and committing deltas over any fsspec URL (format_spec/store-v1.md)."""

from .check import CheckResult, check
from .commit import CommitResult, VersionInfo, acknowledge, commit, committed_base, log, status
from .gc import GcResult, gc
from .repo import Ref, Store, VersionRecord
from .streaming import BlockUploader
from .transfer import PullResult, PushResult, is_store, open_delta, open_version, pull, pull_since, push

__all__ = [
    "BlockUploader",
    "CheckResult",
    "CommitResult",
    "GcResult",
    "PullResult",
    "PushResult",
    "Ref",
    "Store",
    "VersionInfo",
    "VersionRecord",
    "acknowledge",
    "check",
    "commit",
    "committed_base",
    "gc",
    "is_store",
    "log",
    "open_delta",
    "open_version",
    "pull",
    "pull_since",
    "push",
    "status",
]
