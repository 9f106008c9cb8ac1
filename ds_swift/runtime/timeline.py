"""The last recovery's timeline in a running worker: published by every rank once it is back at the
pre-failure iteration, gathered and written by rank 0 (the record itself: ds_swift.recovery.timeline)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from ds_swift.recovery.timeline import RankTimeline, collect_timeline

if TYPE_CHECKING:
    from ds_swift.recovery.base import RecoveryOutcome
    from ds_swift.runtime.context import SwiftContext

__all__ = ["PendingTimeline"]


class PendingTimeline:
    """The last recovery's timeline, from the rejoin until rank 0 wrote it.

    Every rank publishes its part once it is back at the pre-failure iteration; rank 0 then
    writes the job's timeline as soon as every part is there (without waiting for it in training).

    Args:
        ctx: the worker's distributed context (job store, rank, run directory).
    """

    def __init__(self, ctx: SwiftContext) -> None:
        self._ctx = ctx
        self._pending: tuple[RecoveryOutcome, RankTimeline, int] | None = None

    def start(self, outcome: RecoveryOutcome, tl: RankTimeline, generation: int) -> None:
        """The recovery into ``generation`` is done; training resumes."""
        self._pending = (outcome, tl, generation)

    def check_back(self, global_steps: int) -> None:
        """After every iteration: publish this rank's part once back at the pre-failure iteration."""
        if self._pending is None:
            return
        outcome, tl, generation = self._pending
        store = self._ctx.store
        assert store is not None
        back = outcome.back_iteration if outcome.back_iteration is not None else outcome.plan.pre_failure_iteration
        if tl.t_back is None and global_steps >= back:
            tl.t_back = time.time()
            store.publish(generation, "timeline", tl.rank, tl.to_json())
        if tl.t_back is not None:
            if dist.get_rank() != 0 or self._finish(block=False):
                self._pending = None

    def abandon(self) -> None:
        """A new failure before the last timeline was gathered: rank 0 writes what is there."""
        if self._pending is None:
            return
        env = self._ctx.env
        if env is not None and env.rank == 0:
            self._finish(block=False)
        self._pending = None

    def close(self) -> None:
        """The job ends: rank 0 waits (briefly) for the missing parts and writes the timeline."""
        env = self._ctx.env
        if self._pending is not None and env is not None and env.rank == 0:
            self._finish(block=True)

    def _finish(self, block: bool) -> bool:
        """Rank 0: write the timeline once every rank published its part. True when done with it."""
        assert self._pending is not None and self._ctx.store is not None and self._ctx.env is not None
        outcome, _, generation = self._pending
        env = self._ctx.env
        return collect_timeline(
            self._ctx.store,
            generation=generation,
            world_size=env.world_size,
            plan=outcome.plan,
            checkpoint_step=outcome.checkpoint_step,
            run_dir=self._ctx.run_dir,
            inject_specs=len([s for s in env.inject.split(";") if s.strip()]),
            replay=outcome.summary,
            deviation=outcome.deviation,
            block=block,
        )
