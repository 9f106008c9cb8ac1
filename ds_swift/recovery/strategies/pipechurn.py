"""PipeChurn's recovery as a strategy (``"strategy": "pipechurn"``): lost states decoded from the
erasure-coded chunks other machines hold in memory; no storage, no replay.

After every optimizer step each rank's state goes, as k data and r parity chunks, to k + r holders
on other machines (ds_swift.protect.buddy in erasure mode, ds_swift.recovery.state.erasure). After a
failure of at most r + 1 machines (its own among them) every lost rank still has at least k chunks
on survivors: the
survivors keep their state (undoing to the agreed iteration), the chosen holders send the lost
ranks their chunks, each lost rank decodes and loads its state, and every rank rebuilds its
low-precision parameters (the data-parallel all-gather under ZeRO-1/bf16). Then, of the iteration
in flight, only what the failure lost is recomputed: the lost ranks replay their passes fed from
the sends their surviving neighbours kept, the survivors keep the passes they finished and redo
the rest (a failure in the middle of the iteration)
(ds_swift.recovery.strategies.pipechurn_partial); where that cannot be done, every rank trains it
again, and the plan says why. Exact: bitwise the failure-free run. With more machines lost at once
(or chunks lagging more than one step) the registry falls back to the global checkpoint, saying why.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ds_swift.recovery.base import BenchVariant, RankContext, RecoveryOutcome, RecoveryStrategy, loud
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.erasure import erasure_target, join_chunks
from ds_swift.recovery.state.inflight import FinishIteration
from ds_swift.recovery.state.transfer import finish_restore, load_received, recv_state, send_state
from ds_swift.recovery.strategies.pipechurn_partial import (
    partial_blocker,
    partial_reason,
    recompute_lost,
    retrain_summary,
)
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
