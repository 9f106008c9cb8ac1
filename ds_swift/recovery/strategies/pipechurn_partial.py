"""PipeChurn's partial recomputation (section 3.5): after the decode, only the lost passes run again.

The lost ranks' states are decoded at iteration ``c`` (the consensus); the iteration in flight is
``c + 1``. Where every survivor holds a complete copy of its part of ``c + 1`` (its sends and its
accumulated gradients, ds_swift.recovery.state.inflight; ``RankReport.inflight``), only the lost
ranks run their forward and backward passes of ``c + 1`` again, their receives from surviving
neighbours served from the copies those neighbours kept of what they sent
(ds_swift.recovery.replay.passes); the survivors load their kept gradients back; then every rank
runs the gradient reductions and the step of ``c + 1`` live (the runtime, after the recovery). The
work recomputed is the lost ranks' passes, not every rank's.

Where a precondition fails, every rank trains ``c + 1`` again (the full retrain), and the plan's
reason (log and recovery timeline) says why: a survivor without a complete copy (partial
recomputation off, or the failure hit before its last pass), a survivor that already stepped
``c + 1``, or two lost ranks on adjacent stages of one pipeline (neither holds what the other sent).
Both ways are exact: bitwise the failure-free run.
"""

from __future__ import annotations

from typing import Any

from ds_swift.recovery.base import RankContext
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan

__all__ = ["feeders", "partial_blocker", "recompute_lost", "retrain_summary"]


def _neighbour(inputs: RecoveryInputs, rank: int, step: int) -> int | None:
    me = inputs.by_rank[rank]
    for r in inputs.reports:
        if r.dp == me.dp and r.tp == me.tp and r.stage == me.stage + step:
            return r.rank
    return None


def partial_blocker(inputs: RecoveryInputs) -> str | None:
    """Why the iteration in flight (``inputs.consensus + 1``) cannot be recomputed partially (None: it can)."""
    in_flight = inputs.consensus + 1
    if not inputs.replacements:
        return "no rank lost its state"
    if inputs.undo:
        return f"ranks {list(inputs.undo)} already stepped iteration {in_flight}"
    by = inputs.by_rank
    lacking = [r for r in inputs.survivors if by[r].inflight != in_flight]
    if lacking:
        return (
            f"ranks {lacking} hold no complete copy of iteration {in_flight}'s sends and gradients "
            "(pipechurn.partial_recompute off, or the failure hit before their last pass)"
        )
    lost = set(inputs.replacements)
    for r in sorted(lost):
        nxt = _neighbour(inputs, r, +1)
        if nxt in lost:
            return f"ranks {r} and {nxt}, adjacent stages of one pipeline, were both lost"
    return None


def feeders(inputs: RecoveryInputs) -> dict[int, list[tuple[int, str]]]:
    """Lost rank -> [(surviving neighbour, the kind it sent the lost rank)], by neighbour rank."""
    out: dict[int, list[tuple[int, str]]] = {}
    for r in inputs.replacements:
        prev, nxt = _neighbour(inputs, r, -1), _neighbour(inputs, r, +1)
        pairs = [(prev, "act")] if prev is not None else []
        pairs += [(nxt, "grad")] if nxt is not None else []
        out[r] = sorted(pairs)
    return out


def retrain_summary(inputs: RecoveryInputs, micro_batches: int, why: str) -> dict[str, Any]:
    """The work of the full retrain: every rank runs every pass of the iteration in flight again."""
    return {
        "partial": False,
        "why_full": why,
        "in_flight": inputs.consensus + 1,
        "micro_batch_passes": micro_batches * len(inputs.reports),
        "micro_batch_passes_busiest": micro_batches,
    }


def recompute_lost(plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> dict[str, Any]:
    """Every rank: feed the lost ranks, which replay their passes of the iteration in flight; the
    survivors load their kept gradients. Returns the work done (the same on every rank)."""
    from ds_swift.recovery.replay.passes import replay_passes
    from ds_swift.recovery.state.inflight import InflightKeeper
    from ds_swift.recovery.state.transfer import recv_state, send_state

    in_flight = plan.consensus + 1
    keeper = ctx.lent.get(InflightKeeper)  # the runtime's copy of the iteration in flight
    if keeper is None:
        raise RuntimeError(f"rank {ctx.rank}: partial recomputation planned, but this rank keeps no in-flight copy")
    feeds = feeders(inputs)
    # Survivors send in lost-rank order, the lost ranks receive in survivor order: no cycle.
    sent = 0
    for lost in sorted(feeds):
        for holder, kind in feeds[lost]:
            if holder == ctx.rank:
                sent += send_state(keeper.messages(kind, in_flight), lost)
    micro_batches = int(ctx.engine.gradient_accumulation_steps())
    if ctx.rank in feeds:
        messages: dict[tuple[str, int], Any] = {}
        for holder, kind in feeds[ctx.rank]:
            for mb, parts in enumerate(recv_state(holder)):
                messages[(kind, mb)] = parts[0] if len(parts) == 1 else tuple(parts)
        group = frozenset(plan.replacements)
        stats = replay_passes(ctx.engine, messages, group, in_flight, keeper.batch_fn, keeper.seed)
        ctx.log(
            f"recomputed my {stats.micro_batch_passes} micro-batch passes of iteration {in_flight} in "
            f"{stats.wall_s:.2f} s, fed by ranks {[h for h, _ in feeds[ctx.rank]]} (their kept sends)"
        )
    else:
        grad_bytes = keeper.load_into(ctx.engine, in_flight)
        ctx.log(
            f"kept my passes of iteration {in_flight} ({grad_bytes / 1e6:.2f} MB of gradients"
            + (f"; {sent / 1e6:.2f} MB of kept sends to the lost ranks)" if sent else ")")
        )
    return {
        "partial": True,
        "in_flight": in_flight,
        "micro_batch_passes": micro_batches * len(plan.replacements),
        "micro_batch_passes_busiest": micro_batches,
    }
