"""Nicolae et al.'s lossy forward recovery as a strategy (``"strategy": "lossy_forward"``).

shared/papers/nicolae-*.txt, section III-B: instead of replaying the failed mini-batch with every
replica's gradients, the survivors finish it averaging only their own. Here:

1. the state is restored the exact way (a surviving data-parallel replica's state, or the buddy
   copies of ZeRO-1 partitions; survivors undo to the consensus), so every rank of every replica,
   the replacements included, holds the consensus state;
2. the failed iteration is trained again with each casualty replica's gradients (a replica that lost
   a rank: its mini-batch share died with it) counted as zero and each survivor's scaled by
   ``dp / survivors`` (ds_swift.recovery.gradmask): the step applies the survivors' average;
3. from the next iteration on, every replica trains as before.

Approximate, and said so: the failed iteration's update leaves out the casualties' samples. With no
spare machine the paper's alternative, going on with fewer replicas (an elastic shrink), is strategy
``elastic`` (ds_swift.recovery.strategies.elastic, built on this one).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy, announce_deviation
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.gradmask import GradScale, lossy_factor
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.simulated_failure import SimulatedFailure
from ds_swift.recovery.strategies.buddy import BuddyStrategy
from ds_swift.recovery.strategies.replication import ReplicationStrategy

if TYPE_CHECKING:
    from ds_swift.config import SimulateConfig

__all__ = ["LossyForwardStrategy", "casualties"]


def casualties(inputs: RecoveryInputs) -> tuple[set[int], int]:
    """The data-parallel replicas that lost a rank, and the data-parallel size."""
    by_rank = inputs.by_rank
    return {by_rank[r].dp for r in inputs.replacements}, len({r.dp for r in inputs.reports})


class LossyForwardStrategy(RecoveryStrategy):
    """The exact restore (replication or buddy copies), then the failed iteration averaged over the
    surviving replicas' gradients only. Approximate."""

    name = "lossy_forward"
    exact = False
    auto = False  # approximate: only when the config names it
    # The exact restore it starts from (replication, buddy copies) and that restore's digests.
    SERVICES = StrategyServices(buddy_copies=True, digests=True, sim_kind="replication")

    def simulated_failure(self, cfg: SimulateConfig) -> SimulatedFailure:
        return LossySimulation(cfg)

    def __init__(self) -> None:
        self._restores: tuple[RecoveryStrategy, ...] = (ReplicationStrategy(), BuddyStrategy())

    def _restore_for(self, inputs: RecoveryInputs) -> tuple[RecoveryStrategy | None, str]:
        whys = []
        for s in self._restores:
            why = s.can_restore(inputs)
            if why is None:
                return s, ""
            whys.append(why)
        return None, "; ".join(dict.fromkeys(whys))

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        lost, dp = casualties(inputs)
        if lost and len(lost) >= dp:
            return f"every data-parallel replica ({dp}) lost a rank: no surviving replica to average over"
        return self._restore_for(inputs)[1] or None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.5  # the exact restore, and the failed iteration once more

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        restore, _ = self._restore_for(inputs)
        assert restore is not None  # can_restore said so
        plan = restore.plan(inputs)
        lost, dp = casualties(inputs)
        reason = plan.reason
        if lost:
            kept = sorted(set(range(dp)) - lost)
            reason += (
                f"; iteration {plan.consensus + 1} averages the gradients of data-parallel replicas {kept} only "
                f"(replicas {sorted(lost)} lost a rank: lossy forward, approximate)"
            )
        return dataclasses.replace(plan, strategy=self.name, reason=reason)

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        restore, _ = self._restore_for(inputs)
        assert restore is not None
        outcome = restore.restore(plan, inputs, ctx)
        lost, dp = casualties(inputs)
        if not lost:
            return outcome
        iteration = plan.consensus + 1
        outcome.handed.put(GradScale(iteration, lossy_factor(inputs.by_rank[ctx.rank].dp, lost, dp)))
        announce_deviation(
            ctx,
            inputs,
            self.name,
            outcome,
            (
                f"iteration {iteration} averaged the gradients of {dp - len(lost)} of {dp} data-parallel replicas "
                f"(replicas {sorted(lost)} lost a rank and count as zero)"
            ),
        )
        return outcome


class LossySimulation(SimulatedFailure):
    """The simulated iteration averages only the surviving replicas' gradients: the ``casualties``
    count as zero from ``upto_layer`` down (every layer by default), bit for bit what the strategy
    does after a real failure."""

    def grad_scale(self, engine: Any) -> GradScale | None:
        dp = int(engine.grid.get_data_parallel_world_size())
        lost = self.cfg.casualties or (dp - 1,)
        if max(lost) >= dp or len(set(lost)) >= dp:
            # A ValueError as the config's own errors are (recovery/ does not import the config).
            raise ValueError(
                f"swift config: simulate_failure.casualties={list(lost)} is invalid: data-parallel replica "
                f"indices below {dp}, leaving at least one survivor"
            )
        factor = lossy_factor(int(engine.grid.get_data_parallel_id()), lost, dp)
        self._log(
            f"simulated failure (lossy forward) at iteration {self.iteration}: replicas {list(lost)} "
            f"lost; my gradients x {factor:g}"
        )
        return GradScale(self.iteration, factor, self.cfg.upto_layer)
