"""Logging-based recovery: re-execute a failed group's lost iterations from the message log (SWIFT 5.1).

The replacement ranks of a failed logging group load the last global checkpoint (iteration
``start``) and call :func:`replay` to run iterations ``start..end`` of their stages' part of
DeepSpeed's ``TrainSchedule`` again, with the engine's own instruction handlers, so the ops and
their order are those of the failure-free run (bitwise identical on CPU). Per instruction:

- ``RecvActivation`` / ``RecvGrad`` from a rank outside the group: DeepSpeed's handler runs with
  ``p2p.recv`` served from the log record (iteration, micro-batch, edge); the first activation
  receive gets a synthesised tensor-meta message, exactly what ``_send_tensor_meta`` sent;
- ``SendActivation`` / ``SendGrad`` to a rank outside the group: the handler runs with
  ``p2p.send`` dropped (a message logger installed under it still re-logs the send: the failed
  machine's own log died with it);
- sends and receives inside the group stay live (p2p on the world group needs only the pair);
- the per-iteration loss broadcast to the whole pipe group (``_aggregate_total_loss``) is not
  run: :func:`replay` drives the schedule itself (``ds_swift.patches.deepspeed_engine``, where
  every engine internal it touches is pinned);
- collectives inside the group stay live; one of the optimizer step that reaches outside it (the
  gradient-clipping norm, DeepSpeed's default, reduces over every stage) takes the result a
  survivor recorded (:class:`CollectiveRecorder`); any other is refused up front
  (:func:`unsupported_reasons`) and, as a guard, at the call (it would wait forever on survivors).

The plan and its up-front checks are :mod:`~ds_swift.recovery.replay.plan`'s; the per-instruction
hooks :mod:`~ds_swift.recovery.replay.serve`'s; log chunks are read by a background thread ahead of
the replay (:mod:`~ds_swift.recovery.replay.log`); the step's collectives are recorded and
substituted by :mod:`~ds_swift.recovery.replay.collectives`. A missing or corrupt record raises
``LogUnavailable`` naming the file and record; the engine is then mid-iteration and must be
reloaded from the checkpoint (the runtime's loud fallback).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ds_swift.data.keyed import BatchFn, global_micro_batch, key_forward_rng, micro_batches
from ds_swift.patches import deepspeed_engine
from ds_swift.patches.instructions import hook_instructions, schedule
from ds_swift.patches.step_collectives import wrap_collectives
from ds_swift.recovery.replay.collectives import (
    CollectiveGuard,
    CollectiveRecord,
    CollectiveRecorder,
    ReplayUnsupported,
)
from ds_swift.recovery.replay.log import LogFeeder, ProgressFn, ReplayProgress
from ds_swift.recovery.replay.plan import ReplayPlan, ReplayStats, plan_of, unsupported_reasons, unwrap_engine
from ds_swift.recovery.replay.serve import Replayer

__all__ = ["keyed_rng", "replay"]


# ----------------------------------------------------------------------------- RNG keyed by position
def keyed_rng(engine: Any, seed: int, share: Sequence[int] | None = None) -> Any:
    """Reseed torch before every forward pass from (seed, iteration, micro-batch, stage). Returns the handle.

    The same keying as the Swift runtime's forward hook (both call
    ds_swift.data.keyed.key_forward_rng), counted per iteration from ``engine.global_steps``, so
    a replayed forward draws the same dropout masks.
    ``share``: the micro-batches the engine runs, in order (parallel recovery); default all.
    """
    engine = unwrap_engine(engine)
    state = {"iteration": -1, "micro": 0}

    def forward(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        it = int(eng.global_steps)
        if it != state["iteration"]:
            state["iteration"], state["micro"] = it, 0
        local = share[state["micro"]] if share else state["micro"]
        state["micro"] += 1
        key_forward_rng(eng, seed, local)
        return call_next(**kw)

    return hook_instructions(engine, "ds_swift.keyed_rng", {schedule.ForwardPass: forward})


# ----------------------------------------------------------------------------- replay
def _run_iteration(engine: Any, batch_fn: BatchFn, plan: ReplayPlan, iteration: int) -> None:
    """``train_batch`` without the loss broadcast to the whole pipe group (over this rank's share)."""
    data: Any = None
    if engine.is_first_stage() or engine.is_last_stage():
        if plan.share:
            gas = plan.micro_batches
            data = (batch_fn(iteration, global_micro_batch(plan.dp_rank, gas, m)) for m in plan.share)
        else:
            data = micro_batches(batch_fn, iteration, plan.dp_rank, plan.micro_batches)
    deepspeed_engine.run_train_schedule(engine, data, len(plan.mine))


def _refuse_unless_replayable(
    engine: Any, plan: ReplayPlan, group: frozenset[int], recorded: bool, start_iteration: int
) -> None:
    """Raise before anything runs when this rank cannot replay ``plan`` from ``start_iteration``."""
    reasons = unsupported_reasons(engine, group, step_collectives_recorded=recorded)
    if plan.share and getattr(engine.module, "seed_layers", False):
        reasons.append("seed_layers=True seeds layers from a forward counter: a share of micro-batches breaks it")
    if reasons:
        raise ReplayUnsupported("; ".join(reasons))
    if int(engine.global_steps) != start_iteration:
        raise ValueError(
            f"replay from iteration {start_iteration}, but the engine is at global_steps={engine.global_steps}: "
            "load the global checkpoint of that iteration first"
        )
    if not torch.is_grad_enabled():
        raise RuntimeError("replay() requires gradients enabled")


def _count_iteration(engine: Any, stats: ReplayStats, it: int, seconds: float) -> None:
    if int(engine.global_steps) != it + 1:
        raise RuntimeError(f"replay of iteration {it} left global_steps at {engine.global_steps}")
    loss = deepspeed_engine.iteration_loss(engine)
    if loss is not None:
        stats.losses[it] = loss
    stats.iterations += 1
    stats.iteration_s.append(seconds)


def _count_log(feeder: LogFeeder, stats: ReplayStats) -> None:
    stats.log_bytes_read = feeder.bytes_read
    stats.chunk_bytes = feeder.chunk_bytes
    stats.chunks_loaded = feeder.chunks_loaded
    stats.log_wait_s = feeder.wait_s


def _reporter(
    progress: ProgressFn | None,
    plan: ReplayPlan,
    stats: ReplayStats,
    total: int,
    feeder: LogFeeder | None,
    t0: float,
) -> Callable[[int], None]:
    """``report(next_iteration)``: a :class:`ReplayProgress` to ``progress``, if any."""

    def report(next_iteration: int) -> None:
        if progress is not None:
            progress(
                ReplayProgress(
                    plan.rank,
                    stats.iterations,
                    total,
                    next_iteration,
                    feeder.bytes_read if feeder else 0,
                    feeder.chunks_loaded if feeder else 0,
                    feeder.chunks_total if feeder else 0,
                    time.perf_counter() - t0,
                )
            )

    return report


def _finish(
    engine: Any,
    plan: ReplayPlan,
    group: frozenset[int],
    feeder: LogFeeder | None,
    guard: CollectiveGuard,
    stats: ReplayStats,
) -> None:
    """Close the log feeder and fill in the stats; leave the edge into the group ready for a survivor."""
    if feeder is not None:
        feeder.close()
        _count_log(feeder, stats)
    stats.collectives_substituted = guard.substituted
    if plan.prev_rank is not None and plan.prev_rank not in group:
        # The next activation comes from a survivor's rebuilt engine, metadata first.
        deepspeed_engine.expect_meta_next(engine)


def _replay_iteration(
    engine: Any,
    batch_fn: BatchFn,
    plan: ReplayPlan,
    replayer: Replayer,
    feeder: LogFeeder | None,
    stats: ReplayStats,
    it: int,
    before_iteration: Callable[[int], None] | None,
) -> None:
    t_it = time.perf_counter()
    if before_iteration is not None:
        before_iteration(it)
    replayer.begin(it, feeder.take(it) if feeder is not None else {})
    _run_iteration(engine, batch_fn, plan, it)
    replayer.end()
    stats.micro_batch_passes += len(plan.mine)  # this rank's share (parallel recovery) or every micro-batch
    _count_iteration(engine, stats, it, time.perf_counter() - t_it)


@contextlib.contextmanager
def _hooks_installed(
    engine: Any, plan: ReplayPlan, replayer: Replayer, seed: int | None, extra: Mapping[type, Callable[..., Any]] | None
) -> Iterator[None]:
    """The instruction hooks of one replay, installed for its duration (innermost removed first)."""
    with contextlib.ExitStack() as stack:
        if seed is not None:
            stack.enter_context(keyed_rng(engine, seed, plan.share or None))
        stack.enter_context(hook_instructions(engine, "ds_swift.replay", replayer.hooks()))
        if extra:
            stack.enter_context(hook_instructions(engine, "ds_swift.replay.extra", extra))
        yield


def replay(
    engine: Any,
    reader: Any,
    group_ranks: set[int] | frozenset[int],
    start_iteration: int,
    end_iteration: int,
    batch_fn: BatchFn,
    progress: ProgressFn | None = None,
    *,
    seed: int | None = None,
    before_iteration: Callable[[int], None] | None = None,
    collectives: CollectiveRecorder | dict[tuple[int, int], CollectiveRecord] | None = None,
    ahead: int | None = None,
    log_timeout_s: float = 600.0,
    share: Sequence[int] | None = None,
    extra_hooks: Mapping[type, Callable[..., Any]] | None = None,
) -> ReplayStats:
    """Re-execute iterations ``start_iteration..end_iteration`` (inclusive) on this rank of the failed group.

    Every rank in ``group_ranks`` calls it at the same time; ranks outside it do not take part.
    On return the engine has stepped ``end_iteration`` (``global_steps == end_iteration + 1``) and
    its pipeline edges to ranks outside the group are in the state a freshly built neighbour expects.

    Args:
        engine: the DeepSpeed PipelineEngine (or SwiftPipelineEngine) of this rank, loaded from the
            global checkpoint of ``start_iteration`` (``global_steps == start_iteration``).
        reader: a ``ds_swift.msglog.LogReader`` over the logs of the group's inbound edges.
        group_ranks: the global ranks being replayed (the failed logging group's replacements).
        start_iteration, end_iteration: the iterations to replay, inclusive (``end < start``: nothing).
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training (ds_swift.data.keyed).
        progress: called with a :class:`ReplayProgress` at the start and after each iteration.
        seed: reseed before each forward from (seed, iteration, micro-batch, stage); None when a hook
            already installed on the engine does it (the Swift runtime's).
        before_iteration: called with the iteration number before it is replayed.
        collectives: the optimizer-step collective results a survivor of this pipeline replica
            recorded (:class:`CollectiveRecorder`); needed when the step reduces over the whole
            pipeline (gradient clipping, DeepSpeed's default; ZeRO; fp16/bf16).
        ahead: iterations of log records read in advance (default: one chunk span plus one).
        log_timeout_s: the longest wait for one iteration's records.
        share: replay only these micro-batches of each iteration (parallel recovery; see
            ds_swift.recovery.replay.parallel, which combines the shares' gradients before the step).
        extra_hooks: instruction hooks installed around the replay's own for its duration.

    Raises:
        ReplayUnsupported: before anything ran, when a collective would leave the group.
        LogUnavailable: a record is missing or corrupt; the engine must be reloaded from the checkpoint.
    """
    engine = unwrap_engine(engine)
    group = frozenset(int(r) for r in group_ranks)
    plan = plan_of(engine, group, share)
    records = collectives.records if isinstance(collectives, CollectiveRecorder) else collectives
    _refuse_unless_replayable(engine, plan, group, records is not None, start_iteration)
    stats = ReplayStats(plan.rank, start_iteration, end_iteration)
    total = max(0, end_iteration - start_iteration + 1)
    if total == 0:
        return stats
    deepspeed_engine.prepare_replay(engine, start_iteration)
    feeder = (
        LogFeeder(reader, plan.from_log, start_iteration, end_iteration, plan.mine, ahead, log_timeout_s)
        if plan.from_log
        else None
    )
    guard = CollectiveGuard(group, records)
    t0 = time.perf_counter()
    replayer = Replayer(plan, stats, guard)
    report = _reporter(progress, plan, stats, total, feeder, t0)
    try:
        with (
            _hooks_installed(engine, plan, replayer, seed, extra_hooks),
            wrap_collectives("ds_swift.replay", guard.make),
        ):
            report(start_iteration)
            for it in range(start_iteration, end_iteration + 1):
                _replay_iteration(engine, batch_fn, plan, replayer, feeder, stats, it, before_iteration)
                report(it + 1)
    finally:
        _finish(engine, plan, group, feeder, guard, stats)
        stats.wall_s = time.perf_counter() - t0
    return stats
