"""PipeChurn's erasure-coded in-memory checkpoints: the chunks, who holds them, and what survives.

After every optimizer step a rank's state (the payload a buddy copy holds: its optimizer wrapper's
state, LR scheduler, counters, module buffers; ds_swift.protect.buddy) is laid out as one byte
string and cut into k data chunks, to which zfec (a maintained Reed-Solomon implementation) adds r
parity chunks. Chunk j goes to the j-th of the rank's k + r holders, each on a machine of its own
other than the rank's (:func:`assign_holders`). Any k chunks rebuild the state, so any r + 1
machines may fail at once (a lost rank's own machine held none of its chunks, so r + 1 losses cost
it r at most); each holder keeps 1/k of it (host memory (k + r)/k of the state in all, against
r + 1 for r full buddy copies).

A held chunk is itself a payload (ds_swift.recovery.state.transfer.encode): ``{"ec": {"index": j,
"k": k, "r": r, "length": L}, "manifest": the state's manifest, "chunk": uint8 tensor}``, so it
travels and is held exactly as a buddy copy is. :func:`erasure_target` (pure, from every rank's
report of the chunks it holds) decides which iteration the recovery lands on and where each lost
rank's k chunks come from.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ds_swift.recovery.consensus import RecoveryInputs
from ds_swift.recovery.holdings import BuddyHeld
from ds_swift.recovery.state.buddies import BuddyError, Member, assign_buddies
from ds_swift.recovery.state.transfer import decode, decode_dtype

__all__ = ["ErasureError", "assign_holders", "erasure_target", "join_chunks", "split_payload"]


class ErasureError(ValueError):
    """Chunks that cannot rebuild a state (too few, of different payloads, corrupt lengths)."""


def _zfec() -> Any:
    try:
        import zfec
    except ImportError as exc:  # a dependency of ds-swift: only a broken install lacks it
        raise ImportError('strategy "pipechurn" needs zfec (pip install zfec)') from exc
    return zfec


def split_payload(manifest: bytes, tensors: Sequence[torch.Tensor], k: int, r: int) -> list[dict[str, Any]]:
    """The k + r chunk records of the payload ``(manifest, tensors)`` (ds_swift.recovery.state.transfer.encode)."""
    flat = (
        torch.cat([t.detach().reshape(-1).cpu().view(torch.uint8) for t in tensors])
        if tensors
        else torch.empty(0, dtype=torch.uint8)
    )
    length = int(flat.numel())
    size = max(1, -(-length // k))
    padded = torch.zeros(size * k, dtype=torch.uint8)
    padded[:length] = flat
    blocks = [padded[i * size : (i + 1) * size].numpy().tobytes() for i in range(k)]
    shares = _zfec().Encoder(k, k + r).encode(blocks)
    text = manifest.decode()
    return [
        {
            "ec": {"index": j, "k": k, "r": r, "length": length},
            "manifest": text,
            "chunk": torch.frombuffer(bytearray(share), dtype=torch.uint8),
        }
        for j, share in enumerate(shares)
    ]


def join_chunks(records: Iterable[Mapping[str, Any]]) -> Any:
    """The state k chunk records (any k of one payload's k + r) rebuild (tensors on the CPU)."""
    records = list(records)
    if not records:
        raise ErasureError("no chunk to rebuild from")
    ec = records[0]["ec"]
    k, r, length, manifest = int(ec["k"]), int(ec["r"]), int(ec["length"]), records[0]["manifest"]
    by_index = {int(rec["ec"]["index"]): rec for rec in records}
    if any(rec["manifest"] != manifest or int(rec["ec"]["length"]) != length for rec in records):
        raise ErasureError("the chunks are of different payloads")
    if len(by_index) < k:
        raise ErasureError(f"{len(by_index)} distinct chunk(s) of the k = {k} needed")
    chosen = sorted(by_index)[:k]
    shares = [by_index[i]["chunk"].numpy().tobytes() for i in chosen]
    blocks = _zfec().Decoder(k, k + r).decode(shares, chosen)
    data = (
        torch.frombuffer(bytearray(b"".join(blocks)[:length]), dtype=torch.uint8)
        if length
        else torch.empty(0, dtype=torch.uint8)
    )
    metas = [(torch.Size(shape), decode_dtype(d)) for shape, d in json.loads(manifest)["tensors"]]
    need = sum(shape.numel() * torch.empty(0, dtype=d).element_size() for shape, d in metas)
    if need != length:
        raise ErasureError(f"the chunks hold {length} bytes, the manifest describes {need}")
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}  # the bytes of each dtype's tensors, in order
    offset = 0
    for shape, dtype in metas:
        n = shape.numel() * torch.empty(0, dtype=dtype).element_size()
        pieces.setdefault(dtype, []).append(data[offset : offset + n])
        offset += n
    # One new (aligned) buffer per dtype: a byte slice at an odd offset cannot be viewed as wider elements.
    return decode(manifest.encode(), {d: torch.cat(ps).view(d) for d, ps in pieces.items()})


def assign_holders(
    members: Iterable[Member], k: int, r: int, failure_domains: Sequence[Sequence[int]] = ()
) -> dict[int, tuple[int, ...]]:
    """owner rank -> its k + r chunk holders (holder j keeps chunk j), each on a machine (and failure
    domain) of its own other than the owner's: one machine's loss costs an owner one chunk at most.

    Raises:
        BuddyError: too few machines for that, naming the fields and the machines needed.
    """
    members = list(members)
    n = k + r
    need = (
        f"pipechurn.data_chunks={k} + pipechurn.parity_chunks={r} needs {n} machines (failure domains) besides "
        "each rank's own"
    )
    try:
        placement = assign_buddies(members, n, failure_domains)
    except BuddyError as exc:
        raise BuddyError(f"{need}: {exc}") from None
    domain_ix = {m: i for i, d in enumerate(failure_domains) for m in d}
    machine = {m.rank: m.machine for m in members}
    for owner, holders in placement.items():
        domains = {domain_ix.get(machine[h], ("m", machine[h])) for h in holders}
        if len(domains) < n:
            raise BuddyError(
                f"{need}: rank {owner}'s holders {list(holders)} share a machine; lower them or add machines"
            )
    return placement


def _held(inputs: RecoveryInputs) -> dict[int, dict[int, dict[int, int]]]:
    """lost rank -> iteration -> chunk index -> a surviving holder (on a machine that did not fail)."""
    failed, lost = inputs.failed_machines, set(inputs.replacements)
    out: dict[int, dict[int, dict[int, int]]] = {r: {} for r in inputs.replacements}
    for rep in inputs.reports:
        if not rep.survivor or rep.machine in failed:
            continue
        for owner, version, index in BuddyHeld.of(rep).chunks:
            if owner in lost:
                out[owner].setdefault(version, {}).setdefault(index, rep.rank)
    return out


def erasure_target(inputs: RecoveryInputs) -> tuple[int | None, dict[int, list[tuple[int, int]]], str]:
    """The iteration every rank lands on and, per lost rank, the k ``(holder, chunk index)`` to rebuild
    it from (data chunks first: they decode by concatenation); or ``(None, {}, why not)``."""
    k = max((BuddyHeld.of(r).k for r in inputs.reports), default=0)
    if k < 1:
        return None, {}, "no rank keeps erasure-coded chunks"
    held = _held(inputs)
    c = inputs.consensus
    for target in (c, c - 1):
        if target < c and inputs.rebased(target).cannot_undo:
            continue
        if all(len(versions.get(target, {})) >= k for versions in held.values()):
            sources = {lost: [(held[lost][target][i], i) for i in sorted(held[lost][target])[:k]] for lost in held}
            return target, sources, ""
    have = "; ".join(
        f"rank {r}: " + (", ".join(f"{len(ch)} at iteration {v}" for v, ch in sorted(vs.items())) or "none")
        for r, vs in sorted(held.items())
    )
    return (
        None,
        {},
        (
            f"fewer than k = {k} erasure-coded chunks of a lost rank's state survived at the consensus iteration {c} "
            f"or one before ({have}; machines {sorted(inputs.failed_machines)} failed)"
        ),
    )
