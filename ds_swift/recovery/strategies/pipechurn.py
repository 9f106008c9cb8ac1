"""PipeChurn's recovery as a strategy (``"strategy": "pipechurn"``): lost states decoded from the
erasure-coded chunks other machines hold in memory; no storage, no replay.

After every optimizer step each rank's state goes, as k data and r parity chunks, to k + r holders
on other machines (ds_swift.protect.buddy in erasure mode, ds_swift.recovery.state.erasure). After a
failure of at most r + 1 machines (its own among them) every lost rank still has at least k chunks
on survivors: the survivors keep their state (undoing to the agreed iteration), the chosen holders
send the lost ranks their chunks, each lost rank decodes and loads its state, and every rank
rebuilds its low-precision parameters (the data-parallel all-gather under ZeRO-1/bf16). Then, of
the iteration in flight, only what the failure lost is recomputed (below); where that cannot be
done, every rank trains it again, and the plan says why. Exact: bitwise the failure-free run. With
more machines lost at once (or chunks lagging more than one step) the registry falls back to the
global checkpoint, saying why.

*Partial recomputation* (section 3.5). The lost ranks' states are decoded at iteration ``c`` (the
consensus); the iteration in flight is ``c + 1``. Every survivor holds a copy of its part of ``c + 1`` as far as the failure let it run
(ds_swift.recovery.state.inflight; its :class:`~ds_swift.recovery.holdings.InflightHeld` in each report): the
micro-batches whose backward passes it finished, their sends and the gradients accumulated over
them. The redo (ds_swift.recovery.strategies.pipechurn_passes decides, pure): the survivors send
their neighbours the kept messages they need, each rank loads its kept gradients back and runs only
the passes it does not hold (ds_swift.recovery.replay.midway): a lost rank all of its own, fed live
or from its neighbours' copies; a survivor the micro-batches after its last finished backward
(forward passes whose backward had not run lost their graphs: redone, and counted); a survivor
that ran every pass nothing. Then every rank runs the gradient reductions and the step of ``c + 1``
live (the runtime, after the recovery).

Where a precondition fails, every rank trains ``c + 1`` again (the full retrain), and the plan's
reason (log and recovery timeline) says why: a survivor keeping no copy (partial recomputation
off), or a survivor that already stepped ``c + 1``. Both ways are exact: bitwise the failure-free run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ds_swift.recovery.base import BenchVariant, RankContext, RecoveryOutcome, RecoveryStrategy, loud
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import InflightHeld
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.erasure import erasure_target, join_chunks
from ds_swift.recovery.state.inflight import FinishIteration
from ds_swift.recovery.state.transfer import finish_restore, load_received, recv_state, send_state
from ds_swift.recovery.strategies.pipechurn_passes import kept_passes, rank_passes, redo_summary, transfers
from ds_swift.recovery.verify import check_published

if TYPE_CHECKING:
    from ds_swift.config import SwiftConfig

__all__ = ["PipeChurnStrategy"]


class PipeChurnStrategy(RecoveryStrategy):
    """Decode each lost rank's state from k surviving erasure-coded chunks; exact."""

    name = "pipechurn"
    auto = False  # the chunks exist only when the config names this strategy
    # The lost ranks' state comes from other machines' memory: modelled as a replication.
    SERVICES = StrategyServices(erasure_chunks=True, digests=True, sim_kind="replication")
    # ds-swift bench: without and with the partial recomputation of the iteration in flight, side by
    # side: recovery time and passes recomputed, for a kill at any --phase (in the middle of the
    # iteration the survivors keep the passes they finished)
    BENCH_VARIANTS = {
        "pipechurn_full": BenchVariant({"pipechurn": {"partial_recompute": False}}),
        "pipechurn_partial": BenchVariant({"pipechurn": {"partial_recompute": True}}),
    }

    def services(self, cfg: SwiftConfig) -> StrategyServices:
        """The chunks and digests; the copy of the iteration in flight where ``pipechurn.partial_recompute``."""
        return dataclasses.replace(self.SERVICES, inflight_copy=cfg.pipechurn.partial_recompute)

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        why = inputs.keep_blocker() or inputs.wrapper_blocker()
        if why is not None or not inputs.replacements:
            return why
        return erasure_target(inputs)[2] or None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.2  # k chunk transfers and a decode per lost rank

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        if not inputs.replacements:
            return inputs.plan(self.name, "no rank lost its state")
        target, sources, _ = erasure_target(inputs)
        assert target is not None  # can_restore said so
        where = "; ".join(f"rank {r} from {[f'{h}:{i}' for h, i in s]}" for r, s in sorted(sources.items()))
        reason = f"every lost rank's state is decoded from erasure-coded chunks of iteration {target} ({where})"
        if target < inputs.consensus:
            reason += f"; a chunk lags one step: survivors undo to iteration {target}"
        rebased = inputs.rebased(target)
        why = partial_blocker(rebased)
        reason += (
            f"; {partial_reason(rebased)}"
            if why is None
            else f"; FULL RETRAIN of iteration {target + 1} by every rank (no partial recomputation: {why})"
        )
        return rebased.plan(self.name, reason, donors={r: s[0][0] for r, s in sources.items()})

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        ctx.keep_state(plan)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if not plan.replacements:
            return outcome
        _, sources, _ = erasure_target(inputs.rebased(plan.consensus))
        holdings = ctx.kept.buddy if ctx.kept is not None else None
        # Holders send in lost-rank order, the lost ranks receive in holder order: no cycle.
        for lost in sorted(sources):
            for holder, index in sources[lost]:
                if holder != ctx.rank:
                    continue
                if holdings is None:
                    raise RuntimeError(
                        f"rank {ctx.rank} was chosen to send chunk {index} of rank {lost} but holds none"
                    )
                outcome.bytes_moved += send_state(holdings.state_of(lost, plan.consensus), lost)
        if ctx.rank in sources:
            chunks = [recv_state(holder) for holder, _ in sorted(sources[ctx.rank])]
            state = join_chunks(chunks)
            load_received(ctx.engine, state, plan.consensus + 1)
            size = sum(int(c["chunk"].numel()) for c in chunks)
            ctx.log(
                f"decoded my state of iteration {plan.consensus} from chunks "
                f"{[f'{h}:{i}' for h, i in sorted(sources[ctx.rank])]} ({size / 1e6:.2f} MB received)"
            )
        finish_restore(ctx.engine)  # every rank: the low-precision parameters from the masters
        if ctx.rank in sources and ctx.verify:
            outcome.verdict = check_published(ctx.store, ctx.rank, ctx.engine, plan.consensus, "the decoded state")
        _in_flight(plan, inputs.rebased(plan.consensus), ctx, outcome)
        return outcome


