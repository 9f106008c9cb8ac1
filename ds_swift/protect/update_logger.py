"""The update logger (strategy ``tranlogs``, and the stages that log their updates under
``logging.kinds``): after every optimizer step, this rank's update record goes to the log store
(ds_swift.recovery.state.update_log has the record and how it is re-applied).

The training thread copies the step's gradient to host memory (what the next backward would
overwrite) and hands the record over; a background thread serialises it and puts it into
``logging.storage`` with its checksum, off the critical path; the next optimizer step waits until
it is stored (the writer had that whole iteration). So a rank lost at or after its step of ``t + 1``
has every record the survivors stepped. A rank lost earlier in iteration ``t + 1`` (in its forward
or backward passes) may not have stored its record of ``t`` yet, though every survivor stepped
``t``: its replacement reports the newest record it finds (:meth:`UpdateLogger.newest_stored`), and
the recovery agrees on ``t - 1`` instead, the survivors undoing their step of ``t`` (bitwise from
their own copies where they hold them, else by update-undo's inverse update, announced: see
ds_swift.recovery.strategies.tranlogs). At most ``MAX_QUEUED`` records wait: a store slower than the steps makes the
training thread wait rather than hold ever more host memory. A write that fails (full disk,
unreachable store), or a record not stored within ``STORED_BEFORE_STEP_S`` (a hung store), stops
update logging on this rank for the rest of the job, loudly, and training goes on: a later failure of this rank then finds its records missing and recovers from the global
checkpoint (said then too). Records before the newest complete global checkpoint are deleted after
each checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ds_swift.background_thread import BackgroundThread, OnError
from ds_swift.logs import say
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.recovery.holdings import UpdateLogHeld
from ds_swift.recovery.state.update_log import (
    UpdateLogError,
    UpdateLogStore,
    capture_update,
    load_record,
    newest_in_run,
    record_gradients,
    record_name,
    records_before,
    save_record,
)
from ds_swift.storage import open_store

if TYPE_CHECKING:
    from ds_swift.recovery.kept import KeptState

__all__ = ["UpdateLogger"]

MAX_QUEUED = 4
#: how long a step waits for the previous step's record to be stored (at most half of
#: watchdog.hang_timeout_s: the wait is inside the step, which the hang detector times)
STORED_BEFORE_STEP_S = 60.0


class UpdateLogger(Protection):
    """Writes this rank's update record after every optimizer step (the protection ``updates``).

    Args:
        rank: this rank (records are named by it: its replacement reads them).
        storage: the log store's URL (``logging.storage``).
        undo: returns the update-undo handle of the engine in force (the record comes from it).
        enabled: whether this rank logs the step just taken (None: always); under ``logging.kinds``
            only the ranks of stages the plan has log their updates.
        hang_timeout_s: ``watchdog.hang_timeout_s``: the wait for the previous record, inside the
            step, stays under half of it, so a hung store never looks like a hung machine.
    """

    def __init__(
        self,
        rank: int,
        storage: str,
        undo: Callable[[], Any],
        enabled: Callable[[], bool] | None = None,
        hang_timeout_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.wait_s = STORED_BEFORE_STEP_S if hang_timeout_s is None else min(STORED_BEFORE_STEP_S, hang_timeout_s / 2)
        """How long a step waits for the previous record before update logging stops."""
        self._enabled = enabled
        self.iteration_bytes: dict[int, int] = {}
        """Bytes stored per iteration, of the last few (the first iteration's size the plan)."""
        self.storage = storage
        self._undo = undo
        self._tmp: str | None = None
        # A write that fails stops update logging on this rank, loudly (_lose), and training goes on.
        self._worker: BackgroundThread[tuple[str, Any]] = BackgroundThread(
            f"ds-swift-updlog-{rank}",
            self._do,
            on_error=OnError.OFF,
            max_items=MAX_QUEUED,
            on_error_hook=lambda exc: self._lose(f"update log write failed: {type(exc).__name__}: {exc}"),
            setup=self._make_tmp,
            teardown=self._remove_tmp,
        )
        self._store: Any = None
        self._stored: set[int] = set()
        """Iterations whose record this process stored and has not deleted yet."""
        self._first: int | None = None
        """The first iteration whose record this process stored."""
        self._listed = False
        """Whether a listing found every record a lost predecessor left (see _collect)."""
        self.lost: str | None = None
        """Why this rank stopped logging updates (None: it logs)."""
        self.records = 0
        self.bytes = 0
        self.capture_s = 0.0
        """Training-thread time: copying the gradients and handing the record over."""
        self.write_s = 0.0
        """Background time: serialising and storing."""
        self._site: Site | None = None

    name = "updates"
    label = "update log"

    @classmethod
    def build(cls, site: Site) -> UpdateLogger | str:
        """Every rank's update after each step (TranLogs); under a per-stage mix (``logging.kinds``)
        only the ranks of the stages the logging plan has log theirs."""
        mode, hooks = site.services.update_log, site.hooks
        if mode == "off":
            return f"strategy {site.cfg.strategy!r} re-applies no logged updates"

        def logs_updates() -> bool:
            engine = site.engine()
            return engine is not None and bool(hooks.logs.logs_updates(engine))

        env = site.ctx.env
        made = cls(
            env.rank if env is not None else dist.get_rank(),
            site.cfg.logging.storage,
            lambda: hooks.undo,
            enabled=logs_updates if mode == "per_stage" else None,
            hang_timeout_s=site.cfg.watchdog.hang_timeout_s,
        )
        made._site = site
        hooks.logs.updates = made  # the message log measures its bytes under a storage budget
        return made

    def start_generation(self, engine: Any) -> None:
        from ds_swift.patches.instructions import hook_instructions

        if self._site is not None:
            self._site.hooks.add(hook_instructions(engine, "ds_swift.updates", self.hooks()))

    def quiesce(self, timeout_s: float) -> None:
        if not self.flush(timeout_s) and self._site is not None:
            self._site.ctx.log("the update records of the last steps were not all stored before the teardown")

    def held(self, kept: KeptState | None) -> UpdateLogHeld | None:
        """A survivor whose undo record lost its gradients may take them back from its record
        (:meth:`offer_gradients`: called here, before the report says whether it can undo); a
        replacement reports its rank's newest record, probed from the newest complete checkpoint."""
        if kept is not None:
            self.offer_gradients(kept)
            return None
        ckpt = self._site.ckpt if self._site is not None else None
        found = ckpt.latest(None) if ckpt is not None else None
        return UpdateLogHeld(newest=self.newest_stored(found[0] if found is not None else 0))

    def lent(self, kept: KeptState | None) -> UpdateLogStore:
        return UpdateLogStore(self.storage)

    def after_checkpoint(self, done: int) -> None:
        self.gc_before(done)  # the records before it go

    def usage(self) -> dict[str, Any]:
        return {"log_bytes": self.bytes}

    def close(self, timeout_s: float) -> None:
        self.stop()

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        from ds_swift.protect.costs import mb

        grads = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad)
        who = "this rank" if self._enabled is None else "this rank where its stage logs updates (logging.kinds)"
        return (
            f"  update log: {who} copies its step's gradients to host memory, {mb(grads)} per iteration, on the "
            f"training thread, and a background thread stores the record in {self.storage} (measured totals at the end)"
        )

    def _log(self, msg: str) -> None:
        """One line on ds-swift's channel, tagged with this rank."""
        say(msg, self.rank, name=__name__)

    def hooks(self) -> dict[type, Callable[..., Any]]:
        """The optimizer-step hook (ds_swift.patches.instructions) that drives the logger."""
        from ds_swift.patches.instructions import schedule

        def step(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            # The previous step's record is stored before this step runs: a rank lost from here on
            # has every record the survivors stepped (one lost earlier in this iteration may lack
            # the previous one: see the module docstring). The writer had the whole iteration for
            # it, so this rarely waits.
            if self._worker.alive and self.lost is None and not self.flush(self.wait_s):
                # Waiting on would hold every later step (the queue fills, then the hang detector takes
                # this healthy machine); stepping on with the record unstored breaks the rule above.
                self._lose(f"the previous update record was not stored within {self.wait_s:g} s")
            out = call_next(**kw)
            self.after_step(eng)
            return out

        return {schedule.OptimizerStep: step}

    def after_step(self, engine: Any) -> None:
        """Record the step just taken and queue it for the store."""
        if self.lost is not None or (self._enabled is not None and not self._enabled()):
            return
        t0 = time.perf_counter()
        undo = self._undo()
        try:
            if undo is None:
                raise UpdateLogError("update-undo is not attached to this engine (its record is the update's source)")
            record = capture_update(engine, undo)
        except UpdateLogError as exc:
            self._lose(f"update of iteration {int(engine.global_steps) - 1} not recordable: {exc}")
            return
        self._worker.submit(("record", record))
        self.capture_s += time.perf_counter() - t0

    def gc_before(self, iteration: int) -> None:
        """A global checkpoint of ``iteration`` iterations is complete: older records go (queued
        behind the records in flight, so none of those is deleted before it is written)."""
        if self._worker.alive and self.lost is None:
            self._worker.submit(("gc", iteration))

    def flush(self, timeout_s: float) -> bool:
        """Until every queued record is stored (a survivor before its teardown). False if
        ``timeout_s`` passed first."""
        return self._worker.wait_idle(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the thread after the records in flight (the job ends), and say what logging cost."""
        self._worker.stop(timeout_s)
        if self.records:
            self._log(
                f"update log: {self.records} records, {self.bytes / self.records / 1e6:.3f} MB each; the training "
                f"thread spent {1e3 * self.capture_s / self.records:.2f} ms each copying them out, the writer "
                f"{1e3 * self.write_s / self.records:.2f} ms each storing them"
            )

    # ------------------------------------------------------------------ the background thread
    def _make_tmp(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix=f"ds-swift-updlog-{self.rank}-")

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _do(self, item: tuple[str, Any]) -> None:
        kind, arg = item
        if self.lost is not None:  # lost on the training thread (a step not recordable)
            return
        tmp = self._tmp
        assert tmp is not None
        t0 = time.perf_counter()
        if self._store is None:
            self._store = open_store(self.storage)
        if kind == "gc":
            self._collect(arg)
            return
        name = record_name(self.rank, arg.iteration)
        path = os.path.join(tmp, name)
        try:
            nbytes = save_record(arg, path)
            self._store.put_file(path, name)
            self.bytes += nbytes
            self.iteration_bytes[arg.iteration] = nbytes
            self._stored.add(arg.iteration)
            self._first = arg.iteration if self._first is None else self._first
            for old in sorted(self.iteration_bytes)[:-8]:
                del self.iteration_bytes[old]
        finally:
            if os.path.exists(path):
                os.unlink(path)
        self.records += 1
        self.write_s += time.perf_counter() - t0

    def _collect(self, iteration: int) -> None:
        """Delete this rank's records of the steps before ``iteration``: by name, those this process
        stored; and, until a deletion's bound passes the first record this process stored, also
        those a listing of the store finds (what an earlier, lost process of this rank left: its
        records run up to this process's first). A listing reads every rank's records since the last
        checkpoint (up to ranks x checkpoint interval names): so once or twice per process, not at
        every checkpoint."""
        assert self._store is not None
        if not self._listed:
            mine = f"upd_r{self.rank:05d}_"
            for name in records_before(self._store.names(), iteration):
                if name.startswith(mine):
                    self._store.delete(name)
            # Done once the bound passed this process's first record: every older one was below it.
            self._listed = self._first is not None and iteration > self._first
            self._stored = {i for i in self._stored if i >= iteration}  # deleted with the listed ones
        for it in sorted(i for i in self._stored if i < iteration):
            self._store.delete(record_name(self.rank, it))
            self._stored.discard(it)

    def newest_stored(self, since: int) -> int | None:
        """A replacement's look, for its recovery report: the newest iteration this rank's record was
        stored for before the rank was lost, probed from ``since`` (the newest complete checkpoint's
        iterations done: its records run from there without a gap; a few store requests, not a
        listing of every rank's records); ``since - 1`` where none is; None where the log store
        cannot be read (the recovery's check round then names what is missing)."""
        try:
            store = open_store(self.storage)
            return newest_in_run(lambda it: bool(store.exists(record_name(self.rank, it))), since)
        except Exception as exc:  # noqa: BLE001 - unreachable, unreadable: looked up again in the restore
            self._log(f"update log {self.storage} not readable for the recovery report: {type(exc).__name__}: {exc}")
            return None

    def offer_gradients(self, kept: KeptState) -> None:
        """A survivor whose update-undo record lost its gradients (the next iteration's backward
        passes overwrote them) can take them back from its own update record of that step, if it was
        stored: then it can still undo the step, which a recovery landing one iteration earlier needs
        (a lost rank without its record of that step: ds_swift.recovery.strategies.tranlogs). Only
        looked up here (one store request); read only if an undo comes (KeptState.gradients_back)."""
        undo, it = kept.undo, kept.last_stepped
        if undo is None or kept.can_undo or self.lost is not None or it < 0:
            return
        if not getattr(undo, "undoable_but_for_gradients", False):
            return
        try:
            stored = open_store(self.storage).exists(record_name(self.rank, it))
        except Exception as exc:  # noqa: BLE001 - then it cannot undo, as before: its report says so
            self._log(f"update log {self.storage} not readable for the recovery report: {type(exc).__name__}: {exc}")
            return
        if stored:
            kept.gradients_back = lambda: self._give_back_gradients(undo, it)

    def _give_back_gradients(self, undo: Any, iteration: int) -> bool:
        """:meth:`offer_gradients`' read: this rank's record of ``iteration``, its gradients to ``undo``."""
        try:
            record = load_record(open_store(self.storage), self.rank, iteration)
            n = undo.restore_gradients(record_gradients(undo.optimizer, record))
        except Exception as exc:  # noqa: BLE001 - the undo then fails, naming this
            self._log(f"the gradients of iteration {iteration} not taken back from the update log: {exc}")
            return False
        self._log(f"took the gradients of iteration {iteration} back from its update record ({n} tensors) to undo it")
        return bool(undo.can_undo)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            say(
                f"{why}; update logging stops on this rank, training goes on: a failure of this rank recovers from "
                "the global checkpoint",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )
