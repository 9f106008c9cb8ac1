"""Global checkpoint reload: every rank loads the newest global checkpoint complete for all of them.

The fallback of every recovery: always able (with no checkpoint yet, training restarts from the
initial state), always exact, and the most expensive (every rank trains the iterations since the
checkpoint again). It says so loudly, with the reason the cheaper strategies could not be used.
"""

from __future__ import annotations

from ds_swift.checkpoint import tag_for
from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy, loud
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.replication import set_counters

__all__ = ["GlobalCheckpointStrategy"]


class GlobalCheckpointStrategy(RecoveryStrategy):
    """Every rank reloads the last global checkpoint (or the initial state, with none yet)."""

    name = "checkpoint"

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        # Every rank retrains from the checkpoint to the iteration in flight.
        return float(inputs.consensus + 1 - max(0, inputs.checkpoint_step))

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        step, ckpt = inputs.checkpoint_step, ctx.ckpt
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if step >= 0 and ckpt is not None:
            loud(ctx.rank, f"checkpoint fallback ({plan.reason}): loading {tag_for(step)} from {ckpt.ckpt_dir}")
            loaded = ckpt.load_latest(ctx.engine, at_most=step)
            outcome.checkpoint_step = loaded
            outcome.resume_iteration = int(loaded or 0)
        else:
            loud(
                ctx.rank,
                f"checkpoint fallback ({plan.reason}) but no complete global checkpoint exists yet: "
                "training restarts from the initial state (iteration 0)",
            )
            outcome.resume_iteration = 0
        set_counters(ctx.engine, outcome.resume_iteration)
        return outcome
