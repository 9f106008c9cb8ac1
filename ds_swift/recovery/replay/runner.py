"""Logging-based recovery in the runtime (SWIFT 5.1-5.3): one rank's part once the plan says "logging".

Every rank of the new generation calls :func:`run_logging_recovery` with the same plan, after the
coordinator restored the survivors' kept state (undo included). The *replayed group* is the failed
machines' logging groups (``plan.replay_ranks``): replacements, and survivors that share a logging
group with a failed machine (they roll back).

1. **Check round** (store topic ``replay_check``): survivors outside the group say whether their
   message log reached the store (flushed and uploaded before their teardown) and publish the
   optimizer-step collective results they recorded (:class:`CollectiveRecorder`); the group's ranks
   say whether they can replay (:func:`unsupported_reasons`) and whether the log holds a chunk for
   every inbound edge and iteration to replay (by name, nothing downloaded). Everyone reads every
   answer, so a "no" anywhere makes every rank return the same reason, and the coordinator reloads
   the global checkpoint everywhere (loudly) in this same generation.
2. **Replay**: the group's ranks load the global checkpoint (never a survivor outside the group) and
   re-execute its iterations up to the consensus from the log (:func:`replay`). With parallel
   recovery, survivors (helpers) replay a copy of each failed stage on half of the micro-batches
   (:mod:`ds_swift.recovery.replay.parallel`; every rank builds the copy engines, collectively).
3. **Wait on the store** (topic ``replayed``), never in a gloo collective: a replay may outlast the
   op timeout.

A replay that meets a missing or corrupt record (:class:`LogUnavailable`) or a collective it
cannot serve (:class:`ReplayUnsupported`) leaves its engine mid-iteration and its in-group peers
blocked in live receives. That rank records ``replay_failed/<checkpoint>`` in the job store (the
next plan reads it and reloads the checkpoint everywhere), says so loudly, declares the generation
failed, wakes its pipeline neighbours (poison + their receive check) and raises GenerationFailed.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ds_swift.data.keyed import BatchFn
from ds_swift.jobstore.membership import GenerationFailed, JobStore
from ds_swift.logs import say_here
from ds_swift.recovery.base import checkpoint_source
from ds_swift.recovery.base import loud as _loud
from ds_swift.recovery.consensus import RankReport, RecoveryPlan
from ds_swift.recovery.host import NullHost, RecoveryHost, replaying
from ds_swift.recovery.replay.check_round import check_round, records_for, settled_layout
from ds_swift.recovery.replay.collectives import CollectiveRecorder, ReplayUnsupported
from ds_swift.recovery.replay.engine import replay
from ds_swift.recovery.replay.log import LogUnavailable, ProgressFn, await_progressing, rich_progress, text_progress
from ds_swift.recovery.replay.parallel import (
    Mode,
    ParallelReplayLayout,
    build_copy_engine,
    compute_of_this_rank,
    parallel_helps,
    parallel_layout,
    parallel_replay,
    transfer_state,
)
from ds_swift.recovery.replay.plan import replay_summary, replay_totals
from ds_swift.recovery.timeline import RankTimeline

__all__ = [
    "ReplayRuntime",
    "compute_of_this_rank",
    "failed_replay_key",
    "load_start",
    "parallel_helps",
    "parallel_layout",
    "run_logging_recovery",
]


def _noop(*_: Any) -> None:
    return None


@dataclass
class ReplayRuntime:
    """What the runtime lends the logging-based recovery of one rank.

    Args:
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training.
        seed: the runtime's RNG seed (keyed per iteration, micro-batch and stage).
        storage: the message log's store URL (``logging.storage``).
        ds_config: the DeepSpeed config dict (parallel recovery builds copy engines from it).
        parallel: parallel recovery is on; ``mode`` is "exact" or "fast"; ``force_parallel``: used
            even where :func:`parallel_helps` says it cannot help.
        recorder: this rank's recorder of optimizer-step collectives (survivors publish its records).
        log_error: survivors: why their message log could not be flushed and uploaded, or None.
        host: the runtime's switches (reseeding, the receive check, neighbour wake-up, logging).
        cache_dir: where a remote store's log chunks are downloaded (default: a temporary directory).
        wait_timeout_s: the longest anyone waits for the replay to finish (a dead replayer is seen
            sooner, through the generation's failure flag).
        stall_timeout_s: the longest the replay may go without a replayer finishing an iteration
            (its first after twice this: the checkpoint load comes first) before a waiting rank
            ends the generation: a replayer that stopped without dying (a hung file system, a
            stopped process) is not seen by the failure flag, and nobody's watchdog runs meanwhile.
        published: where a replayer's progress goes besides its display (the job store, for the
            ranks waiting on it).
    """

    batch_fn: BatchFn
    seed: int
    storage: str
    ds_config: Mapping[str, Any]
    parallel: bool = False
    mode: Mode = "exact"
    force_parallel: bool = False
    recorder: CollectiveRecorder | None = None
    log_error: str | None = None
    host: RecoveryHost = field(default_factory=NullHost)
    cache_dir: str | None = None
    wait_timeout_s: float = 7 * 24 * 3600.0
    stall_timeout_s: float = 600.0
    progress: ProgressFn | None = field(default=None, repr=False)
    published: ProgressFn | None = field(default=None, repr=False)


def failed_replay_key(checkpoint_step: int) -> str:
    """The job-store key saying why replaying from ``checkpoint_step`` failed (read by the next plan)."""
    return f"replay_failed/{checkpoint_step}"


# ----------------------------------------------------------------------------- the protocol
def _open_reader(rt: ReplayRuntime) -> tuple[Any, str | None]:
    from ds_swift.msglog import LogReader

    try:
        cache = rt.cache_dir or tempfile.mkdtemp(prefix="ds-swift-replay-")
        return LogReader(rt.storage, cache_dir=cache), None
    except Exception as exc:  # noqa: BLE001 - any failure to open the log is a reason to fall back
        return None, f"message log {rt.storage} cannot be opened: {type(exc).__name__}: {exc}"


@contextmanager
def _progress(rt: ReplayRuntime, total: int) -> Iterator[ProgressFn]:
    with _display(rt, total) as show:
        publish = rt.published or _noop

        def both(p: Any) -> None:
            show(p)
            publish(p)

        yield both


@contextmanager
def _display(rt: ReplayRuntime, total: int) -> Iterator[ProgressFn]:
    if rt.progress is not None:
        yield rt.progress
    elif sys.stderr.isatty():
        with rich_progress("ds-swift replay") as show:
            yield show
    else:
        yield text_progress(every=max(1, total // 10))


def _fail(
    store: JobStore, generation: int, rank: int, start: int, source: str, exc: BaseException, rt: ReplayRuntime
) -> NoReturn:
    what = f"{type(exc).__name__}: {exc}"
    store.set(failed_replay_key(start), f"rank {rank}: {what}"[:2000])
    _loud(
        rank,
        f"LOGGING-BASED RECOVERY FAILED: {what}. Generation {generation} is abandoned; in the next one ALL "
        f"RANKS FALL BACK TO THE GLOBAL CHECKPOINT ({source}) and train the lost iterations again.",
    )
    store.declare_failure(generation, f"rank {rank}: logging-based recovery failed: {what[:200]}")
    rt.host.poison_neighbours()
    raise GenerationFailed(generation, f"logging-based recovery failed on rank {rank}") from exc


def load_start(engine: Any, ckpt: Any, plan: RecoveryPlan, checkpoint_step: int) -> None:
    """The replaying ranks (``plan.replay_ranks``) load ``checkpoint_step`` (-1: the rebuilt engine's
    initial state); LogUnavailable where it cannot be loaded."""
    from ds_swift.patches.step_collectives import wrap_collectives
    from ds_swift.recovery.replay.collectives import CollectiveGuard
    from ds_swift.recovery.state.transfer import set_counters

    if checkpoint_step < 0 or ckpt is None:
        set_counters(engine, 0)  # the rebuilt engine is the initial state (model_fn seeds it)
        say_here("replay starts from the initial state (no global checkpoint yet)", name=__name__)
        return
    # Loading must not need the survivors: a collective leaving the group raises instead of hanging.
    with wrap_collectives("ds_swift.replay.load", CollectiveGuard(frozenset(plan.replay_ranks), None).make):
        loaded = ckpt.load_latest(engine, at_most=checkpoint_step)
    if loaded != checkpoint_step:
        raise LogUnavailable(f"global checkpoint global_step{checkpoint_step} could not be loaded (got {loaded})")
    set_counters(engine, checkpoint_step)
    say_here(f"loaded global_step{checkpoint_step} from {ckpt.ckpt_dir} for the replay", name=__name__)


def run_logging_recovery(
    *,
    store: JobStore,
    generation: int,
    rank: int,
    engine: Any,
    plan: RecoveryPlan,
    reports: list[RankReport],
    checkpoint_step: int,
    ckpt: Any,
    rt: ReplayRuntime,
    timeline: RankTimeline,
    gather_timeout_s: float,
    before_iteration: Callable[[int], None] | None = None,
) -> tuple[str | None, dict[str, Any]]:
    """Steps 1-3 above for this rank. Returns ``(None, summary)`` once every replayer is done, or
    ``(reason, {})`` when every rank must reload the global checkpoint instead (same on every rank).

    Args:
        engine: this rank's rebuilt DeepSpeed engine (survivors outside the group: with their kept state).
        plan: the logging plan (identical on every rank).
        reports: every rank's report (coordinates, survivor or not).
        checkpoint_step: the global checkpoint replayed from (-1: the initial state).
        ckpt: the CheckpointManager (replaying ranks load from it).
        before_iteration: a replaying rank: called before each iteration it replays (the digest check).
    """
    by_rank = {r.rank: r for r in reports}
    group = frozenset(plan.replay_ranks)
    world = sorted(by_rank)
    source = checkpoint_source(checkpoint_step)
    start, end = plan.replay_from, plan.consensus
    fail = functools.partial(_fail, store, generation, rank, start, source, rt=rt)

    # 1. the check round
    reader, reader_error = _open_reader(rt) if rank in group else (None, None)
    answers, proposed = check_round(
        store, generation, rank, engine, plan, reports, reader, reader_error, rt, gather_timeout_s
    )
    problems = [w for r in world for w in answers[r]["why"]]
    if problems:
        reason = "logging-based recovery impossible: " + "; ".join(problems)
        _loud(rank, f"{reason}: ALL RANKS FALL BACK TO THE GLOBAL CHECKPOINT ({source})")
        return reason, {}
    layout = settled_layout(proposed, answers, world, rank, rt)

    # 2. the replay
    role = layout.role(rank) if layout is not None else None
    replayer = rank in group or role is not None
    summary: dict[str, Any] = {}
    if rank in group:
        _load_start_or_fail(engine, ckpt, plan, checkpoint_step, fail)
        timeline.t_loaded = time.time()
        timeline.extra["checkpoint_loaded"] = checkpoint_step
    stage_dp = by_rank[layout.replacements[role[1]]].dp if layout is not None and role is not None else by_rank[rank].dp
    records = records_for(stage_dp, answers, by_rank) if replayer else None
    if replayer:
        rt = dataclasses.replace(
            rt, published=lambda p: store.publish(generation, "replay_progress", rank, str(p.iterations_done))
        )
    if replayer and reader is None:
        reader, reader_error = _open_reader(rt)
        if reader is None:
            fail(LogUnavailable(str(reader_error)))
    if layout is not None:
        summary = _run_parallel(
            engine, layout, reader, start, end, rt, records, replayer, rank in group, fail, before_iteration
        )
    elif rank in group:
        summary = _run_sequential(engine, reader, group, start, end, rt, records, fail, before_iteration)
    if replayer:
        timeline.t_replayed = time.time()
        timeline.extra["replay"] = summary
        store.publish(generation, "replayed", rank, json.dumps(summary))

    # 3. wait on the store, not in a collective
    return None, _await_replayers(store, generation, group, layout, by_rank, start, end, source, rt)


def _await_replayers(
    store: JobStore,
    generation: int,
    group: frozenset[int],
    layout: ParallelReplayLayout | None,
    by_rank: dict[int, RankReport],
    start: int,
    end: int,
    source: str,
    rt: ReplayRuntime,
) -> dict[str, Any]:
    """Step 3: every replayer's summary, read from the store (a replay may outlast a collective's
    timeout); returns the recovery's summary."""
    replayers = sorted(group | (set(layout.helpers) if layout is not None else set()))
    done = await_progressing(store, generation, replayers, rt.stall_timeout_s, rt.wait_timeout_s)
    per_rank = {r: json.loads(v) for r, v in done.items()}
    return {
        "machines": sorted({by_rank[r].machine for r in group}),
        "from": start,
        "to": end,
        "source": source,
        "ranks": replayers,
        "parallel": rt.mode if layout is not None else None,
        "iterations": end - start + 1,
        **replay_totals(per_rank),
    }


