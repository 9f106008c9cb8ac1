"""What a survivor keeps in memory across the in-process rebuild, and how it gets it back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ds_swift.logs import say
from ds_swift.patches.deepspeed_engine import pipe_topology
from ds_swift.patches.deepspeed_optim_state import (
    UnsupportedWrapper,
    capture_optimizer,
    is_partitioned,
    optimizer_payload,
)
from ds_swift.recovery.state.transfer import load_state, set_counters

if TYPE_CHECKING:
    from collections.abc import Callable

    from ds_swift.recovery.timeline import RankTimeline
    from ds_swift.undo.engine import EngineUndoHandle

__all__ = ["Grid", "KeptState", "grid_of"]

#: (stage, dp, tp) of every rank, accumulation steps, micro-batch, optimizer state partitioned
Grid = tuple[tuple[tuple[int, int, int], ...], int, int, bool]


@dataclass
class KeptState:
    """What a survivor keeps in memory across the rebuild (references, not copies).

    The old engine (and with it every process group of the failed generation) is dropped. What
    survives it holds no process group: the module's tensors, the LR scheduler, and of the
    optimizer wrapper (torch optimizer, BF16_Optimizer, FP16_Optimizer, ZeRO-1) the fp32 master
    tensors (this rank's partition), the inner torch optimizer that steps them, and copies of the
    loss scaler and flags, all taken without a collective
    (:func:`~ds_swift.patches.deepspeed_optim_state.capture_optimizer`). For an undo the
    update-undo wrapper of the inner optimizer is kept too, detached from the engine (its step
    record and the resident gradient g_t stay); undoing acts on the kept masters in place.
    """

    module: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    """What capture_optimizer took (None: the wrapper's state cannot be kept, see ``why_not``)."""
    lr_scheduler: Any
    last_stepped: int
    undo: Any = None
    """``ds_swift.undo.InvertibleOptimizer`` able to undo the last step, or None."""
    counters: dict[str, int] | None = None
    why_not: str | None = None
    """Why the optimizer state could not be kept (an unsupported wrapper), or None."""
    buddy: Any = None
    """The buddy copies of other ranks' partitions this rank holds, and its own copies of its last
    two steps (ds_swift.protect.buddy.BuddyHoldings)."""
    grid: Grid | None = None
    """The failed generation's grid (:func:`grid_of`), taken where the job may change its shape
    (a strategy whose services have ``elastic``): a membership change plans from it."""
    restored: dict[str, Any] | None = None
    """The own copy an undo took back (optimizer payload, LR scheduler, counters, buffers), loaded
    in place of the kept optimizer state; None: the kept state is loaded as it is."""
    gradients_back: Callable[[], bool] | None = None
    """Where the last step's gradients were overwritten since (the next backward pass), what gives
    them back to ``undo`` from a copy taken at the step (the update log's record: set by
    ds_swift.protect.update_logger.UpdateLogger.offer_gradients), called only by an undo."""

    @classmethod
    def capture(cls, engine: Any, undo_handle: EngineUndoHandle | None, *, engine_kept: bool = False) -> KeptState:
        """Take the references out of ``engine``; detaches ``undo_handle`` from it. ``engine_kept``:
        the survivor goes on with this very engine (its process groups swapped), whose gradient buffers
        are cleared before the recovery: the undo record gets its own copy of g_t first.

        ``EngineUndoHandle.remove()`` would run the deferred ``zero_grad`` and drop the step's
        gradients: exactly what an undo after the rebuild needs. And the handle, through the
        methods it patched into the engine and the optimizer, keeps the engine (so its process
        groups, so their sockets) alive: peers blocked on this rank would then wait for the op
        timeout instead of failing at once. ``detach()`` restores the patched methods without
        flushing and keeps only the ``InvertibleOptimizer`` (optimizer, LR scheduler, step record).
        """
        optimizer, why_not = None, None
        if engine.optimizer is not None:
            try:
                optimizer = capture_optimizer(engine.optimizer)
            except UnsupportedWrapper as exc:
                why_not = str(exc)
        undo = None
        last = int(engine.global_steps) - 1
        if undo_handle is not None:
            stepped = undo_handle.last_stepped_iteration
            rec = undo_handle.last_record
            undo = undo_handle.detach()
            if (
                stepped is not None
                and rec is not None
                and rec.iteration == stepped
                and not rec.complete
                and not rec.groups
            ):
                # The step transaction failed before updating any parameter (DeepSpeed's gradient
                # clipping all-reduces the norm inside _take_model_step): iteration ``stepped`` was
                # not applied, and the record left is of that empty step, not of ``last``.
                undo = None
            elif stepped is not None:
                last = int(stepped)
            if undo is not None and engine_kept:
                undo.own_gradients()
        return cls(
            module=engine.module.state_dict(),
            optimizer=optimizer,
            lr_scheduler=getattr(engine, "lr_scheduler", None),
            last_stepped=last,
            undo=undo if optimizer is not None else None,
            counters={"skipped_steps": int(getattr(engine, "skipped_steps", 0))},
            why_not=why_not,
        )

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    @property
    def can_undo(self) -> bool:
        if self.undo_exact:
            return True
        return self.undo is not None and (bool(getattr(self.undo, "can_undo", True)) or self.gradients_back is not None)

    @property
    def undo_exact(self) -> bool:
        """An undo of the last step would be bitwise: this rank holds its own copy of the iteration
        before it (the buddy copier's, ds_swift.protect.buddy), so it takes that back instead of
        computing the inverse update (exact only to 2 ulp)."""
        return (self.last_stepped - 1) in self.own_copies

    @property
    def own_copies(self) -> tuple[int, ...]:
        """The iterations this survivor can go back to bitwise (its own copies, below its last step)."""
        if self.optimizer is None or self.buddy is None:
            return ()
        return tuple(v for v in self.buddy.own_versions() if v < self.last_stepped)

    def undo_blocker(self) -> str | None:
        """Why this survivor cannot undo its last step (None if it can)."""
        if self.optimizer is None:
            return self.why_not or "it has no optimizer"
        if self.undo_exact:
            return None
        if self.undo is None:
            return "no update-undo record of its last step"
        if self.can_undo:
            return None
        # InvertibleOptimizer says why only through its (private) validation; that message is what
        # the operator needs to see, so read it there until it has a public "why not".
        validate = getattr(self.undo, "_validate", None)
        try:
            if validate is not None:
                validate(self.undo.last_record)
        except Exception as exc:  # noqa: BLE001 - only its message is wanted
            return str(exc)
        return "the update-undo record cannot be undone"

    def undo_to(self, iteration: int) -> str:
        """Go back so that ``iteration`` is the last step applied: bitwise from this rank's own copy
        of ``iteration`` where it holds one (any number of steps back: copies every
        ``buddy.interval`` iterations), else by update-undo's inverse update of the last step (one
        step back at most, within 2 ulp). Returns how ("own copy", "inverse update"; "" if nothing
        to undo)."""
        if iteration >= self.last_stepped:
            return ""
        own = self.buddy.own_state(iteration) if self.buddy is not None and self.optimizer is not None else None
        if own is not None:
            self.restored = own
            if self.counters is not None:
                self.counters["skipped_steps"] = int((own.get("counters") or {}).get("skipped_steps", 0))
            self.last_stepped = iteration
            self.undo = None
            return "own copy"
        if self.undo is None or iteration != self.last_stepped - 1:
            raise RuntimeError(f"cannot undo from iteration {self.last_stepped} back to {iteration}")
        if self.gradients_back is not None and not self.undo.can_undo and not self.gradients_back():
            raise RuntimeError(f"cannot undo iteration {self.last_stepped}: its gradients could not be given back")
        rec = self.undo.undo()
        self._restore_step_scalars(getattr(rec, "engine_state", None) or {})
        self.last_stepped = iteration
        self.undo = None
        return "inverse update"

    def undo_logged(self, consensus: int, timeline: RankTimeline) -> None:
        """:meth:`undo_to` ``consensus`` in a recovery: logged, and stamped on the rank's timeline."""
        last = self.last_stepped
        timeline.undone_from = last
        how = self.undo_to(consensus)
        say(f"undo: last stepped iteration {last} -> consensus {consensus} ({how})", timeline.rank, name=__name__)
        timeline.extra["undo"] = how
        timeline.t_undone = time.time()

    def rewind_schedule(self, iteration: int) -> bool:
        """Put the LR scheduler and the step scalars (loss scaler, flags, skipped steps), not the
        weights, back to before the last step, so that replaying ``iteration + 1`` runs at its own
        learning rate (immediate rollback keeps the step's update). False where the last step is
        not the one after ``iteration`` or no record says what they were."""
        if iteration >= self.last_stepped:
            return True
        rec = getattr(self.undo, "last_record", None) if self.undo is not None else None
        if rec is None or self.last_stepped - iteration > 1:
            return False
        if self.lr_scheduler is not None and rec.lr_scheduler_state is not None:
            self.lr_scheduler.load_state_dict(rec.lr_scheduler_state)
        self._restore_step_scalars(getattr(rec, "engine_state", None) or {})
        return True

    def _restore_step_scalars(self, saved: dict[str, Any]) -> None:
        """What the undone step changed outside the inner optimizer (ds_swift.undo.engine recorded it
        at step begin): the loss scaler, the wrapper's flags, the skipped-step counter."""
        if self.optimizer is not None:
            for kept, before in zip(self.optimizer["scalers"], saved.get("scalers", []), strict=False):
                kept.update({k: v for k, v in before.items() if k in kept})
            flags = self.optimizer["flags"]
            flags.update({k: v for k, v in saved.get("wrapper", {}).items() if k in flags})
        if self.counters is not None and "skipped_steps" in saved.get("engine", {}):
            self.counters["skipped_steps"] = int(saved["engine"]["skipped_steps"])

    def state(self) -> dict[str, Any]:
        """The kept state in the form :func:`~ds_swift.recovery.state.transfer.load_state` takes (read
        after any undo). After an undo from the own copy, the module's buffers are the copy's and its
        parameters the kept ones of the undone step: the strategies rebuild them from the masters
        (``finish_restore``)."""
        if self.restored is not None:
            module = {**self.module, **(self.restored.get("buffers") or {})}
            return {
                "module": module,
                "optimizer": self.restored["optimizer"],
                "lr_scheduler": self.restored.get("lr_scheduler"),
                "rng": {},
            }
        return {
            "module": self.module,
            "optimizer": optimizer_payload(self.optimizer) if self.optimizer is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": {},
        }

    def restore(self, engine: Any, consensus: int, undo: bool, timeline: RankTimeline) -> None:
        """Undo to ``consensus`` where ``undo`` says so, then load the kept state into ``engine``
        (the rebuilt one), which resumes at ``consensus + 1``."""
        if undo:
            self.undo_logged(consensus, timeline)
        load_state(engine, self.state(), consensus + 1)
        if self.counters is not None:
            set_counters(engine, consensus + 1, skipped_steps=self.counters["skipped_steps"])


def grid_of(engine: Any) -> Grid:
    """(stage, dp, tp) of every rank of ``engine``'s grid, its accumulation steps and micro-batch,
    and whether its optimizer state is partitioned over data-parallel ranks."""
    topo = pipe_topology(engine)
    axes = topo.get_axis_names()
    coords = []
    for r in range(topo.world_size()):
        c = topo.get_coord(r)
        coords.append((int(c.pipe), int(c.data), int(getattr(c, "model", 0)) if "model" in axes else 0))
    return (
        tuple(coords),
        int(engine.gradient_accumulation_steps()),
        int(engine.train_micro_batch_size_per_gpu()),
        is_partitioned(engine.optimizer),
    )
