"""PipeChurn's recovery as a strategy (``"strategy": "pipechurn"``): lost states decoded from the
erasure-coded chunks other machines hold in memory; no storage, no replay.

After every optimizer step each rank's state goes, as k data and r parity chunks, to k + r holders
on other machines (ds_swift.runtime.buddy in erasure mode, ds_swift.recovery.state.erasure). After a
failure of at most r + 1 machines (its own among them) every lost rank still has at least k chunks
on survivors: the
survivors keep their state (undoing to the agreed iteration), the chosen holders send the lost
ranks their chunks, each lost rank decodes and loads its state, and every rank rebuilds its
low-precision parameters (the data-parallel all-gather under ZeRO-1/bf16). The iteration in flight
is then trained again by every rank: only what the failure lost is recomputed. Exact: bitwise the
lost rank's state after that iteration's step. With more machines lost at once (or chunks
lagging more than one step) the registry falls back to the global checkpoint, saying why.
"""

from __future__ import annotations

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.erasure import erasure_target, join_chunks
from ds_swift.recovery.state.transfer import finish_restore, load_received, recv_state, send_state
from ds_swift.recovery.verify import check_published

__all__ = ["PipeChurnStrategy"]


class PipeChurnStrategy(RecoveryStrategy):
    """Decode each lost rank's state from k surviving erasure-coded chunks; exact."""

    name = "pipechurn"
    auto = False  # the chunks exist only when the config names this strategy
    # The lost ranks' state comes from other machines' memory: modelled as a replication.
    SERVICES = StrategyServices(erasure_chunks=True, digests=True, sim_kind="replication")

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
        return inputs.rebased(target).plan(self.name, reason, donors={r: s[0][0] for r, s in sources.items()})

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
                    raise RuntimeError(f"rank {ctx.rank} was chosen to send chunk {index} of rank {lost} but holds none")
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
        return outcome
