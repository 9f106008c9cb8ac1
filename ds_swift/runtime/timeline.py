"""The last recovery's timeline in a running worker: published by every rank once it is back at the
pre-failure iteration, gathered and written by rank 0 (the record itself: ds_swift.recovery.timeline)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ds_swift.jobstore.membership import GenerationFailed, JobStore
from ds_swift.logs import say_here
from ds_swift.recovery import registry
from ds_swift.recovery.consensus import RecoveryPlan
from ds_swift.recovery.timeline import RankTimeline, Timeline, build_timeline, kill_time, write_timeline

if TYPE_CHECKING:
    from ds_swift.recovery.base import RecoveryOutcome
    from ds_swift.runtime.context import SwiftContext

__all__ = ["PendingTimeline", "collect_timeline", "summary_line"]


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


def _verification(tl: Timeline) -> str:
    by_status: dict[str, list[int]] = {}
    for rank, status in tl.verification.items():
        by_status.setdefault(status, []).append(int(rank))
    return "".join(f"; restored state {status} on ranks {sorted(ranks)}" for status, ranks in sorted(by_status.items()))


def _strategy_words(tl: Timeline) -> str:
    """What the strategy that recovered says its restore did (its ``summary_words``); nothing for a
    name the registry does not hold (a timeline of a strategy since renamed)."""
    strategies = registry.strategies()
    if tl.strategy not in strategies.names():
        return ""
    return strategies.get(tl.strategy).summary_words(tl.replay, tl.checkpoint_step)


def summary_line(tl: Timeline) -> str:
    what = tl.strategy
    words = _strategy_words(tl)
    if words:
        what += f" ({words})"
    if tl.deviation:
        what += f" (APPROXIMATE: {tl.deviation})"
    undo = f", undo on ranks {tl.undo_ranks}" if tl.undo_ranks else ""
    stall = any(r.detect_how.startswith("stall") for r in tl.ranks)  # its declarer's verdict (detect.classify)
    machine = (
        f"machine {tl.failed_machine}"
        if tl.failed_machine is not None
        else "a stall: no rank died, none replaced"
        if stall
        else "a failure"
    )
    kill = "kill" if tl.t_kill is not None else "detection"
    return (
        f"[ds-swift] recovery of generation {tl.failed_generation} ({machine}): {what}; consensus iteration "
        f"{tl.consensus}{undo}{_verification(tl)}{_engines(tl)}{_bandwidth(tl)}; initialization "
        f"{tl.initialization_s:.2f} s, recovery {tl.recovery_s:.2f} s, "
        f"total {tl.total_s:.2f} s ({kill} -> back at iteration {tl.pre_failure_iteration})"
    )


def _engines(tl: Timeline) -> str:
    """How many survivors kept their engine (their groups swapped: ds_swift.runtime.swap)."""
    survivors = [r for r in tl.ranks if r.role == "survivor"]
    kept = sum(1 for r in survivors if "engine_kept_s" in r.extra)
    return f"; {kept} of {len(survivors)} survivors kept their engine" if survivors else ""


def transfer_rate(ranks: list[dict[str, Any]]) -> tuple[int, float] | None:
    """The state the replacements received, in bytes, and the longest receive, in seconds (the ranks'
    ``extra["transfer"]``: ds_swift.recovery.state.transfer.hand_over); None where no rank timed one."""
    got = [
        t for r in ranks if isinstance(t := (r.get("extra") or {}).get("transfer"), dict) and t.get("received_bytes")
    ]
    if not got:
        return None
    return sum(int(t["received_bytes"]) for t in got), max(float(t["s"]) for t in got)


def _bandwidth(tl: Timeline) -> str:
    rate = transfer_rate([{"extra": r.extra} for r in tl.ranks])
    if rate is None:
        return ""
    nbytes, seconds = rate
    return f"; {nbytes / 1e6:.1f} MB restored at {nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s"


def collect_timeline(
    store: JobStore,
    *,
    generation: int,
    world_size: int,
    plan: RecoveryPlan,
    checkpoint_step: int | None,
    run_dir: str,
    replay: dict[str, Any] | None = None,
    deviation: str | None = None,
    inject_specs: int,
    block: bool,
) -> bool:
    """Gather every rank's part of the recovery into ``generation``, write it, print the summary.

    Returns False while parts are missing (``block=False``: try again later), True once written
    (or given up on: an incomplete timeline is reported, not waited on forever).
    """
    ranks = range(world_size)
    if not block and not store.kv.check([f"gen{generation}/timeline/{r}" for r in ranks]):
        return False
    try:
        parts = store.gather(generation, "timeline", ranks, timeout_s=10.0 if block else 1.0)
    except (TimeoutError, GenerationFailed) as exc:
        say_here(f"timeline of generation {generation - 1} incomplete: {exc}", name=__name__)
        return True
    failed = generation - 1
    detected = store.get(f"gen{failed}/t/detected")
    machine = store.get(f"gen{failed}/failed_machine")
    tl = build_timeline(
        [RankTimeline.from_json(v) for v in parts.values()],
        strategy=plan.strategy,
        reason=plan.reason,
        consensus=plan.consensus,
        t_kill=kill_time(store, failed, inject_specs),
        t_agent_detected=float(detected) if detected else None,
        failed_machine=int(machine) if machine else None,
        undo_ranks=list(plan.undo),
        donors=plan.donors,
        checkpoint_step=checkpoint_step,
        replay=replay,
        deviation=deviation,
    )
    path = write_timeline(run_dir, tl)
    print(summary_line(tl) + f" [{path}]", flush=True)
    return True
