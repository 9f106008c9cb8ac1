"""Which passes of the iteration in flight PipeChurn keeps and which it redoes (pure: reports in, plan out).

After a failure in the middle of an iteration each survivor stands somewhere in DeepSpeed's 1F1B
schedule: it finished the backward passes of micro-batches ``0 .. b-1`` (backward passes run in
micro-batch order), maybe the forward passes of a few more. Its copy of the iteration
(ds_swift.recovery.state.inflight) holds the gradients accumulated over those ``b`` backward
passes, the activations it sent for them and the gradients they produced. A forward pass whose
backward had not run lost its autograd graph with the failed engine: it is redone. A lost rank
(decoded at the consensus) keeps nothing: ``b = 0``.

The redo of the iteration is then DeepSpeed's schedule on every rank, micro-batch ``k`` of a rank
with ``b`` kept passes skipped when ``k < b`` and run live otherwise, accumulating onto the kept
gradients in the failure-free order (so bitwise). On the edge from stage ``s`` to ``s + 1``:

- activation ``k`` is needed by ``s + 1`` when ``k >= b[s+1]``; it travels live when ``s`` runs
  forward ``k`` again (``k >= b[s]``), else ``s`` sends the one it kept before the redo starts and
  ``s + 1`` is served it from memory (:meth:`RankPasses.recv`);
- gradient ``k`` is needed by ``s`` when ``k >= b[s]``; live when ``k >= b[s+1]``, else kept.

Every other send and receive of the schedule is skipped at both ends; both ends decide from the
same two numbers, so the pairs that remain match in order, as in the failure-free run. Tensor
parallel peers run their passes together (collectives inside each pass): peers that kept different
counts all redo every pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ds_swift.recovery.consensus import RecoveryInputs
from ds_swift.recovery.holdings import InflightHeld

__all__ = ["RankPasses", "Transfer", "kept_passes", "rank_passes", "redo_summary", "transfers"]

Source = Literal["skip", "kept", "live"]


@dataclass(frozen=True)
class RankPasses:
    """One rank's part of the redo: its kept passes and its neighbours' (None: no such stage).

    Args:
        rank: the rank.
        micro_batches: the iteration's micro-batches (gradient accumulation steps).
        kept: micro-batches ``0 .. kept-1`` of this rank are not run again.
        prev: the previous stage's rank and its kept count (None on the first stage).
        next: the next stage's rank and its kept count (None on the last stage).
    """

    rank: int
    micro_batches: int
    kept: int
    prev: tuple[int, int] | None = None
    next: tuple[int, int] | None = None

    @property
    def redo(self) -> range:
        """The micro-batches whose forward and backward passes this rank runs."""
        return range(self.kept, self.micro_batches)

    def runs(self, k: int) -> bool:
        return k >= self.kept

    def recv(self, kind: str, k: int) -> Source:
        """Where receive ``k`` of ``kind`` ("act" from the previous stage, "grad" from the next) comes from."""
        peer = self.prev if kind == "act" else self.next
        if peer is None or k < self.kept:
            return "skip"
        return "live" if k >= peer[1] else "kept"

    def send(self, kind: str, k: int) -> Source:
        """Whether send ``k`` of ``kind`` ("act" to the next stage, "grad" to the previous) goes live."""
        peer = self.next if kind == "act" else self.prev
        if peer is None or k < self.kept or k < peer[1]:
            return "skip"  # not run here again (the peer got it before the redo), or not needed
        return "live"

    def served(self, kind: str) -> range:
        """The micro-batches of ``kind`` this rank is sent from its neighbour's copy before the redo."""
        peer = self.prev if kind == "act" else self.next
        return range(self.kept, peer[1]) if peer is not None else range(0)

    def to_send(self, kind: str) -> range:
        """The micro-batches of ``kind`` this rank sends its neighbour from its copy before the redo."""
        peer = self.next if kind == "act" else self.prev
        return range(peer[1], self.kept) if peer is not None else range(0)


