"""dcr diff."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..checkpoints import FORMATS as FORMAT_CHOICES
from .common import emit_json, handle_errors, human_bytes, say, sized_progress
from .store_options import parse_storage_options, storage_options

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..delta.summary import DiffSummary
    from ..format.manifest import VersionRef
    from ..store import BlockUploader
    from ..store.repo import Store

Counter = Callable[[int], None]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


@click.command("diff")
@click.argument("base", type=click.Path(file_okay=False))
@click.argument("new", type=click.Path(file_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(), help="Delta directory to create.")
@click.option("--base-version", help="Label of BASE (default: derived from its content).")
@click.option("--target-version", help="Label of NEW (default: derived from its content).")
@click.option("--workers", type=click.IntRange(min=1), help="Threads to use (default: all cores).")
@click.option(
    "--level", type=click.IntRange(1, 22), default=None, help="Standard zstd level instead of dcr's tuned parameters."
)
@click.option(
    "--overwrite",
    "overwrite",
    multiple=True,
    metavar="GLOB",
    help="Send tensors matching GLOB as absolute values (receivers that cast or quantize). Repeatable.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMAT_CHOICES),
    help="Checkpoint format of BASE and NEW (default: autodetect): HF safetensors dir, PyTorch DCP,"
    " DCP's HF shards, Megatron torch_dist.",
)
@click.option(
    "--profile",
    type=click.Path(exists=True),
    help='Megatron: the HF config.json (or its directory) of the model, with optional "megatron" options.',
)
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="GLOB",
    help="DCP / DCP-HF: diff only stored tensors matching GLOB (the weights, not optimizer state). Repeatable.",
)
@click.option("--strip-prefix", metavar="PREFIX", help="DCP / DCP-HF: remove PREFIX from stored names to get HF names.")
@click.option("--rank", type=click.IntRange(min=0), help="This producer's rank (default: $RANK under torchrun).")
@click.option("--world-size", type=click.IntRange(min=1), help="Producers in all (default: $WORLD_SIZE).")
@click.option(
    "--assemble/--no-assemble",
    default=True,
    help="With --rank: the producer that writes the last part assembles the delta (default), or leave it"
    " to `dcr assemble OUT`.",
)
@click.option(
    "--push",
    "push_url",
    metavar="URL",
    help="Publish the delta on this store, uploading blocks while the diff is still running (as dcr push).",
)
@storage_options
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on a terminal.")
@handle_errors
def command(
    base: str,
    new: str,
    out: str,
    base_version: str | None,
    target_version: str | None,
    workers: int | None,
    level: int | None,
    overwrite: tuple[str, ...],
    fmt: str | None,
    profile: str | None,
    include: tuple[str, ...],
    strip_prefix: str | None,
    rank: int | None,
    world_size: int | None,
    assemble: bool,
    push_url: str | None,
    storage_option: tuple[str, ...],
    as_json: bool,
    progress: bool,
) -> None:
    """Write the delta from checkpoint BASE to checkpoint NEW.

    BASE and NEW are Hugging Face checkpoint directories or training checkpoints
    (PyTorch DCP, DCP's HF shards, Megatron torch_dist); training checkpoints are
    read shard by shard and the delta is in HF (canonical) coordinates.
    """
    from ..errors import IncompatibleError
    from ..produce import diff

    rank = rank if rank is not None else _env_int("RANK")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE")
    if (rank is None) != (world_size is None) or (rank is not None and world_size is not None and rank >= world_size):
        raise IncompatibleError("give --rank and --world-size together, with rank < world size")
    setup: Future[tuple[BlockUploader, Store]] | None = None
    check_base: Callable[[VersionRef], None] | None = None
    on_block: Callable[[str, bytes], None] | None = None
    store_ready: Callable[[], None] | None = None
    if push_url:
        if rank is not None:
            raise IncompatibleError("--push publishes a whole delta: run dcr push OUT URL after dcr assemble")
        from ..io.pool import in_background
        from ..store import BlockUploader, DeferredUploader
        from ..store.repo import Ref, Store, check_distinct_labels, check_label

        # What the push after the diff would refuse, refused before the diff and before any block is uploaded.
        if target_version is not None:
            check_label(target_version, "the delta's target version")
            check_distinct_labels(target_version, base_version, "--target-version")
        options = parse_storage_options(storage_option)
        url = push_url

        def connect() -> tuple[BlockUploader, Store]:
            # A known label: each block is announced as it lands, for receivers waiting for the version.
            uploader = BlockUploader(url, options, announce=target_version)
            # One Store for the check before the diff and the push after it: the records it found are not asked again.
            return uploader, Store(url, options)

        # The store's client (its imports and session: tenths of a second) is set up while the scan
        # starts; the first write waits for it, so a store that cannot take the push (no atomic
        # publish, no access) still leaves nothing written and nothing uploaded.
        setup = in_background(connect, "dcr-store-setup")
        ready = setup
        on_block = DeferredUploader(lambda: ready.result()[0])

        def store_ready() -> None:
            ready.result()

        if target_version is not None:  # (without it, the version a re-run would find is not known yet)
            from ..store.transfer import check_push_base

            label = target_version

            def check_base(base: VersionRef) -> None:
                check_push_base(ready.result()[1], Ref(base.version, base.fingerprint), label)

    config = None
    if profile is not None:
        from ..checkpoints.megatron import load_profile

        config = load_profile(profile)
    elif include or strip_prefix:
        config = {"include": list(include), "strip_prefix": strip_prefix or ""}
    with sized_progress("diff", progress) as (set_total, advance):
        summary = diff(
            base,
            new,
            out,
            base_version=base_version,
            target_version=target_version,
            workers=workers,
            level=level,
            overwrite=overwrite,
            progress=advance,
            format=fmt,
            profile=config,
            rank=rank,
            world_size=world_size,
            on_block=on_block,
            progress_total=set_total,
            check_base=check_base,
            before_writing=store_ready,
        )
    pushed = None
    uploader = None
    if setup is not None and push_url is not None:
        from ..store import push
        from ..store.transfer import PushResult

        uploader, store = setup.result()

        def published(result: PushResult) -> None:
            if result.repair_pending:  # receivers can start now; the repair blocks go up after publication
                say(f"{push_url}: published {result.version} (repair blocks follow)", err=True)
            uploader.close()  # the announcements (done by now): before the push removes them

        try:
            # The push's first questions go out while the last blocks are still on their way (the blocks'
            # announcements go on until publication).
            pushed = push(
                out,
                push_url,
                storage_options=options,
                on_published=published,
                fresh=uploader.uploaded,
                store=store,
                uploads_done=uploader.wait_uploads,
            )
        finally:
            uploader.close()
    if summary is None:
        from ..delta.parts import part_dir, try_assemble_last

        assert rank is not None
        say(f"{part_dir(out, rank)}: part {rank} of {world_size} written", err=True)
        if not assemble:
            return
        manifest = try_assemble_last(out)
        if manifest is None:
            return
        from ..delta.summary import summarize

        summary = summarize(Path(out), manifest)
    if as_json:
        emit_json({**summary.to_json(), **({"push": pushed.to_json()} if pushed else {})})
        return
    if summary.already_there:
        say(
            f"{summary.delta}: already there, {summary.base_version} -> {summary.target_version} (this diff "
            "completed before; nothing written)"
        )
    else:
        _say_written(summary)
    if pushed is not None and uploader is not None:
        say(
            f"{push_url}: published {pushed.version} (base {pushed.base}); {uploader.uploaded_blocks} blocks "
            f"uploaded during the diff, {pushed.uploaded_blocks} after it ({pushed.repair_uploaded_blocks} repair "
            "blocks, after publication)"
        )


def _say_written(summary: DiffSummary) -> None:
    say(
        f"{summary.delta}: {summary.base_version} -> {summary.target_version}, "
        f"{summary.changed_elements}/{summary.total_elements} elements changed ({summary.change_rate:.3%}), "
        f"{human_bytes(summary.payload_bytes + summary.manifest_bytes)} "
        f"({_against_full(summary.full_bytes, summary.payload_bytes + summary.manifest_bytes)})"
    )


def _against_full(full: int, sent: int) -> str:
    """The delta's size against the full checkpoint's, in words that stay true when the delta is the larger."""
    if full <= 0 or sent <= 0:
        return "the full checkpoint is empty" if full <= 0 else "nothing to send"
    if sent <= full:
        return f"{full / sent:.1f}x smaller than full"
    return f"{sent / full:.1f}x larger than full"
