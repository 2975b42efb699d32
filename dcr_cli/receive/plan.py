"""The receiver plan: pure functions that every receiver (checkpoint directory, vLLM engine) shares.

Nothing here touches a file or a weight. A receiver reads what it holds, hands the bits and
digests to these functions, and writes what they return:

* ``order_chain`` / ``engine_chain``: which deltas to apply, in which order;
* ``check_table``: a manifest's tensor table must hash to its target fingerprint;
* ``check_untouched``: tensors that no item touches must be equal in the base and target tables
  (a manifest that drops an item is refused before any write);
* ``classify``: done / pending / torn from the digest of an item's current elements, where done
  and torn are legitimate only while resuming the same base -> target (format_spec/delta-v1.md §7.3);
* ``new_values``: the bits an item's elements must hold afterwards, checked against ``post``;
* ``unproven``: the touched tensors whose digests, read back after the writes, are not the
  target table's. A receiver records (or acknowledges) a version only when this is empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, TypeVar

import numpy as np

from ..errors import IncompatibleError, IntegrityError
from ..format.codec import apply_values, digest_small
from ..format.digest import digest_bytes
from ..format.manifest import Item, Manifest, Region, TensorEntry, fingerprint

Kind = Literal["done", "pending", "torn"]
# Up to this many bytes a digest is one single-threaded BLAKE3 call (format.codec.digest_small): the same digest.
SMALL_DIGEST_BYTES = 1 << 20


class HasManifest(Protocol):
    @property
    def manifest(self) -> Manifest: ...

    @property
    def url(self) -> str: ...


D = TypeVar("D", bound=HasManifest)


def quote(name: str) -> str:
    """A tensor name as messages print it: quoted, with newlines and escape codes escaped."""
    return repr(name)


# --------------------------------------------------------------------------- tables


def check_table(manifest: Manifest, where: str) -> None:
    """The tensor table is what the target fingerprint commits to; anything else is tampering."""
    if fingerprint(manifest.tensors) != manifest.target.fingerprint:
        raise IntegrityError(f"{where}: manifest tensor table does not match its target fingerprint (tampered?)")


def touched(manifest: Manifest) -> set[str]:
    return {item.tensor for item in manifest.items}


def check_untouched(manifest: Manifest, base_table: dict[str, TensorEntry], where: str) -> None:
    """Every tensor no item changes must have the same digest in the base and the target table.

    ``base_table`` is the receiver's table, proven to be the base (its fingerprint is
    ``manifest.base.fingerprint``). A delta whose items do not lead there is refused before the
    first write (an item dropped from an otherwise valid manifest, say).
    """
    changed = touched(manifest)
    bad = [
        name
        for name, entry in manifest.tensors.items()
        if name not in changed and ((held := base_table.get(name)) is None or held.digest != entry.digest)
    ]
    if bad:  # the first by name, as a sorted walk would meet it (without sorting 100k names each time)
        raise IntegrityError(
            f"{where}: tensor {quote(min(bad))} differs between base and target but no item changes it; "
            "the manifest is incomplete or tampered — nothing was written"
        )


def unproven(manifest: Manifest, digests: dict[str, str]) -> list[str]:
    """Tensors whose digest read back after the apply is not the target table's (sorted)."""
    return sorted(name for name, digest in digests.items() if manifest.tensors[name].digest != digest)


def proof_failure(manifest: Manifest, bad: list[str], where: str) -> IntegrityError:
    shown = ", ".join(quote(n) for n in bad[:5]) + (" …" if len(bad) > 5 else "")
    return IntegrityError(
        f"{where}: after the writes {len(bad)} tensors do not hold the target {manifest.target.version} ({shown}); "
        "the delta is inconsistent with its own table — the version was not recorded; re-run with an intact "
        "delta for the same base and target, or refit densely"
    )


def prediction_failure(manifest: Manifest, bad: list[str], where: str) -> IntegrityError:
    shown = ", ".join(quote(n) for n in bad[:5]) + (" …" if len(bad) > 5 else "")
    return IntegrityError(
        f"{where}: {len(bad)} tensors would not hold the target {manifest.target.version} after the writes "
        f"({shown}): their items do not lead from the bits held to the target table's digests; the delta is "
        "inconsistent with its own table — nothing was written; re-run with an intact delta for the same base "
        "and target, or refit densely"
    )


# --------------------------------------------------------------------------- items


def classify(current_digest: str | None, item: Item, resuming: bool, where: str) -> Kind:
    """Done, pending or torn, from the digest of the item's current elements (None: replicas disagree).

    A fresh apply (the receiver is proven to be at the base) requires every item to be pending:
    an item already at ``post`` or at neither image means the manifest does not describe this
    base (``pre`` and ``post`` swapped, a region shifted) or that the weights changed behind
    dcr's back. Only a resume of the same base -> target may find items done or torn.
    """
    if current_digest is not None and current_digest == item.pre:
        return "pending"
    if not resuming:
        raise IncompatibleError(
            f"{where}: {quote(item.tensor)} {item.region.to_json()} is not at the delta's pre-image although the "
            "receiver holds the delta's base; the delta does not fit this base (tampered manifest?) or the "
            "weights were changed outside dcr. Nothing was written"
        )
    if current_digest is not None and current_digest == item.post:
        return "done"
    return "torn"