def _in_flight(plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext, outcome: RecoveryOutcome) -> None:
    """The iteration in flight: its lost passes recomputed (the runtime then finishes it live), or,
    where that cannot be done, trained again by every rank, said loudly."""
    outcome.back_iteration = plan.consensus + 2  # back once the in-flight iteration is done again
    why = partial_blocker(inputs)
    if why is None:
        outcome.summary = recompute_lost(plan, inputs, ctx)
        outcome.handed.put(FinishIteration(plan.consensus + 1))  # the runtime finishes it live
        return
    outcome.summary = retrain_summary(inputs, int(ctx.engine.gradient_accumulation_steps()), why)
    if ctx.rank == min(inputs.survivors, default=ctx.rank):
        loud(
            ctx.rank,
            f"pipechurn: no partial recomputation ({why}); every rank trains iteration {plan.consensus + 1} again",
        )


# ---------------------------------------------------------------- partial recomputation
def partial_blocker(inputs: RecoveryInputs) -> str | None:
    """Why the iteration in flight (``inputs.consensus + 1``) cannot be recomputed partially (None: it can)."""
    in_flight = inputs.consensus + 1
    if not inputs.replacements:
        return "no rank lost its state"
    if inputs.undo:
        return f"ranks {list(inputs.undo)} already stepped iteration {in_flight}"
    off = [r for r in inputs.survivors if InflightHeld.of(inputs.by_rank[r]).passes < 0]
    if off:
        return f"ranks {off} keep no copy of iteration {in_flight} (pipechurn.partial_recompute off)"
    return None


def partial_reason(inputs: RecoveryInputs) -> str:
    """The plan's words for a partial recomputation (which survivors redo passes of their own)."""
    in_flight = inputs.consensus + 1
    held = {r: InflightHeld.of(inputs.by_rank[r]) for r in inputs.survivors}
    # All of the iteration's micro-batches where a rank said how many (else the most any survivor ran):
    # survivors that all stopped half-way had not finished either.
    most = max((max(h.passes, h.micro_batches) for h in held.values() if h.iteration == in_flight), default=0)
    short = {r: h.passes if h.iteration == in_flight else 0 for r, h in held.items()}
    short = {r: n for r, n in short.items() if n < most}
    reason = f"of iteration {in_flight}, only the lost ranks' passes are recomputed"
    if short:
        reason += (
            f", and the passes survivors {sorted(short)} had not finished when the failure hit "
            f"(they hold {[short[r] for r in sorted(short)]} micro-batches' passes)"
        )
    return reason


