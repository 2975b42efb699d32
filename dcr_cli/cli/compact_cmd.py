"""dcr compact: keyframes and squashed shortcuts for lagging and new receivers."""

from __future__ import annotations

from typing import Any

import click

from .common import emit_json, handle_errors, human_bytes, say
from .store_options import parse_storage_options, storage_options


@click.command("compact")
@click.argument("url")
@click.option(
    "--keyframe",
    "keyframe",
    type=click.Path(exists=True, file_okay=False),
    help="Publish this checkpoint (at a committed version) as a keyframe: new receivers join from it.",
)
@click.option("--version", help="With --keyframe: the committed version it holds (default: the head).")
@click.option(
    "--every",
    type=click.IntRange(min=1),
    help="Publish a squashed shortcut from the newest keyframe to every K-th committed version after it.",
)
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout.")
@handle_errors
def command(
    url: str,
    keyframe: str | None,
    version: str | None,
    every: int | None,
    workers: int | None,
    storage_option: tuple[str, ...],
    as_json: bool,
) -> None:
    """Publish keyframes (--keyframe CKPT) and shortcuts (--every K) on the store at URL.

    Lagging receivers then catch up along the cheapest path (dcr pull/apply --since), new ones join
    with one download (dcr pull --join). dcr gc keeps the newest keyframe and its shortcuts.
    """
    from ..errors import DcrError
    from ..store.keyframes import compact, publish_keyframe

    if keyframe is None and every is None:
        raise DcrError("give --keyframe CHECKPOINT, --every K, or both")
    if version is not None and keyframe is None:
        raise DcrError("--version goes with --keyframe")
    options = parse_storage_options(storage_option)
    out: dict[str, object] = {}
    if keyframe is not None:
        frame = publish_keyframe(url, keyframe, version=version, storage_options=options)
        out["keyframe"] = {"version": frame.version, "bytes": frame.bytes}
        if not as_json:
            say(f"{url}: keyframe {frame.version} ({human_bytes(frame.bytes)}, {len(frame.files)} files)")
    if every is not None:
        result = compact(url, every=every, storage_options=options, workers=workers, log=None if as_json else say)
        out["shortcuts"] = result.to_json()
        if not as_json:
            raced = f" ({len(result.raced)} published by another dcr compact meanwhile)" if result.raced else ""
            say(
                f"{url}: {len(result.published)} shortcut(s) published from keyframe {result.keyframe}, "
                f"{len(result.present)} already there{raced}"
            )
    if as_json:
        emit_json(out)


def join_pull(url: str, out: str, since: str | None, options: dict[str, Any], as_json: bool) -> None:
    """``dcr pull --join``: the newest keyframe as the checkpoint directory ``out``."""
    from ..errors import DcrError
    from ..store.keyframes import join as join_store

    if since is not None:
        raise DcrError("--join (no state) and --since VERSION exclude each other")
    joined = join_store(url, out, storage_options=options)
    if as_json:
        emit_json(joined.to_json())
    else:
        say(
            f"{joined.path}: joined at keyframe {joined.version} ({human_bytes(joined.bytes)}), fingerprint "
            f"verified; follow with: dcr apply {url} --since {joined.version} --into {joined.path}"
        )
