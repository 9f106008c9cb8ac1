"""The runtime's side of logging-based recovery, for one worker, kept across engine rebuilds.

Wherever the topology plan logs pipeline sends across machines, :class:`EngineLogging`:

- installs, on every engine the runtime builds, the message logger (ds_swift.msglog) and a
  :class:`~ds_swift.recovery.collectives.CollectiveRecorder` (one recorder object for the worker's
  life: a survivor must still hold the records of the iterations since the last checkpoint after
  its rebuild);
- when a global checkpoint completes, forgets the records before it and garbage-collects the log
  chunks before it (here and in the global store);
- on a failure, before the survivor's teardown, flushes its log and uploads it to the global store
  (replacements read it); a failure to do so is remembered and said in the recovery's check round;
- hands the recovery what it needs (:meth:`log_plan`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ds_swift.checkpoint import latest_complete
from ds_swift.config import SwiftConfig
from ds_swift.data import BatchFn
from ds_swift.recovery.coordinator import LogPlan
from ds_swift.recovery.logging_recovery import ReplayRuntime

__all__ = ["EngineLogging"]


class EngineLogging:
    """Message log, step-collective records and the static recovery plan of one worker.

    Args:
        cfg: the swift config.
        ds_config: the DeepSpeed config dict (parallel recovery builds copy engines from it).
        batch_fn: ``batch_fn(iteration, micro_batch)``.
        seed: the runtime's RNG seed.
        cache_dir: where a remote store's log chunks are downloaded for a replay.
        log: prints one line (the runtime's logger).
    """

    def __init__(
        self,
        cfg: SwiftConfig,
        ds_config: Mapping[str, Any],
        batch_fn: BatchFn,
        seed: int,
        cache_dir: str,
        log: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.ds_config = ds_config
        self.batch_fn = batch_fn
        self.seed = seed
        self.cache_dir = cache_dir
        self._log = log
        self.recorder: Any = None  # CollectiveRecorder
        self.handle: Any = None  # MessageLogHandle of the engine in force
        self.log_error: str | None = None  # why the last flush/upload failed
        self._plan: Any = None  # the topology plan; False when it could not be made

    # ------------------------------------------------------------------ the static plan
    def static_plan(self, engine: Any) -> Any:
        """The topology analyzer's per-stage plan (None if ds_swift.topology cannot analyze it)."""
        if self._plan is None:
            try:
                from ds_swift.topology import analyze_config, layout_from_deepspeed_topology

                layout = layout_from_deepspeed_topology(engine.grid._topo, self.cfg.machines.gpus_per_node)
                self._plan = analyze_config(layout, self.cfg)
            except Exception as exc:  # noqa: BLE001 - the plan informs; recovery decides from who survived
                self._log(f"topology analysis unavailable: {type(exc).__name__}: {exc}")
                self._plan = False
            else:
                if dist.get_rank() == 0:
                    print(f"[ds-swift] recovery plan per pipeline stage: {self._plan.stage_strategy} "
                          f"(strategy {self.cfg.strategy!r})", file=sys.stderr, flush=True)  # fmt: skip
        return self._plan or None

    def possible(self, engine: Any) -> bool:
        """The plan logs some pipeline send: logging-based recovery can be used."""
        plan = self.static_plan(engine)
        return plan is not None and bool(plan.logged_edges)

    # ------------------------------------------------------------------ per engine
    def attach_recorder(self, engine: Any, handles: list[Any]) -> None:
        # A replayed stage cannot recompute the step's pipeline-wide collectives (DeepSpeed's
        # gradient clipping all-reduces the norm over every stage); a survivor's records serve it.
        if not self.possible(engine):
            return
        from ds_swift.recovery.collectives import CollectiveRecorder

        if self.recorder is None:
            self.recorder = CollectiveRecorder()
        handles.append(self.recorder.install(engine))

    def attach_log(self, engine: Any, handles: list[Any]) -> None:
        # Written from the start wherever the plan logs a machine boundary: the replay's input.
        self.handle = None
        if not self.possible(engine):
            return
        try:
            from ds_swift.msglog import install_message_logging

            handle = install_message_logging(engine, self.static_plan(engine), self.cfg)
        except Exception as exc:  # noqa: BLE001 - logging serves recovery; it must never stop training
            self._log(f"message logging not installed: {type(exc).__name__}: {exc}")
            return
        handles.append(handle)
        self.handle = handle

    def detached(self) -> None:
        """The runtime removed every hook (its handles): the logger went with them."""
        self.handle = None

    def suspend(self, handles: list[Any], engine: Callable[[], Any]) -> Callable[[], None]:
        """Remove the message logger (the outermost hook) for a while; returns what puts it back."""
        handle = self.handle
        if handle is None or not handles or handles[-1] is not handle:
            return lambda: None
        handles.pop().remove()
        self.handle = None
        return lambda: self.attach_log(engine(), handles)

    def restart_iteration(self) -> None:
        if self.handle is not None:
            self.handle.restart_iteration()

    # ------------------------------------------------------------------ events
    def after_checkpoint(self, ckpt_dir: str) -> None:
        """A global checkpoint was written: what the replay of later failures no longer needs goes."""
        found = latest_complete(ckpt_dir)
        if found is None:
            return  # rank 0's completion marker may not be there yet: collected after the next one
        done = found[0]
        if self.recorder is not None:
            self.recorder.discard_before(done)
        if self.handle is not None:
            from ds_swift.storage import local_path_of

            storage = self.cfg.logging.storage
            local = local_path_of(storage)
            same = local is not None and local.resolve() == self.handle.log_dir.resolve()
            try:
                self.handle.gc_before(done, store_url=None if same else storage)
            except Exception as exc:  # noqa: BLE001 - garbage left behind must not stop training
                self._log(f"message log GC before iteration {done} failed: {type(exc).__name__}: {exc}")

    def flush(self) -> None:
        """Survivor, before its teardown: every logged message to the global store."""
        self.log_error = None
        if self.handle is None:
            return
        try:
            self.handle.upload(timeout_s=max(60.0, self.cfg.watchdog.op_timeout_s))
        except Exception as exc:  # noqa: BLE001 - said in the recovery's check round: checkpoint fallback
            self.log_error = f"{type(exc).__name__}: {exc}"
            self._log(f"message log not flushed to {self.cfg.logging.storage}: {self.log_error}")

    def log_plan(
        self,
        engine: Any,
        survivor: bool,
        *,
        set_reseed: Callable[[bool], None],
        set_armed: Callable[[bool], None],
        poison: Callable[[], None],
        suspend_logging: Callable[[], Callable[[], None]],
    ) -> LogPlan | None:
        """What logging-based recovery may use in this recovery (None where nothing is logged)."""
        if not self.possible(engine):
            return None
        plan = self.static_plan(engine)
        runtime = ReplayRuntime(
            batch_fn=self.batch_fn,
            seed=self.seed,
            storage=self.cfg.logging.storage,
            ds_config=self.ds_config,
            parallel=self.cfg.parallel_recovery,
            mode=self.cfg.parallel_recovery_mode,
            recorder=self.recorder,
            log_error=self.log_error if survivor else None,
            set_reseed=set_reseed,
            set_armed=set_armed,
            poison=poison,
            suspend_logging=suspend_logging,
            cache_dir=self.cache_dir,
        )
        stages = [s for s, how in plan.stage_strategy.items() if how == "logging"]
        return LogPlan(stages, plan.groups, runtime)


def cache_dir_for(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"log-cache-rank{rank}")
