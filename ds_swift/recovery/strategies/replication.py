"""Replication-based recovery: a surviving replica sends its whole training state to a replacement.

:class:`ReplicationStrategy` is the strategy (every lost rank needs a surviving data-parallel
replica on a machine that did not fail); the state transfer it runs is
ds_swift.recovery.state.transfer's (its wire format is documented there).

The state of a pipeline rank is its stage's module parameters and buffers, everything its
optimizer wrapper holds (torch optimizer, FP16_Optimizer/FP16_UnfusedOptimizer: fp32 masters,
optimizer state, loss scaler, flags; see ds_swift.patches.deepspeed_optim_state), the LR
scheduler, the step counters and the RNG state. A data-parallel replica of the same stage holds
bitwise the same (gradients are all-reduced before every step), so copying it gives the
replacement exactly what the lost rank had at the consensus iteration. Where the optimizer state
is partitioned over data-parallel ranks (ZeRO-1, BF16_Optimizer) a replica holds another slice:
ds_swift.recovery.strategies.buddy restores those.
"""

from __future__ import annotations

from typing import Any

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.digest import Verdict
from ds_swift.recovery.state.transfer import (
    capture_state,
    finish_restore,
    hand_over,
    load_state,
)
from ds_swift.recovery.verify import check_copy, check_received, publish_reference

__all__ = ["ReplicationStrategy", "donors_for"]


# ----------------------------------------------------------------------------- the strategy
def donors_for(inputs: RecoveryInputs) -> tuple[dict[int, int], list[int]]:
    """Each lost rank's donor, a survivor with its pipeline stage and tensor-parallel coordinate (a
    data-parallel replica) on a machine that did not fail; and the lost ranks without one."""
    by_rank = inputs.by_rank
    failed = inputs.failed_machines
    donors: dict[int, int] = {}
    missing: list[int] = []
    for lost in inputs.replacements:
        me = by_rank[lost]
        candidates = [
            s
            for s in inputs.survivors
            if by_rank[s].stage == me.stage and by_rank[s].tp == me.tp and by_rank[s].machine not in failed
        ]
        if candidates:
            # Spread the sends: prefer donors not yet serving another replacement.
            load = {s: sum(1 for d in donors.values() if d == s) for s in candidates}
            donors[lost] = min(candidates, key=lambda s: (load[s], s))
        else:
            missing.append(lost)
    return donors, missing


class ReplicationStrategy(RecoveryStrategy):
    """Survivors keep their state (undoing to the consensus); each lost rank receives the whole
    state of a surviving data-parallel replica. Exact: replicas hold bitwise the same state."""

    name = "replication"
    # Buddy copies: a replica under ZeRO-1 holds only its slice; digests check what a donor sends.
    SERVICES = StrategyServices(
        buddy_copies=True, digests=True, stage_recovery=frozenset({"replication"}), sim_kind="replication"
    )

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        why = inputs.keep_blocker()
        if why is not None or not inputs.replacements:
            return why
        why = inputs.unpartitioned_blocker()
        if why is not None:
            return why
        _, missing = donors_for(inputs)
        if missing:
            stages = sorted({inputs.by_rank[r].stage for r in missing})
            return f"no surviving data-parallel replica of stage(s) {stages} (ranks {missing})"
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.0  # one state copy per lost rank, nothing recomputed: cheaper than any replay

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        if not inputs.replacements:
            return inputs.plan(self.name, "no rank lost its state")
        donors, _ = donors_for(inputs)
        pairs = ", ".join(f"{d}->{r}" for r, d in sorted(donors.items()))
        return inputs.plan(self.name, f"every lost rank has a surviving replica ({pairs})", donors=donors)

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        ctx.keep_state(plan)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)

        def state_for(dst: int) -> Any:
            state = capture_state(ctx.engine)
            if ctx.verify:
                publish_reference(ctx, dst, state)
            return state

        def said(dst: int, sent: int) -> None:
            ctx.log(f"sent state of iteration {plan.consensus} to replacement rank {dst} ({sent / 1e6:.2f} MB)")

        donor = plan.donor_of(ctx.rank)
        received, outcome.bytes_moved = hand_over(
            plan.recipients_of(ctx.rank), state_for, donor, on_sent=said, timeline=ctx.timeline
        )
        if donor is not None:
            load_state(ctx.engine, received, plan.consensus + 1)
            ctx.log(f"received state of iteration {plan.consensus} from donor rank {donor}")
        finish_restore(ctx.engine)
        if donor is not None and ctx.verify:
            transported = check_received(ctx, donor, capture_state(ctx.engine), "the state")
            if donor in plan.undo and not inputs.undoes_exactly(donor, plan.consensus):
                # The donor went back by update-undo's inverse update (within 2 ulp, announced as an
                # approximate recovery): its state cannot equal the lost rank's own digest bitwise,
                # so only the transport is checked, and the verdict says why.
                outcome.verdict = Verdict(
                    transported.status,
                    f"{transported.detail}; not compared with rank {ctx.rank}'s own digest of iteration "
                    f"{plan.consensus}: donor rank {donor} undid its step by the inverse update (within 2 ulp), "
                    "so the copy is approximate",
                )
            else:
                outcome.verdict = check_copy(ctx, transported, plan.consensus, "the state received")
        return outcome
