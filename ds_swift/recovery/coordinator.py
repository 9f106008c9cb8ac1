"""The recovery protocol of one rank in the new generation (after the rendezvous and the rebuild).

Survivors and replacements run the same function with the same inputs, in this order:

1. publish a :class:`~ds_swift.recovery.consensus.RankReport` in the job store and gather everyone's;
2. compute the (identical) :class:`~ds_swift.recovery.consensus.RecoveryPlan`;
3. replication: survivors ahead of the consensus undo their last step, every survivor loads the
   state it kept into its rebuilt engine, donors send their state to the replacements;
   logging: the same for the survivors outside the failed logging groups; the groups' ranks load
   the global checkpoint and replay the lost iterations from the message log
   (:mod:`ds_swift.recovery.logging_recovery`; when that is impossible every rank falls back to:)
   checkpoint: every rank loads the newest complete global checkpoint every rank can see (or,
   with none yet, starts again from the initial state);
4. a barrier, so nobody starts training before every rank holds its state.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.checkpoint import CheckpointManager, latest_complete, tag_for
from ds_swift.membership import JobStore
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryPlan, plan_recovery
from ds_swift.recovery.logging_recovery import ReplayRuntime, failed_replay_key, run_logging_recovery
from ds_swift.recovery.replication import capture_state, load_state, recv_state, send_state, set_counters
from ds_swift.timeline import RankTimeline

__all__ = ["KeptState", "LogPlan", "RecoveryOutcome", "optimizer_wrapper", "rank_report", "run_recovery"]


@dataclass
class KeptState:
    """What a survivor keeps in memory across the rebuild (references, not copies).

    The old engine (and with it every process group of the failed generation) is dropped; the
    module's tensors, the optimizer and the LR scheduler objects survive it because they hold no
    process group (ZeRO stage 0, fp32: the optimizer is the plain torch optimizer). For an undo
    the update-undo wrapper of that optimizer is kept too, detached from the engine (its step
    record and the resident gradient g_t in each parameter's ``.grad`` stay).
    """

    module: dict[str, torch.Tensor]
    optimizer: Any
    lr_scheduler: Any
    last_stepped: int
    undo: Any = None
    """``ds_swift.undo.InvertibleOptimizer`` able to undo the last step, or None."""

    @classmethod
    def capture(cls, engine: Any, undo_handle: Any) -> KeptState:
        """Take the references out of ``engine``; detaches ``undo_handle`` from it (see detach_undo)."""
        optimizer = engine.optimizer if isinstance(engine.optimizer, torch.optim.Optimizer) else None
        undo = None
        last = int(engine.global_steps) - 1
        if undo_handle is not None:
            stepped = undo_handle.last_stepped_iteration
            rec = getattr(undo_handle, "last_record", None)
            undo = detach_undo(undo_handle)
            if stepped is not None and rec is not None and rec.iteration == stepped and not rec.complete and not rec.groups:
                # The step transaction failed before updating any parameter (DeepSpeed's gradient
                # clipping all-reduces the norm inside _take_model_step): iteration ``stepped`` was
                # not applied, and the record left is of that empty step, not of ``last``.
                undo = None
            elif stepped is not None:
                last = int(stepped)
        return cls(
            module=engine.module.state_dict(),
            optimizer=optimizer,
            lr_scheduler=getattr(engine, "lr_scheduler", None),
            last_stepped=last,
            undo=undo if optimizer is not None else None,
        )

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    @property
    def can_undo(self) -> bool:
        return self.undo is not None and bool(getattr(self.undo, "can_undo", True))

    def undo_blocker(self) -> str | None:
        """Why this survivor cannot undo its last step (None if it can)."""
        if self.optimizer is None:
            return "its optimizer is not a plain torch optimizer (ZeRO/bf16 wrappers hold process groups)"
        if self.undo is None:
            return "no update-undo record of its last step"
        if self.can_undo:
            return None
        validate = getattr(self.undo, "_validate", None)
        try:
            if validate is not None:
                validate(self.undo.last_record)
        except Exception as exc:  # noqa: BLE001 - only its message is wanted
            return str(exc)
        return "the update-undo record cannot be undone"

    def undo_to(self, iteration: int) -> None:
        """Undo the last step so that ``iteration`` is the last one applied (one step back at most)."""
        if iteration >= self.last_stepped:
            return
        if self.undo is None or iteration != self.last_stepped - 1:
            raise RuntimeError(f"cannot undo from iteration {self.last_stepped} back to {iteration}")
        self.undo.undo()
        self.last_stepped = iteration
        self.undo = None

    def state(self) -> dict[str, Any]:
        """The kept state in the form :func:`load_state` takes (read after any undo)."""
        return {
            "module": self.module,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": {},
        }


def detach_undo(handle: Any) -> Any:
    """Release ``handle``'s engine and return its invertible optimizer, still able to undo.

    ``EngineUndoHandle.remove()`` would run the deferred ``zero_grad`` and drop the step's
    gradients: exactly what an undo after the rebuild needs. And the handle, through the
    methods it patched into the engine and the optimizer, keeps the engine (so its process
    groups, so their sockets) alive: peers blocked on this rank would then wait for the op
    timeout instead of failing at once. So: restore the patched methods without flushing,
    and keep only the ``InvertibleOptimizer`` (optimizer, LR scheduler, step record).
    """
    detach = getattr(handle, "detach", None)
    if callable(detach):
        return detach()
    handle._patch.remove()  # restores engine/optimizer attributes only; no flush, no release
    handle._deferred = []
    inv = handle.optimizer
    handle.engine = None
    return inv


@dataclass
class RecoveryOutcome:
    plan: RecoveryPlan
    resume_iteration: int
    checkpoint_step: int | None = None
    bytes_moved: int = 0
    notes: list[str] = field(default_factory=list)
    replay: dict[str, Any] | None = None
    """logging: what was replayed (see run_logging_recovery)."""
    latest_checkpoint: int = -1
    """The newest global checkpoint complete for every rank (iterations done; -1: none)."""


@dataclass(frozen=True)
class LogPlan:
    """The static side of logging-based recovery, from the topology plan (the same on every rank).

    Args:
        replayable_stages: stages whose inbound cross-group sends are logged (strategy "logging").
        machine_groups: the selective-logging groups of machines.
        runtime: what the runtime lends the replay (data, seed, hooks, this rank's records).
    """

    replayable_stages: Collection[int]
    machine_groups: Sequence[Sequence[int]]
    runtime: ReplayRuntime


def rank_report(engine: Any, kept: KeptState | None, machine: int) -> RankReport:
    """This rank's report for the consensus (``engine`` is the rebuilt one: its coordinates)."""
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
    )


def optimizer_wrapper(engine: Any) -> str | None:
    """The DeepSpeed optimizer wrapper survivors cannot keep (ZeRO-0 fp32 has none), or None."""
    if engine.optimizer is None or isinstance(engine.optimizer, torch.optim.Optimizer):
        return None
    if int(engine.zero_optimization_stage()) > 0:
        return None  # said more precisely by the ZeRO rule of the plan
    return type(engine.optimizer).__name__


def _loud(rank: int, msg: str) -> None:
    print(f"[ds-swift] rank {rank}: {msg}", file=sys.stderr, flush=True)


def run_recovery(
    *,
    store: JobStore,
    generation: int,
    rank: int,
    world_size: int,
    engine: Any,
    report: RankReport,
    kept: KeptState | None,
    strategy: str,
    zero_stage: int,
    optimizer_wrapper: str | None,
    ckpt: CheckpointManager | None,
    timeline: RankTimeline,
    gather_timeout_s: float,
    log: Callable[[str], None],
    logging: LogPlan | None = None,
) -> RecoveryOutcome:
    """Run steps 1-4 above in ``generation`` (already joined; ``engine`` already rebuilt).

    ``logging``: set where the topology plan logs pipeline sends (logging-based recovery possible).
    """
    latest = latest_complete(ckpt.ckpt_dir) if ckpt is not None else None
    store.publish(generation, "report", rank, report.to_json())
    store.publish(generation, "ckpt", rank, str(latest[0] if latest else -1))
    reports = [RankReport.from_json(v) for v in store.gather(generation, "report", range(world_size), gather_timeout_s).values()]
    ckpts = store.gather(generation, "ckpt", range(world_size), gather_timeout_s)
    # Every rank must load the same tag: the newest one that is complete for all of them.
    step = min(int(v) for v in ckpts.values())
    setup = None
    if logging is not None:
        setup = LoggingSetup(
            frozenset(logging.replayable_stages),
            tuple(tuple(g) for g in logging.machine_groups),
            step,
            store.get(failed_replay_key(max(0, step))),
        )
    plan = plan_recovery(reports, zero_stage=zero_stage, forced=strategy, optimizer=optimizer_wrapper, logging=setup)
    timeline.t_consensus = time.time()
    if kept is not None and rank in plan.undo and not report.can_undo:
        _loud(rank, f"cannot undo iteration {kept.last_stepped}: {kept.undo_blocker()}")
    outcome = RecoveryOutcome(plan, plan.consensus + 1)
    if plan.strategy in ("replication", "logging") and kept is not None and rank not in plan.replay_ranks:
        if rank in plan.undo:
            log(f"undo: last stepped iteration {kept.last_stepped} -> consensus {plan.consensus}")
            timeline.undone_from = kept.last_stepped
            kept.undo_to(plan.consensus)
            timeline.t_undone = time.time()
        load_state(engine, kept.state(), plan.consensus + 1)
    if plan.strategy == "logging":
        assert logging is not None
        fallback, outcome.replay = run_logging_recovery(
            store=store, generation=generation, rank=rank, engine=engine, plan=plan, reports=reports,
            checkpoint_step=step, ckpt=ckpt, rt=logging.runtime, timeline=timeline,
            gather_timeout_s=gather_timeout_s, log=log,
        )  # fmt: skip
        outcome.checkpoint_step = step if step >= 0 else None
        if fallback is not None:
            plan = dataclasses.replace(plan, strategy="checkpoint", reason=fallback, replay_ranks=())
            outcome = RecoveryOutcome(plan, plan.consensus + 1)
    if plan.strategy == "replication":
        for dst in plan.recipients_of(rank):
            sent = send_state(capture_state(engine), dst)
            outcome.bytes_moved += sent
            log(f"sent state of iteration {plan.consensus} to replacement rank {dst} ({sent / 1e6:.2f} MB)")
        donor = plan.donor_of(rank)
        if donor is not None:
            state = recv_state(donor)
            load_state(engine, state, plan.consensus + 1)
            log(f"received state of iteration {plan.consensus} from donor rank {donor}")
    elif plan.strategy == "checkpoint":
        if step >= 0 and ckpt is not None:
            _loud(rank, f"checkpoint fallback ({plan.reason}): loading {tag_for(step)} from {ckpt.ckpt_dir}")
            loaded = ckpt.load_latest(engine, at_most=step)
            outcome.checkpoint_step = loaded
            outcome.resume_iteration = int(loaded or 0)
        else:
            _loud(
                rank,
                f"checkpoint fallback ({plan.reason}) but no complete global checkpoint exists yet: "
                "training restarts from the initial state (iteration 0)",
            )
            set_counters(engine, 0)
            outcome.resume_iteration = 0
        set_counters(engine, outcome.resume_iteration)
    outcome.latest_checkpoint = step
    dist.barrier()
    timeline.t_restored = time.time()
    timeline.bytes_moved = outcome.bytes_moved
    return outcome
