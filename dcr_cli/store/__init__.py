"""dcr stores: publishing, fetching and committing deltas over any fsspec URL (format_spec/store-v1.md).

Modules: ``backends`` (fsspec protocol -> capabilities), ``repo`` (layout, records, the Store),
``transfer`` (push, pull, reading a version in place), ``streaming`` (uploads during a diff),
``ledger`` (acknowledgements, commits, status, log), ``collect`` (gc), ``audit`` (check), ``keyframes``
(keyframes, shortcuts, the catch-up route and its pull).
The names below are the package's API; none of them is also the name of one of its modules.
"""

from .audit import CheckResult, check
from .collect import GcResult, gc
from .keyframes import pull_since
from .ledger import CommitResult, VersionInfo, acknowledge, commit, committed_base, log, status
from .repo import Ref, Store, VersionRecord
from .streaming import BlockUploader, DeferredUploader
from .transfer import PullResult, PushResult, is_store, open_delta, open_version, pull, push

__all__ = [
    "BlockUploader",
    "CheckResult",
    "CommitResult",
    "DeferredUploader",
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
