"""A lagging receiver's catch-up (``dcr pull/apply --since V``, :func:`plan`) asks the store about the versions
after V, not about the whole history: the commit chain is read forwards from V (``commits/<v>.json`` names
v's committed successor), and only the version records, manifests and shortcut records a route from V could
take are read. Before, every catch-up read every version record and asked about every manifest from the
genesis, and walked every commit record: O(history) requests per catch-up on S3, where a store keeps one
version per optimizer step.

Measured on the real moto server behind a counting proxy: two stores of the same shape (an older keyframe
with its shortcuts, a keyframe at V with the shortcut V..V+2), one with 30 versions and one with 60, each
caught up from 3 versions behind (plan, pull --since, apply --since): the requests other than block reads are
the same in number (77 for each; 329 and 599 before), and none names a version older than V's base (whose
commit record says V is committed)."""

from __future__ import annotations

import re
import shutil
import uuid
from collections import Counter
from pathlib import Path

from helpers_checkpoints import copy_checkpoint, read_raw
from store_fixtures import CountingProxy, S3Endpoint, make_deltas

import dcr_cli
from dcr_cli.store import acknowledge, commit, push
from dcr_cli.store.keyframes import compact, plan, publish_keyframe

STEPS = 60


def _build(local: Path, ckpts: list[Path], deltas: list[Path], n: int) -> None:
    """v1..v``n`` committed; a keyframe at v(n-20) and its shortcuts every 2 (made while it was the newest),
    then a keyframe at v(n-3) and its shortcut v(n-3)..v(n-1)."""
    url = str(local)
    old = n - 20
    for i in range(1, n + 1):
        push(deltas[i - 1], url)
        acknowledge(url, f"v{i}", "r")
        commit(url, f"v{i}", receivers=["r"])
        if i == old + 4:
            publish_keyframe(url, ckpts[old], version=f"v{old}")
            assert compact(url, every=2).published == [f"v{old}..v{old + 2}", f"v{old}..v{old + 4}"]
    publish_keyframe(url, ckpts[n - 3], version=f"v{n - 3}")
    assert compact(url, every=2).published == [f"v{n - 3}..v{n - 1}"]


def _upload(endpoint: S3Endpoint, local: Path, name: str) -> str:
    """The local store's objects, copied as they are into a fresh bucket of the moto server: the same store on S3."""
    fs = endpoint.filesystem()
    fs.mkdir(name)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.pipe(f"{name}/store/{path.relative_to(local).as_posix()}", path.read_bytes())
    return f"s3://{name}/store"


def _catch_up(endpoint: S3Endpoint, url: str, n: int, ckpts: list[Path], tmp: Path) -> tuple[Counter[str], list[str]]:
    """Plan, pull --since and apply --since from v(n-3) through a counting proxy: (method -> requests that
    are no block reads, every path asked about)."""
    since = f"v{n - 3}"
    proxy = CountingProxy(endpoint.url)
    opts = {**endpoint.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
    try:
        route = plan(url, since, allow_keyframe=False, storage_options=opts)
        assert [(s.kind, s.base, s.target) for s in route.steps] == [
            ("shortcut", since, f"v{n - 1}"),
            ("chain", f"v{n - 1}", f"v{n}"),
        ]
        pulled = dcr_cli.pull_since(url, since, tmp / f"pulled-{n}", storage_options=opts)
        assert [(r.kind, r.version) for r in pulled] == [("shortcut", f"v{n - 1}"), ("chain", f"v{n}")]
        recv = copy_checkpoint(ckpts[n - 3], tmp / f"recv-{n}")
        dcr_cli.apply(url, since=since, into=recv, storage_options=opts, workers=1)
        assert read_raw(recv) == read_raw(ckpts[n])
    finally:
        proxy.close()
    with proxy.lock:
        requests = dict(proxy.requests)
    counted: Counter[str] = Counter()
    for (method, path), k in requests.items():
        if "/blocks/" not in path:  # block reads: the route's payload, the same in both stores
            counted[method] += k
    return counted, [path for _method, path in requests]


def _versions_named(paths: list[str]) -> set[int]:
    """The version numbers in the record names asked about (versions/, commits/, acks/, children/, shortcuts/)."""
    out: set[int] = set()
    for path in paths:
        out.update(int(m) for m in re.findall(r"/(?:versions|commits|acks|children|shortcuts)/v(\d+)", path))
    return out


def test_a_catch_up_costs_requests_for_the_versions_after_since_not_the_history(
    s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    ckpts, deltas = make_deltas(tmp_path, STEPS, size=512)
    measured = {}
    for n in (30, STEPS):
        local = tmp_path / f"local-{n}"
        _build(local, ckpts, deltas, n)
        url = _upload(s3_endpoint, local, f"dcr-catchup-{n}-{uuid.uuid4().hex[:8]}")
        shutil.rmtree(local)
        measured[n] = _catch_up(s3_endpoint, url, n, ckpts, tmp_path)
    (short, short_paths), (long, long_paths) = measured[30], measured[STEPS]
    # The same requests for 60 versions as for 30 (give or take a retried request): nothing grows with the 26
    # (56) versions before v27's base.
    assert set(long) == set(short) and all(abs(long[k] - short[k]) <= 2 for k in short), (short, long)
    assert short["GET"] + short["HEAD"] < 90, short  # three catch-ups (plan, pull, apply) of 30 versions
    # Nothing asked names a version older than since's base: not its record, its commit or its shortcuts
    # (the older keyframe's shortcuts are on no route from since).
    for n, paths in ((30, short_paths), (STEPS, long_paths)):
        assert min(_versions_named(paths)) >= n - 4, sorted(_versions_named(paths))