@dataclass(frozen=True)
class Transfer:
    """Kept messages sent before the redo: ``kind`` of ``micro_batches`` from ``src`` to ``dst``."""

    src: int
    dst: int
    kind: str
    micro_batches: range


def kept_passes(inputs: RecoveryInputs, micro_batches: int) -> dict[int, int]:
    """Rank -> how many micro-batches of the iteration in flight (``inputs.consensus + 1``) it keeps.

    A lost rank keeps none; a survivor the passes of its copy where it is of that iteration (a copy
    of another iteration, after a rebase to an older consensus, counts none). Tensor-parallel peers
    that kept different counts keep none (their passes run together)."""
    in_flight = inputs.consensus + 1
    out: dict[int, int] = {}
    for r in inputs.reports:
        held = InflightHeld.of(r)
        usable = r.survivor and r.rank in inputs.survivors and held.iteration == in_flight and held.passes > 0
        out[r.rank] = min(held.passes, micro_batches) if usable else 0
    peers: dict[tuple[int, int], list[int]] = {}
    for r in inputs.reports:
        peers.setdefault((r.stage, r.dp), []).append(r.rank)
    for group in peers.values():
        if len({out[rank] for rank in group}) > 1:
            for rank in group:
                out[rank] = 0
    return out


def _neighbour(inputs: RecoveryInputs, rank: int, step: int) -> int | None:
    me = inputs.by_rank[rank]
    for r in inputs.reports:
        if r.dp == me.dp and r.tp == me.tp and r.stage == me.stage + step:
            return r.rank
    return None


def rank_passes(
    inputs: RecoveryInputs, rank: int, micro_batches: int, kept: Mapping[int, int] | None = None
) -> RankPasses:
    """``rank``'s :class:`RankPasses` (``kept``: :func:`kept_passes`, computed when not given)."""
    kept = kept if kept is not None else kept_passes(inputs, micro_batches)
    prev, nxt = _neighbour(inputs, rank, -1), _neighbour(inputs, rank, +1)
    return RankPasses(
        rank,
        micro_batches,
        kept[rank],
        (prev, kept[prev]) if prev is not None else None,
        (nxt, kept[nxt]) if nxt is not None else None,
    )


def transfers(inputs: RecoveryInputs, micro_batches: int) -> list[Transfer]:
    """Every transfer of kept messages, in one order every rank follows (by sender, then receiver):
    each rank sends and receives its own in that order, so blocking sends never wait in a cycle."""
    kept = kept_passes(inputs, micro_batches)
    out = []
    for r in sorted(kept):
        mine = rank_passes(inputs, r, micro_batches, kept)
        for kind, peer in (("act", mine.next), ("grad", mine.prev)):
            span = mine.to_send(kind)
            if peer is not None and len(span):
                out.append(Transfer(r, peer[0], kind, span))
    return sorted(out, key=lambda t: (t.src, t.dst, t.kind))


def redo_summary(inputs: RecoveryInputs, micro_batches: int) -> dict[str, object]:
    """The work of the partial redo (the same on every rank): passes recomputed, in all and by rank,
    against the full retrain's; forward passes redone because the failure dropped their graphs."""
    kept = kept_passes(inputs, micro_batches)
    redo = {r: micro_batches - k for r, k in sorted(kept.items())}
    held = {r.rank: InflightHeld.of(r) for r in inputs.reports}
    dropped = {
        r.rank: max(0, min(held[r.rank].forwards, micro_batches) - kept[r.rank])
        for r in inputs.reports
        if r.rank in inputs.survivors and held[r.rank].iteration == inputs.consensus + 1
    }
    return {
        "partial": True,
        "in_flight": inputs.consensus + 1,
        "micro_batch_passes": sum(redo.values()),
        "micro_batch_passes_busiest": max(redo.values(), default=0),
        "full_retrain_passes": micro_batches * len(kept),
        "passes_by_rank": {str(r): n for r, n in redo.items()},
        "forwards_dropped": sum(dropped.values()),
    }