def retrain_summary(inputs: RecoveryInputs, micro_batches: int, why: str) -> dict[str, Any]:
    """The work of the full retrain: every rank runs every pass of the iteration in flight again."""
    return {
        "partial": False,
        "why_full": why,
        "in_flight": inputs.consensus + 1,
        "micro_batch_passes": micro_batches * len(inputs.reports),
        "micro_batch_passes_busiest": micro_batches,
        "full_retrain_passes": micro_batches * len(inputs.reports),
    }


def _exchange(
    inputs: RecoveryInputs, ctx: RankContext, micro_batches: int
) -> tuple[dict[tuple[str, int], Any], int, list[int], list[int]]:
    """The kept messages each rank's neighbours need, sent before the redo. Returns what this rank
    was served (by kind and micro-batch), the bytes it sent, the ranks it sent to and got from."""
    from ds_swift.recovery.state.inflight import InflightKeeper
    from ds_swift.recovery.state.transfer import recv_state, send_state

    keeper, in_flight = ctx.lent.get(InflightKeeper), inputs.consensus + 1
    assert keeper is not None
    served: dict[tuple[str, int], Any] = {}
    sent, to, fed_by = 0, [], []
    for t in transfers(inputs, micro_batches):  # one order on every rank: no cycle of blocking sends
        if t.src == ctx.rank:
            sent += send_state(keeper.kept_messages(t.kind, in_flight, t.micro_batches), t.dst)
            to.append(t.dst)
        elif t.dst == ctx.rank:
            for k, parts in zip(t.micro_batches, recv_state(t.src)):
                served[(t.kind, k)] = parts[0] if len(parts) == 1 else tuple(parts)
            fed_by.append(t.src)
    return served, sent, to, fed_by


def recompute_lost(plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> dict[str, Any]:
    """Every rank: send the kept messages its neighbours need, load its kept gradients, redo the
    passes it does not hold. Returns the work done (the same on every rank)."""
    from ds_swift.recovery.replay.midway import redo_passes
    from ds_swift.recovery.state.inflight import InflightKeeper

    in_flight = plan.consensus + 1
    keeper = ctx.lent.get(InflightKeeper)  # the runtime's copy of the iteration in flight
    if keeper is None:
        raise RuntimeError(f"rank {ctx.rank}: partial recomputation planned, but this rank keeps no in-flight copy")
    m = int(ctx.engine.gradient_accumulation_steps())
    mine = rank_passes(inputs, ctx.rank, m, kept_passes(inputs, m))
    served, sent, to, fed_by = _exchange(inputs, ctx, m)
    to_lost = "the lost ranks" if set(to) <= set(plan.replacements) else f"ranks {sorted(set(to))}"
    sends = f"; {sent / 1e6:.2f} MB of kept sends to {to_lost}" if sent else ""
    if mine.kept == m:
        grad_bytes = keeper.load_into(ctx.engine, in_flight)
        ctx.log(f"kept my passes of iteration {in_flight} ({grad_bytes / 1e6:.2f} MB of gradients{sends})")
    else:
        kept_loss = keeper.loss if mine.kept else None
        load = (lambda eng: keeper.load_into(eng, in_flight)) if mine.kept else None  # noqa: E731
        if keeper.reseed is not None:
            keeper.reseed(False)  # the redo keys each forward by the micro-batch it runs
        keeper.paused = True  # the redo's passes and sends are not the iteration's own
        try:
            stats = redo_passes(ctx.engine, mine, served, in_flight, keeper.batch_fn, keeper.seed, load, kept_loss)
        finally:
            keeper.paused = False
            if keeper.reseed is not None:
                keeper.reseed(True)
        held = f" (kept {mine.kept}{sends})" if mine.kept or sends else ""
        fed = f", fed by ranks {sorted(set(fed_by))} (their kept sends)" if fed_by else ", fed live"
        ctx.log(
            f"recomputed my {stats.passes} micro-batch passes of iteration {in_flight} in {stats.wall_s:.2f} s"
            f"{held}{fed}"
        )
    keeper.restart()  # what it held is spent: a failure from here on redoes the iteration in full
    return redo_summary(inputs, m)
