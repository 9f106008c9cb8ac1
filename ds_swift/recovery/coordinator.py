"""The recovery protocol of one rank in the new generation (after the rendezvous and the rebuild).

Survivors and replacements run the same function with the same inputs, in this order:

1. publish a :class:`~ds_swift.recovery.consensus.RankReport` (naming the newest complete
   checkpoints it can load) in the job store; rank 0 gathers them once and hands every rank all of them (the
   agreement round of ds_swift.jobstore.agreement: O(N) store requests, no rank reads every rank's key);
2. agree on the consensus (:class:`~ds_swift.recovery.consensus.RecoveryInputs`) and ask the
   registered strategies (:mod:`ds_swift.recovery.registry`), cheapest first, which can restore
   the lost ranks: the same :class:`~ds_swift.recovery.consensus.RecoveryPlan` on every rank;
3. run the chosen strategy's restore on this rank (survivors keep their state, undoing to the
   consensus, except where the strategy rolls them back); a restore every rank agrees failed
   falls back to the global checkpoint, loudly, in this same generation;
4. verify: every restored rank checked its state against its reference digest
   (:mod:`ds_swift.recovery.verify`); a mismatch anywhere is such a failed restore, naming the tensor;
5. one round says 3 and 4 of every rank: nobody starts training before every rank holds its state
   (after a fallback, a last round once every rank reloaded).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.checkpoint.periodic import CheckpointManager, Origin
from ds_swift.jobstore.agreement import agree, pack, round_prefix, unpack
from ds_swift.jobstore.membership import GenerationFailed, JobStore
from ds_swift.recovery.base import (
    MembershipChange,
    RankContext,
    RecoveryOutcome,
    RecoveryStrategy,
    RestoreFailed,
    Rider,
    announce_deviation,
    loud,
)
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import Held
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.registry import STRATEGIES
from ds_swift.recovery.replay.runner import failed_replay_key
from ds_swift.recovery.state.digest import Verdict
from ds_swift.recovery.verify import (
    OWN_COPY,
    DigestSlots,
    check_published,
    forget_from,
    mismatch_reason,
)

__all__ = ["FallbackFailed", "LogPlan", "common_checkpoint", "optimizer_wrapper", "rank_report", "run_recovery"]

#: checkpoints a rank names in its report, its newest loadable ones: a survivor's own bound (its
#: last step + 1) is at most one iteration above the job's (survivors' last steps differ by at most
#: one), so two make the checkpoint round unneeded unless a rank sees newer checkpoints than any
#: survivor trained (an earlier run's, in the same directory)
REPORTED_CHECKPOINTS = 2
#: distinct restore errors named in the agreed reason (the rest are counted)
NAMED_ERRORS = 8


@dataclass(frozen=True)
class LogPlan:
    """The static side of logging-based recovery, from the topology plan (the same on every rank).

    Args:
        replayable_stages: stages whose inbound cross-group sends are logged (strategy "logging").
        machine_groups: the selective-logging groups of machines.
        update_stages: stages recovered by logging that log their updates instead (``logging.kinds``).
    """

    replayable_stages: Collection[int]
    machine_groups: Sequence[Sequence[int]]
    update_stages: Collection[int] = ()


def rank_report(
    engine: Any, kept: KeptState | None, machine: int, holdings: Mapping[str, Held] | None = None
) -> RankReport:
    """This rank's report for the consensus (``engine`` is the rebuilt one: its coordinates;
    ``holdings``: what its protections hold, by name, ds_swift.protect)."""
    grid = engine.grid
    tp = grid.get_slice_parallel_rank() if hasattr(grid, "get_slice_parallel_rank") else 0
    return RankReport(
        rank=dist.get_rank(),
        survivor=kept is not None,
        stage=int(engine.stage_id),
        dp=int(grid.get_data_parallel_id()),
        tp=int(tp),
        machine=int(machine),
        last_stepped=kept.last_stepped if kept is not None else -1,
        can_undo=kept is not None and kept.can_undo,
        holdings={name: held.to_doc() for name, held in (holdings or {}).items()},
    )


def optimizer_wrapper(engine: Any) -> str | None:
    """The DeepSpeed optimizer wrapper survivors cannot keep (see
    ds_swift.patches.deepspeed_optim_state: ZeRO 2/3, CPU offload), or None."""
    from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper, kind_of

    if engine.optimizer is None or isinstance(engine.optimizer, torch.optim.Optimizer):
        return None
    try:
        kind_of(engine.optimizer)
    except UnsupportedWrapper:
        return type(engine.optimizer).__name__
    return None


def run_recovery(
    ctx: RankContext,
    *,
    world_size: int,
    report: RankReport,
    strategy: str,
    zero_stage: int,
    optimizer_wrapper: str | None,
    logging: LogPlan | None = None,
    partitioned: bool = False,
    change: MembershipChange | None = None,
) -> RecoveryOutcome:
    """Run steps 1-5 above in ``ctx.generation`` (already joined; ``ctx.engine`` already rebuilt).

    Args:
        ctx: this rank's engine, store, kept state, checkpoints, timeline (``ctx.verify``: check
            restored state against reference digests; ``ctx.lent``: what the runtime kept for the
            strategies).
        world_size: the ranks of the generation.
        report: this rank's report for the consensus.
        strategy: the config's ``strategy`` (or the one the post-recovery guard forces).
        zero_stage: the ZeRO stage.
        optimizer_wrapper: a DeepSpeed optimizer wrapper survivors cannot keep, or None.
        logging: set where the topology plan logs pipeline sends (logging-based recovery possible).
        partitioned: each data-parallel rank holds only its slice of the optimizer state (ZeRO-1, bf16).
        change: the membership change the strategy made before this generation formed (an elastic
            shrink or grow): every rank restores through it instead (ds_swift.recovery.base).
    """
    if change is not None:
        return change.restore(ctx, zero_stage)
    reports, step = _gather(ctx, world_size, report)
    setup = None
    if logging is not None:
        setup = LoggingSetup(
            frozenset(logging.replayable_stages),
            tuple(tuple(g) for g in logging.machine_groups),
            step,
            ctx.store.get(failed_replay_key(max(0, step))),
            frozenset(logging.update_stages),
        )
    inputs = RecoveryInputs.agree(
        reports,
        checkpoint_step=step,
        logging=setup,
        forced=strategy,
        zero_stage=zero_stage,
        optimizer_wrapper=optimizer_wrapper,
        partitioned=partitioned,
    )
    plan, chosen = STRATEGIES.choose(inputs)
    ctx.timeline.t_consensus = time.time()
    if ctx.kept is not None and ctx.rank in plan.undo and not report.can_undo:
        loud(ctx.rank, f"cannot undo iteration {ctx.kept.last_stepped}: {ctx.kept.undo_blocker()}")
    outcome, plan = _restore(ctx, world_size, inputs, plan, chosen)
    _say_inexact_undo(ctx, inputs, plan, outcome)
    if ctx.verify:  # what is trained again is published again; a later replay must not meet the old digests
        forget_from(ctx.store, ctx.rank, outcome.resume_iteration, ctx.lent.get(DigestSlots))
    outcome.latest_checkpoint = step
    ctx.timeline.t_restored = time.time()
    ctx.timeline.bytes_moved = outcome.bytes_moved
    return outcome


def _gather(ctx: RankContext, world_size: int, report: RankReport) -> tuple[list[RankReport], int]:
    """Step 1: every rank's report, and the newest checkpoint complete for every rank (-1: none).
    One agreement round (ds_swift.jobstore.agreement): rank 0 reads the reports and hands every
    rank all of them in one verdict. Each report names the newest checkpoints its rank can load
    (:data:`REPORTED_CHECKPOINTS`), from which every rank finds the same checkpoint; only where a
    rank named none old enough, and may hold an older one, a second round asks every rank."""
    store, generation, timeout_s = ctx.store, ctx.generation, ctx.gather_timeout_s
    ranks = range(world_size)
    own_bound = report.last_stepped + 1 if report.survivor else None  # at least the job's bound
    mine = _loadable_checkpoints(store, ctx.ckpt, own_bound) if ctx.ckpt is not None else ()
    said = agree(
        store,
        round_prefix(generation, "report"),
        ctx.rank,
        dataclasses.replace(report, checkpoints=mine).to_json(),
        ranks,
        pack,
        timeout_s=timeout_s,
        generation=generation,
    )
    reports = [RankReport.from_json(v) for v in unpack(said).values()]
    # Never a checkpoint newer than what every survivor trained (one of an earlier run in the same
    # directory, say): at most consensus + 1 iterations done; and only this job's (or its origin).
    bound = checkpoint_bound(reports)
    step = common_checkpoint(reports, bound)
    if step is None:
        # Every rank must load the same tag: the newest one that is complete for all of them.
        latest = _loadable_checkpoint(store, ctx.ckpt, bound) if ctx.ckpt is not None else None
        step = int(agree(
            store, round_prefix(generation, "ckpt"), ctx.rank, str(latest if latest is not None else -1), ranks,
            lambda tags: str(min(int(v) for v in tags.values())), timeout_s=timeout_s, generation=generation,
        ))  # fmt: skip  # one agreement call on four lines (ruff would give each argument a line of its own)
    return reports, step


def common_checkpoint(reports: Sequence[RankReport], bound: int | None) -> int | None:
    """The newest checkpoint every rank can load with at most ``bound`` iterations done (-1: none),
    from the checkpoints the reports name (each rank's newest, at most :data:`REPORTED_CHECKPOINTS`,
    up to a bound of its own no lower than ``bound``); None where a rank named only newer ones and
    may hold an older one it did not name (a round then asks every rank)."""
    newest = []
    for r in reports:
        fit = [c for c in r.checkpoints if bound is None or c <= bound]
        if fit:
            newest.append(max(fit))
        elif len(r.checkpoints) >= REPORTED_CHECKPOINTS:
            return None
        else:
            newest.append(-1)  # it named every one it can load: none within the bound
    return min(newest, default=-1)


def _restore(
    ctx: RankContext, world_size: int, inputs: RecoveryInputs, plan: RecoveryPlan, chosen: RecoveryStrategy
) -> tuple[RecoveryOutcome, RecoveryPlan]:
    """Steps 3-5: the chosen strategy's restore, verified; any rank's failure or mismatch (agreed on
    every rank in one round, which also ends the recovery: every rank holds its state) falls back
    to the global checkpoint in this same generation, then a last round."""
    error: str | None = None
    verdict = None
    try:
        outcome = chosen.restore(plan, inputs, ctx)
        if ctx.verify:
            verdict = outcome.verdict = outcome.verdict or _own_copy_verdict(ctx, inputs, plan)
            _say_verdict(ctx, verdict)
    except RestoreFailed as failed:
        error = failed.reason
    except Exception as exc:  # noqa: BLE001 - any strategy error is agreed on below, then the safety net
        if isinstance(exc, GenerationFailed) or ctx.store.failure(ctx.generation) is not None:
            raise  # the generation failed meanwhile (a cascading failure): the next one recovers
        error = f"rank {ctx.rank}: strategy {plan.strategy!r} raised {type(exc).__name__}: {str(exc)[:200]}"
        loud(ctx.rank, error)
    reason = _agree_on_restores(
        ctx, world_size, error, verdict, None if error is not None else outcome.resume_iteration
    )
    if reason is not None:
        plan, chosen = STRATEGIES.fall_back(inputs, reason)
        outcome = _fall_back(ctx, world_size, inputs, plan, chosen)
    return outcome, plan


class FallbackFailed(RuntimeError):
    """The safety net itself failed on some rank: no rank can go on from a state it knows."""


def _fall_back(
    ctx: RankContext, world_size: int, inputs: RecoveryInputs, plan: RecoveryPlan, chosen: RecoveryStrategy
) -> RecoveryOutcome:
    """The fallback's restore, with an error round of its own. There is nothing under the safety net:
    a rank whose reload raised (no checkpoint loads on every rank, a checkpoint directory that cannot
    be read) cannot train, and its peers, whose reload worked, must not resume and wait for it in
    their first collective until a timeout calls it a stall. Every rank raises
    :class:`FallbackFailed` with the agreed reasons, recorded as the job's own error: its launcher
    ends the job with that line (a spare would load the same checkpoints and fail alike)."""
    from ds_swift.detect.classify import record_job_error

    error: str | None = None
    outcome: RecoveryOutcome | None = None
    try:
        outcome = chosen.restore(plan, inputs, ctx)
    except Exception as exc:  # noqa: BLE001 - agreed on below, then the job ends with it
        if isinstance(exc, GenerationFailed) or ctx.store.failure(ctx.generation) is not None:
            raise  # the generation failed meanwhile (a cascading failure): the next one recovers
        error = f"rank {ctx.rank}: the fallback {plan.strategy!r} raised {type(exc).__name__}: {str(exc)[:300]}"
        loud(ctx.rank, error)
    # Also the barrier after the reload: nobody trains before every rank reloaded (a round, not a gloo
    # barrier, whose pairs, connected lazily, would cost every rank log2(N) connections through the store).
    said = agree(
        ctx.store, round_prefix(ctx.generation, "fallback"), ctx.rank, error or "", range(world_size),
        lambda values: json.dumps(_distinct(values)), timeout_s=ctx.gather_timeout_s, generation=ctx.generation,
    )  # fmt: skip
    reason = "; ".join(json.loads(said))
    if not reason:
        assert outcome is not None
        return outcome
    failed = FallbackFailed(
        f"recovery of generation {ctx.generation - 1} failed: its fallback to the global checkpoint failed too "
        f"({reason}); no rank holds a state it can train on. Fix what the error names, then restart the job from "
        "a checkpoint you know is good"
    )
    record_job_error(ctx.store, ctx.generation, ctx.rank, failed)
    raise failed


def _agree_on_restores(
    ctx: RankContext, world_size: int, error: str | None, verdict: Verdict | None, resume: int | None
) -> str | None:
    """The round after every rank's restore: each says whether its restore raised (a strategy's bug,
    an op its peer abandoned) and its check of the state it restored; any error or mismatch makes
    every rank fall back to the global checkpoint together, loudly, naming it (a rank falling back
    alone would leave its peers waiting in the strategy's collectives). Returns the reason, or None
    when every restore worked: then every rank holds its state, and training may resume. What the
    runtime lent to ride the round (:class:`~ds_swift.recovery.base.Rider`, for ``resume``) is
    decided in it too."""
    rider = ctx.lent.get(Rider)
    if rider is not None and rider.generation != ctx.generation:
        rider = None
    mine = json.dumps(
        {
            "error": error or "",
            "verdict": verdict.to_json() if verdict is not None else None,
            "rider": rider.value(resume) if rider is not None and resume is not None else "",
        }
    )
    said = json.loads(
        agree(
            ctx.store,
            round_prefix(ctx.generation, "restore"),
            ctx.rank,
            mine,
            range(world_size),
            lambda values: _restores(values, rider),
            timeout_s=ctx.gather_timeout_s,
            generation=ctx.generation,
        )
    )
    errors = "; ".join(said["errors"])
    reason = errors or mismatch_reason({int(r): Verdict.from_json(v) for r, v in said["mismatches"].items()})
    if reason and ctx.rank == 0:  # agreed, the same on every rank: said once (each fallback line names it again)
        # a mismatch's reason says what failed ("restored state failed verification: ...") itself
        loud(
            ctx.rank,
            f"{f'restore failed ({errors})' if errors else reason}: ALL RANKS FALL BACK TO THE GLOBAL CHECKPOINT",
        )
    if rider is not None and not reason:
        rider.said = said.get("rider")
    return reason or None


def _restores(values: Mapping[int, str], rider: Rider | None = None) -> str:
    """The restore round's verdict: the distinct errors, the lowest ranks' first (at most
    :data:`NAMED_ERRORS`, then how many more: a thousand ranks' errors in one key read by every rank
    would be a million copies), and the lowest ranks' mismatches; and the ``rider``'s decision."""
    said = {r: json.loads(v) for r, v in sorted(values.items())}
    errors = _distinct({r: a["error"] for r, a in said.items()})
    bad = {
        r: a["verdict"]
        for r, a in said.items()
        if a["verdict"] and Verdict.from_json(a["verdict"]).status == "mismatch"
    }
    out: dict[str, Any] = {"errors": errors, "mismatches": dict(list(bad.items())[:NAMED_ERRORS])}
    if rider is not None:
        out["rider"] = rider.decide({r: a.get("rider", "") for r, a in said.items()})
    return json.dumps(out)


def _distinct(errors: Mapping[int, str]) -> list[str]:
    """The distinct non-empty errors, the lowest ranks' first, at most :data:`NAMED_ERRORS` and then
    how many more (a thousand ranks' errors in one key read by every rank would be a million copies)."""
    out = list(dict.fromkeys(e for _, e in sorted(errors.items()) if e))
    if len(out) > NAMED_ERRORS:
        out = [*out[:NAMED_ERRORS], f"and {len(out) - NAMED_ERRORS} more ranks' errors"]
    return out


def _say_inexact_undo(ctx: RankContext, inputs: RecoveryInputs, plan: RecoveryPlan, outcome: RecoveryOutcome) -> None:
    """Survivors that undid by the inverse update (no own copy of the iteration before) resume from a
    state within 2 ulp of the failure-free run's, not on it: an approximate recovery, said aloud."""
    inexact = [r for r in plan.undo if not inputs.undoes_exactly(r, plan.consensus)]
    if not inexact:
        return
    what = (
        f"survivors {inexact} undid iteration {plan.consensus + 1} by update-undo's inverse update, which "
        "restores the state before it only to within 2 ulp (no own copy of it was held: buddy copies are off "
        "or not used by this strategy)"
    )
    announce_deviation(
        ctx, inputs, plan.strategy, outcome, f"{outcome.deviation}; {what}" if outcome.deviation else what
    )


def _own_copy_verdict(ctx: RankContext, inputs: RecoveryInputs, plan: RecoveryPlan) -> Verdict | None:
    """A survivor that went back a step by its own copy, checked against the digest it published of
    that iteration while it trained (where digests are published): a wrong copy (staged from
    buffers a later round refilled, say) would otherwise train on unnoticed."""
    rank = ctx.rank
    if rank not in plan.undo or rank in plan.replay_ranks or not inputs.undoes_exactly(rank, plan.consensus):
        return None
    verdict = check_published(ctx.store, rank, ctx.engine, plan.consensus, OWN_COPY)
    # No digest of that iteration: they are published only where a replay may happen, every
    # verify.digest_interval iterations; a survivor's own copy unchecked is not said aloud.
    return None if verdict.status == "unverified" else verdict


def _say_verdict(ctx: RankContext, verdict: Verdict | None) -> None:
    """Step 4 on this rank: its check of the state it restored, in its timeline and on its channel."""
    if verdict is None:
        return
    ctx.timeline.extra["verify"] = {"status": verdict.status, "detail": verdict.detail}
    line = f"restored state {verdict.status}: {verdict.detail}"
    if verdict.status == "unverified":
        loud(ctx.rank, line)  # training resumes on state nothing checked: said aloud
    else:
        ctx.log(line)


ORIGIN_KEY = "ckpt_origin"
"""Job-store key of the checkpoint the job started from (:class:`~ds_swift.checkpoint.periodic.Origin`)."""


def checkpoint_bound(reports: list[RankReport]) -> int | None:
    """The most iterations a checkpoint recovery loads may hold: consensus + 1, the iterations every
    survivor trained; None (any of this job's) when no rank survived."""
    stepped = [r.last_stepped for r in reports if r.survivor]
    return min(stepped) + 1 if stepped else None


def _loadable_checkpoint(store: JobStore, ckpt: CheckpointManager, at_most: int | None) -> int | None:
    if ckpt.origin is None:  # a replacement never ran the script's load: the origin is in the store
        raw = store.get(ORIGIN_KEY)
        ckpt.origin = Origin.from_json(raw) if raw else None
    found = ckpt.latest(at_most)
    return found[0] if found is not None else None


def _loadable_checkpoints(store: JobStore, ckpt: CheckpointManager, at_most: int | None) -> tuple[int, ...]:
    """The iterations of the newest :data:`REPORTED_CHECKPOINTS` checkpoints this rank can load
    with at most ``at_most`` iterations done, newest first."""
    found: list[int] = []
    while len(found) < REPORTED_CHECKPOINTS:
        done = _loadable_checkpoint(store, ckpt, at_most)
        if done is None:
            break
        found.append(done)
        at_most = done - 1
    return tuple(found)