def new_values(
    item: Item,
    kind: Kind,
    current: np.ndarray,
    values: np.ndarray,
    repair: Callable[[], np.ndarray],
    *,
    absolute: bool = False,
) -> np.ndarray:
    """The bits the item's elements must hold: checked against ``post`` before anything is written.

    ``values`` are the decoded data values (XOR masks or absolute values); ``repair`` returns the
    absolute target values of an xor item. ``absolute`` forces them even for a pending xor item
    (a receiver whose path does not keep stored bits, such as a widening engine).
    """
    if item.op == "xor" and (kind == "torn" or absolute):
        new = repair()
    elif kind == "pending":
        new = apply_values(item.op, current, values)
    else:
        new = values  # overwrite and replace carry absolute values already
    if (digest_small(new) if new.nbytes <= SMALL_DIGEST_BYTES else digest_bytes(new)) != item.post:
        raise IntegrityError(
            f"{quote(item.tensor)} {item.region.to_json()}: computed values do not match the delta's post digest; "
            "the delta is corrupt or the receiver was modified during the apply"
        )
    return new


def canonical_index(region: Region, positions: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | slice:
    """Flat C-order indices of an item's affected elements; a slice when they are one contiguous range."""
    if positions is None:  # replace: the whole region
        if not region.is_box:
            assert region.start is not None and region.stop is not None
            return slice(region.start, region.stop)
        positions = np.arange(region.size, dtype=np.int64)
    return region.to_canonical(positions, shape)


def contiguous_run(region: Region, shape: tuple[int, ...]) -> int:
    """Length of the region's contiguous stretches in canonical order (a range: its size).

    Region-local positions p and q with ``p // run == q // run`` lie in one stretch, and every
    canonical element between them belongs to the region: a writer may rewrite that span.
    """
    if not region.is_box:
        return max(1, region.size)
    assert region.offsets is not None and region.sizes is not None
    run = 1
    for axis in range(len(shape) - 1, -1, -1):
        run *= region.sizes[axis]
        if region.sizes[axis] != shape[axis]:
            break
    return max(1, run)


# --------------------------------------------------------------------------- chains


def order_chain(
    deltas: Sequence[D], start_fp: str, resume: D | None, history: Sequence[str] = ()
) -> tuple[list[D], list[D]]:
    """Order deltas by base -> target from the receiver's version. Returns (to apply, already applied).

    ``history`` holds fingerprints of versions the receiver passed through before: a delta leading to
    one of them (or to the current version) was applied already.
    """
    by_base: dict[str, D] = {}
    for d in deltas:
        if d is resume:
            continue
        other = by_base.setdefault(d.manifest.base.fingerprint, d)
        if other is not d:
            raise IncompatibleError(
                f"{other.url} and {d.url} both start at version {d.manifest.base.version}; pass only one of them"
            )
    plan: list[D] = [resume] if resume else []
    fp = resume.manifest.target.fingerprint if resume else start_fp
    while fp in by_base and by_base[fp] not in plan:  # "not in plan": a cycle of deltas ends the chain
        plan.append(by_base[fp])
        fp = by_base[fp].manifest.target.fingerprint
    # Deltas that lead up to where the receiver already is were applied before.
    behind_fps = {resume.manifest.base.fingerprint if resume else start_fp, *history}
    behind: list[D] = []
    changed = True
    while changed:
        changed = False
        for d in deltas:
            if d not in plan and d not in behind and d.manifest.target.fingerprint in behind_fps:
                behind.append(d)
                behind_fps.add(d.manifest.base.fingerprint)
                changed = True
    stray = [d for d in deltas if d not in plan and d not in behind]
    if stray:
        d = stray[0]
        if not plan and len(deltas) == 1:
            raise IncompatibleError(
                f"the checkpoint is not at the base of {d.url}: it holds fingerprint {start_fp[:16]}…, the delta "
                f"needs version {d.manifest.base.version} ({d.manifest.base.fingerprint[:16]}…); apply the missing "
                "deltas first or refit it densely"
            )
        raise IncompatibleError(
            f"{d.url} (version {d.manifest.base.version} -> {d.manifest.target.version}) does not link to the "
            f"chain from the checkpoint's fingerprint {start_fp[:16]}…; pass the deltas in between or leave it out"
        )
    return plan, behind


def engine_chain(deltas: Sequence[D]) -> list[D]:
    """Apply order for a receiver whose version the caller does not know (a vLLM engine).

    The chain starts at the one delta whose base no other delta produces (the engine checks that
    base itself) and must use every delta given. One delta is a chain by itself, a no-op one (its
    base is its target: an engine applies it to establish its version) included.
    """
    if len(deltas) == 1:
        return list(deltas)
    targets = {d.manifest.target.fingerprint for d in deltas}
    starts = [d for d in deltas if d.manifest.base.fingerprint not in targets]
    by_base = {d.manifest.base.fingerprint: d for d in deltas}
    if len(starts) != 1 or len(by_base) != len(deltas):
        raise IncompatibleError("the deltas do not form one chain (base -> target); pass them one chain at a time")
    order = [starts[0]]
    while order[-1].manifest.target.fingerprint in by_base and len(order) < len(deltas):
        order.append(by_base[order[-1].manifest.target.fingerprint])
    if len(order) != len(deltas):
        raise IncompatibleError("the deltas do not form one chain (base -> target); pass them one chain at a time")
    return order


def same_transition(applying: dict, manifest: Manifest) -> bool:
    """Whether ``manifest`` leads from the same base to the same target as the interrupted apply."""
    base, target = applying.get("base"), applying.get("target")
    return (
        isinstance(base, dict)
        and isinstance(target, dict)
        and base.get("fingerprint") == manifest.base.fingerprint
        and target.get("fingerprint") == manifest.target.fingerprint
    )
