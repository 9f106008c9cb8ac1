"""Replay one iteration's forward and backward passes only, fed from messages held in memory.

PipeChurn's partial recomputation (ds_swift.recovery.strategies.pipechurn_partial): a lost rank
runs its part of the iteration in flight again, with its receives from surviving neighbours served
from the copies they kept of what they sent (ds_swift.recovery.state.inflight) instead of the
message log, and its sends to them dropped (they have what it sent before the failure). The
message-log replay's machinery does the rest (:class:`~ds_swift.recovery.replay.serve.Replayer`:
the tensor-meta handshake, shape checks, the sends' metadata state). Unlike a log replay the
iteration stops before its gradient reductions and step: every rank, survivors included, runs
those live afterwards (ds_swift.recovery.state.inflight.finish_iteration).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from ds_swift.data.keyed import BatchFn
from ds_swift.patches import deepspeed_engine
from ds_swift.patches.instructions import hook_instructions, schedule
from ds_swift.patches.step_collectives import wrap_collectives
from ds_swift.recovery.replay.collectives import CollectiveGuard
from ds_swift.recovery.replay.engine import _run_iteration, keyed_rng
from ds_swift.recovery.replay.log import Message
from ds_swift.recovery.replay.plan import ReplayStats, plan_of, unwrap_engine
from ds_swift.recovery.replay.serve import Replayer

__all__ = ["replay_passes"]

#: the end of the train schedule, left to the live step that follows
_LIVE = (schedule.ReduceTiedGrads, schedule.ReduceGrads, schedule.OptimizerStep)


def _skip(eng: Any, call_next: Callable[..., Any], **kw: Any) -> None:
    return None  # deliberately not called: the reductions and the step run live, with every rank


def replay_passes(
    engine: Any,
    messages: Mapping[tuple[str, int], Message],
    group_ranks: frozenset[int],
    iteration: int,
    batch_fn: BatchFn,
    seed: int | None,
) -> ReplayStats:
    """Run this rank's forward and backward passes of ``iteration`` again (not the step).

    Args:
        engine: this rank's DeepSpeed PipelineEngine, standing at ``iteration`` (its state after the
            step of ``iteration - 1``).
        messages: ``(kind, micro_batch) -> message`` received from a neighbour outside
            ``group_ranks`` ("act" from the previous stage, "grad" from the next), as it sent them.
        group_ranks: the ranks replaying together (the lost ones); edges between them stay live.
        iteration: the iteration in flight.
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training.
        seed: reseed each forward from (seed, iteration, micro-batch, stage); None: a hook already does.

    Raises:
        LogUnavailable: a message is missing or of another shape than the stage receives.
    """
    engine = unwrap_engine(engine)
    if int(engine.global_steps) != iteration:
        raise ValueError(f"replay of iteration {iteration}'s passes, but the engine is at {engine.global_steps}")
    plan = plan_of(engine, group_ranks)
    stats = ReplayStats(plan.rank, iteration, iteration)
    guard = CollectiveGuard(group_ranks, None)  # no collective may reach a survivor meanwhile
    replayer = Replayer(plan, stats, guard)
    handles: list[Any] = []
    t0 = time.perf_counter()
    deepspeed_engine.prepare_replay(engine, iteration)
    try:
        if seed is not None:
            handles.append(keyed_rng(engine, seed))
        handles.append(hook_instructions(engine, "ds_swift.replay", replayer.hooks()))
        handles.append(hook_instructions(engine, "ds_swift.replay.passes", dict.fromkeys(_LIVE, _skip)))
        with wrap_collectives("ds_swift.replay", guard.make):
            replayer.begin(iteration, dict(messages))
            _run_iteration(engine, batch_fn, plan, iteration)
            replayer.end()
    finally:
        while handles:
            handles.pop().remove()
        if plan.prev_rank is not None and plan.prev_rank not in group_ranks:
            engine.pipe_recv_buf = None  # the next activation comes from a survivor's rebuilt engine, meta first
    stats.micro_batch_passes = len(plan.mine)
    stats.wall_s = time.perf_counter() - t0
    return stats
