"""Step 1 of the logging-based recovery (:mod:`ds_swift.recovery.replay.runner`): the check round.

Every rank says its answer in the agreement round ``replay_check`` (ds_swift.jobstore.agreement;
rank 0 reads them all, every rank reads what it needs of them: :func:`_needed`): a replaying rank
says why it cannot replay (nothing in its way, or the log lacks a chunk it needs),
a survivor outside the replayed group whether its message log reached the store, and its recorded
optimizer-step collectives (which the replayers then serve from, :func:`records_for`). With
parallel recovery the layout is proposed before the round and kept only where the ranks' measured
compute says it helps (:func:`settled_layout`).
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

from ds_swift.jobstore.agreement import agree, round_prefix
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say
from ds_swift.recovery.consensus import RankReport, RecoveryPlan
from ds_swift.recovery.replay.collectives import CollectiveRecord, CollectiveRecorder
from ds_swift.recovery.replay.log import LogUnavailable, chunks_needed
from ds_swift.recovery.replay.parallel import (
    ParallelReplayLayout,
    compute_of_this_rank,
    copy_unsupported_reasons,
    parallel_helps,
    parallel_layout,
)
from ds_swift.recovery.replay.plan import plan_of, unsupported_reasons

if TYPE_CHECKING:
    from ds_swift.recovery.replay.runner import ReplayRuntime

__all__ = ["check_round", "records_for", "settled_layout"]

Records = dict[tuple[int, int], CollectiveRecord]


def records_for(dp: int, answers: dict[int, dict[str, Any]], by_rank: dict[int, RankReport]) -> Records | None:
    """The step-collective records of the lowest surviving rank of replica ``dp`` that published some."""
    for r in sorted(answers):
        blob = answers[r].get("records")
        if blob and by_rank[r].dp == dp:
            return CollectiveRecorder.from_bytes(base64.b64decode(blob)).records
    return None


def _check(
    engine: Any, plan: RecoveryPlan, rank: int, recorded: bool, reader: Any, reader_error: str | None
) -> list[str]:
    """A replaying rank's answer in the check round: why it cannot replay (empty: it can)."""
    group = frozenset(plan.replay_ranks)
    reasons = unsupported_reasons(engine, group, step_collectives_recorded=recorded)
    edges = plan_of(engine, group).from_log
    if reasons or not edges:
        return reasons
    if reader is None:
        return [f"rank {rank}: {reader_error}"]
    try:
        chunks_needed(reader, edges, plan.replay_from, plan.consensus)
    except LogUnavailable as exc:
        return [f"rank {rank}: {exc}"]
    return []


def _check_answer(
    engine: Any,
    plan: RecoveryPlan,
    rank: int,
    in_group: bool,
    recorded: bool,
    reader: Any,
    reader_error: Any,
    rt: ReplayRuntime,
) -> dict[str, Any]:
    """This rank's answer in the check round: why the replay cannot run (empty: it can), and a
    survivor's step-collective records for the replayers."""
    answer: dict[str, Any] = {"why": [], "compute": compute_of_this_rank() if rt.parallel else {}}
    if in_group:
        answer["why"] = _check(engine, plan, rank, recorded, reader, reader_error)
        return answer
    if rt.log_error is not None:
        answer["why"] = [f"rank {rank}: its message log was not flushed to the store ({rt.log_error})"]
    if rt.recorder is not None:
        answer["records"] = base64.b64encode(rt.recorder.to_bytes()).decode()
    return answer


def check_round(
    store: JobStore,
    generation: int,
    rank: int,
    engine: Any,
    plan: RecoveryPlan,
    reports: list[RankReport],
    reader: Any,
    reader_error: str | None,
    rt: ReplayRuntime,
    gather_timeout_s: float,
) -> tuple[dict[int, dict[str, Any]], ParallelReplayLayout | str | None]:
    """Step 1: publish this rank's answer and read every rank's. Also returns the parallel-recovery
    layout (the same on every rank), a string saying why there is none, or None when it is off."""
    by_rank = {r.rank: r for r in reports}
    group = frozenset(plan.replay_ranks)
    outside = [r for r in plan.survivors if r not in group]
    recorded = any(by_rank[s].dp == by_rank[rank].dp for s in outside)
    answer = _check_answer(engine, plan, rank, rank in group, recorded, reader, reader_error, rt)
    layout: ParallelReplayLayout | str | None = None
    if rt.parallel and plan.consensus - plan.replay_from + 1 > 0:
        blockers = copy_unsupported_reasons(engine)
        gas = int(engine.gradient_accumulation_steps())
        layout = "; ".join(blockers) if blockers else parallel_layout(plan, reports, gas)
    world = sorted(by_rank)
    said = agree(
        store,
        round_prefix(generation, "replay_check"),
        rank,
        json.dumps(answer),
        world,
        lambda values: json.dumps(_needed({r: json.loads(v) for r, v in values.items()}, by_rank)),
        timeout_s=gather_timeout_s,
        generation=generation,
    )
    return {int(r): a for r, a in json.loads(said).items()}, layout


def _needed(answers: dict[int, dict[str, Any]], by_rank: dict[int, RankReport]) -> dict[int, dict[str, Any]]:
    """The check round's verdict: what every rank reads of the answers: each one that says why the
    replay cannot run, the step-collective records of the lowest rank of each replica that
    published some (:func:`records_for`), and the ranks' measured compute where parallel recovery
    weighs it (:func:`settled_layout`); not every survivor's records for every rank."""
    firsts: dict[int, int] = {}
    for r in sorted(answers):
        if answers[r].get("records") and by_rank[r].dp not in firsts:
            firsts[by_rank[r].dp] = r
    out = {}
    for r, a in answers.items():
        kept = {"why": a["why"]}
        if a.get("compute"):
            kept["compute"] = a["compute"]
        if firsts.get(by_rank[r].dp) == r:
            kept["records"] = a["records"]
        if kept["why"] or len(kept) > 1:
            out[r] = kept
    return out


def settled_layout(
    layout: ParallelReplayLayout | str | None,
    answers: dict[int, dict[str, Any]],
    world: list[int],
    rank: int,
    rt: ReplayRuntime,
) -> ParallelReplayLayout | None:
    """Parallel recovery only where the ranks' compute says it helps (or where it is forced); the
    lowest rank says why it is not used."""
    if isinstance(layout, ParallelReplayLayout):
        why_not = parallel_helps(layout, {r: answers.get(r, {}).get("compute") or {} for r in world})
        if why_not is not None and rt.force_parallel:
            if rank == min(world):
                say(
                    f"parallel recovery forced (parallel_recovery_force) although it cannot help: {why_not}",
                    rank,
                    name=__name__,
                )
        elif why_not is not None:
            layout = f"it cannot help here: {why_not}; parallel_recovery_force=true uses it anyway"
    if isinstance(layout, str):
        if rank == min(world):
            say(f"parallel recovery not used ({layout}): sequential replay", rank, name=__name__)
        layout = None
    return layout