def _load_start_or_fail(
    engine: Any,
    ckpt: Any,
    plan: RecoveryPlan,
    checkpoint_step: int,
    fail: Callable[[BaseException], NoReturn],
) -> None:
    """A replaying rank loads where the replay starts; a failure to do so ends the generation (:func:`_fail`)."""
    try:
        load_start(engine, ckpt, plan, checkpoint_step)
    except (LogUnavailable, ReplayUnsupported) as exc:
        fail(exc)


def _run_sequential(
    engine: Any,
    reader: Any,
    group: frozenset[int],
    start: int,
    end: int,
    rt: ReplayRuntime,
    records: Any,
    fail: Callable[[BaseException], NoReturn],
    before_iteration: Callable[[int], None] | None,
) -> dict[str, Any]:
    """A rank of the replayed group replays its iterations from the log alone; returns its summary."""
    try:
        with replaying(rt.host), _progress(rt, end - start + 1) as progress:
            stats = replay(
                engine,
                reader,
                group,
                start,
                end,
                rt.batch_fn,
                progress,
                seed=rt.seed,
                collectives=records,
                before_iteration=before_iteration,
            )
    except (LogUnavailable, ReplayUnsupported) as exc:
        fail(exc)
    return replay_summary(stats)


def _run_parallel(
    engine: Any,
    layout: ParallelReplayLayout,
    reader: Any,
    start: int,
    end: int,
    rt: ReplayRuntime,
    records: Any,
    replayer: bool,
    in_group: bool,
    fail: Callable[..., Any],
    before_iteration: Callable[[int], None] | None,
) -> dict[str, Any]:
    """Parallel recovery on this rank: every rank builds the copy engines collectively, the state
    moves to the helpers, and the replayers replay their share. Returns this rank's summary."""
    summary: dict[str, Any] = {}
    resume = rt.host.suspend_logging() if in_group else _noop
    copy = build_copy_engine(engine, layout, rt.ds_config)  # every rank, collectively
    try:
        transfer_state(engine, copy, layout, start)
        if replayer:
            pstats = None
            try:
                with replaying(rt.host), _progress(rt, end - start + 1) as progress:
                    pstats = parallel_replay(
                        engine,
                        copy,
                        layout,
                        reader,
                        start,
                        end,
                        rt.batch_fn,
                        progress,
                        mode=rt.mode,
                        seed=rt.seed,
                        collectives=records,
                        before_iteration=before_iteration,
                    )
            except (LogUnavailable, ReplayUnsupported) as exc:
                fail(exc)
            if pstats is not None:
                summary = replay_summary(pstats)
    finally:
        copy = None  # a helper's copy of the failed stage goes now
        gc.collect()
        resume()
    return summary
