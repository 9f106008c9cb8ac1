"""The runtime's side of logging-based recovery, for one worker, kept across engine rebuilds.

Wherever the topology plan logs pipeline sends across machines, :class:`EngineLogging`:

- installs, on every engine the runtime builds, the message logger (ds_swift.msglog) and a
  :class:`~ds_swift.recovery.replay.collectives.CollectiveRecorder` (one recorder object for the worker's
  life: a survivor must still hold the records of the iterations since the last checkpoint after
  its rebuild);
- when a global checkpoint completes, forgets the records before it and garbage-collects the log
  chunks before it (here and in the global store);
- on a failure, before the survivor's teardown, flushes its log and uploads it to the global store
  (replacements read it); a failure to do so is remembered and said in the recovery's check round;
- hands the recovery what it needs (:meth:`log_plan`).

The message sizes are not known before the engine runs (the DeepSpeed config has no hidden size or
sequence length). Wherever the plan logs, the first iteration is logged by the conservative plan
(every machine boundary; under ``logging.kinds: auto`` the stages recovered by logging also log
their updates); after it every rank measures what its loggers wrote, the figures are all-gathered,
and every rank computes the same plan from them (ds_swift.plan.budget: the storage budget, each
stage's log kind, whether logging pays there), prints it once (rank 0) and logs by it from the
next iteration on; a budget that cannot be met stops the job there, naming the field. The figures are
also published in the job store: a replacement, and a survivor whose all-gather a failure cut
short, adopt the same plan from them when they install their hooks, so every rank of a recovery
sees the same machine groups. Grouping only removes logged sends, so the conservative log of the
first iteration serves a replay under the budgeted plan too.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ds_swift import transport
from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.data.keyed import BatchFn
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say, say_here
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.protect.costs import ENV
from ds_swift.recovery.coordinator import LogPlan
from ds_swift.recovery.holdings import MessageLogHeld
from ds_swift.recovery.host import RecoveryHost
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.replay.runner import ReplayRuntime

__all__ = ["SIZES_KEY", "EngineLogging", "MessageLogging"]

#: Job-store key of the message sizes measured under a storage budget (JSON of MeasuredSizes).
SIZES_KEY = "logging/measured_sizes"


class EngineLogging:
    """Message log, step-collective records and the static recovery plan of one worker.

    Args:
        cfg: the swift config.
        ds_config: the DeepSpeed config dict (parallel recovery builds copy engines from it).
        batch_fn: ``batch_fn(iteration, micro_batch)``.
        seed: the runtime's RNG seed.
        cache_dir: where a remote store's log chunks are downloaded for a replay.
        store: the job store (None without ds-swift-launch): where measured sizes are published.
    """

    def __init__(
        self,
        cfg: SwiftConfig,
        ds_config: Mapping[str, Any],
        batch_fn: BatchFn,
        seed: int,
        cache_dir: str,
        store: JobStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.ds_config = ds_config
        self.batch_fn = batch_fn
        self.seed = seed
        self.cache_dir = cache_dir
        self.recorder: Any = None  # CollectiveRecorder
        self.handle: Any = None  # MessageLogHandle of the engine in force
        self._handles: list[Any] = []  # every handle installed (their byte counters)
        self.log_error: str | None = None  # why the last flush/upload failed
        self.coverage_lost: str | None = None  # why this rank's sends stopped being logged
        self._plan: Any = None  # the topology plan; False when it could not be made
        self.plan_error: str | None = None  # why it could not be made (the start-up cost line says it)
        self._layout: Any = None  # the ParallelLayout the plan is of
        self._decided = True  # False while the plan waits for the first iteration's measured sizes
        self._t_begin: float | None = None  # when the iteration in progress started
        self._first_kinds: dict[int, set[str]] = {}  # what each logging stage logs before the decision
        self._copies = False  # buddy copies keep every rank's optimizer partition on another machine
        self.updates: Any = None  # the UpdateLogger (ds_swift.protect.update_logger), where stages may log updates
        #: False only where a benchmark switched message logging off (ds_swift.protect.costs)
        self.enabled = True

    # ------------------------------------------------------------------ the static plan
    def static_plan(self, engine: Any) -> Any:
        """The topology analyzer's per-stage plan (None if ds_swift.plan cannot analyze it)."""
        if self._plan is None:
            try:
                from ds_swift.patches.deepspeed_engine import pipe_topology
                from ds_swift.plan import layout_from_deepspeed_topology
                from ds_swift.plan.buddy_cost import COPIES_NOTE
                from ds_swift.plan.budget import conservative_plan, needs_measuring

                self._layout = layout_from_deepspeed_topology(pipe_topology(engine), self.cfg.machines.gpus_per_node)
                from ds_swift.plan.stage_logging import first_kinds
                from ds_swift.protect.buddy import partition_copies

                self._copies = partition_copies(self.cfg, engine)
                self._plan = conservative_plan(self._layout, self.cfg, self._copies)
                self._decided = not needs_measuring(self.cfg, self._plan)
                self._first_kinds = first_kinds(self.cfg.logging.kinds, self._plan)
            except ConfigError:
                raise  # a configuration the job cannot serve (logging.kinds, strategy logging): stop, naming it
            except Exception as exc:  # noqa: BLE001 - the plan informs; recovery decides from who survived
                self.plan_error = f"{type(exc).__name__}: {exc}"
                say_here(
                    f"topology analysis failed ({self.plan_error}): message logging, update logging by stage and "
                    "the step-collective records are off on this rank for the rest of the job, training goes on: "
                    "a failure that logging would have recovered recovers from the global checkpoint",
                    level=logging.WARNING,
                    name=__name__,
                )
                self._plan = False
            else:
                if dist.get_rank() == 0:
                    later = "" if self._decided else "; " + self._plan.notes[-1]
                    later += "".join("; " + n for n in self._plan.notes if COPIES_NOTE in n)
                    say(
                        f"recovery plan per pipeline stage: {self._plan.stage_strategy} "
                        f"(strategy {self.cfg.strategy!r}){later}",
                        name=__name__,
                    )
        if self._plan and not self._decided:
            self._adopt_published()
        return self._plan or None

    # ------------------------------------------------------------------ the storage budget
    def begin_iteration(self) -> None:
        """The engine starts an iteration (its time is measured under a storage budget)."""
        self._t_begin = time.perf_counter()

    def after_iteration(self, engine: Any, suspend: Callable[[], Callable[[], None]]) -> None:
        """An iteration completed. Under a storage budget still waiting for message sizes: measure
        them (collectively: every rank calls this after the same iteration), switch to the budgeted
        plan and print it once. ``suspend()`` removes the message logger and returns what puts it
        back. Raises ConfigError (on every rank) when the budget cannot be met."""
        t0, self._t_begin = self._t_begin, None
        if t0 is None or not self.possible(engine) or self._decided:
            return
        from ds_swift.plan.budget import decide, describe

        measured = self._measure(engine, time.perf_counter() - t0)
        if self.store is not None:
            # Before anything can fail: replacements and cut-short survivors adopt the same plan.
            self.store.set(SIZES_KEY, json.dumps(measured.to_json()))
        plan, decisions = decide(self._layout, self.cfg, measured, self._copies)
        if dist.get_rank() == 0:
            for line in describe(plan, self.cfg, decisions):
                say_here(line)
        self._switch(plan, suspend)

    def _measure(self, engine: Any, seconds: float) -> Any:
        """Every rank's logged bytes per send in the iteration just done, all-gathered."""
        from ds_swift.plan.sizes import MeasuredSizes

        iteration = int(engine.global_steps) - 1
        counts = int(engine.grid.get_data_parallel_id()) == 0  # one replica's parameters make the model
        report = {
            "rank": dist.get_rank(),
            "iteration": iteration,
            "sends": self._logged_bytes(iteration),
            "seconds": seconds,
            "params": sum(p.numel() for p in engine.module.parameters()) if counts else 0,
            "stage": int(engine.stage_id),
            "update_bytes": self._update_bytes(iteration),
            "copy_gbps": copy_gbps(engine),
        }
        reports = transport.all_gather_json(report)  # JSON, never a pickle of a peer's bytes
        return MeasuredSizes.from_reports(reports, int(engine.gradient_accumulation_steps()))

    def _update_bytes(self, iteration: int) -> int:
        """What this rank's update logger stored for ``iteration`` (0: it logs no updates)."""
        updates = self.updates
        if updates is None or not updates.flush(max(60.0, self.cfg.watchdog.op_timeout_s)):
            return 0
        return int(updates.iteration_bytes.get(iteration, 0))

    def logs_updates(self, engine: Any) -> bool:
        """Whether this rank logs its updates now: its stage logs them in the plan in force (before
        the first iteration is measured: wherever ``logging.kinds`` may choose them)."""
        plan = self.static_plan(engine)
        if plan is None:
            return False
        stage = int(engine.stage_id)
        if not self._decided:
            return "updates" in self._first_kinds.get(stage, ())
        return stage in plan.update_stages

    def _logged_bytes(self, iteration: int) -> list[list[int]]:
        """``[receiver, bytes]`` per send this rank logged in ``iteration``: its records and their
        index entries on disk (what the storage budget holds)."""
        handle = self.handle
        if handle is None:
            return []
        from ds_swift.msglog.chunk_format import INDEX_ENTRY_SIZE, ChunkName
        from ds_swift.msglog.chunk_index import load_chunk

        handle.flush(timeout_s=max(60.0, self.cfg.watchdog.op_timeout_s), sync=False)
        out = []
        for edge, receiver in handle.edges.values():
            name = ChunkName.for_iteration(edge, iteration, self.cfg.logging.chunk_iterations)
            path = handle.log_dir / name.chunk_file
            entries = load_chunk(path).entries.values() if path.exists() else []
            out.append([receiver, sum(e.length + INDEX_ENTRY_SIZE for e in entries if e.iteration == iteration)])
        return out

    def _adopt_published(self) -> None:
        """Take the budgeted plan from the sizes another rank published (a replacement, or a
        survivor whose own measurement a failure cut short)."""
        raw = self.store.get(SIZES_KEY) if self.store is not None else None
        if raw is None:
            return
        from ds_swift.plan.budget import budget_plan
        from ds_swift.plan.sizes import MeasuredSizes

        self._plan = budget_plan(self._layout, self.cfg, MeasuredSizes.from_json(json.loads(raw)), self._copies)
        self._decided = True

    def _switch(self, plan: Any, suspend: Callable[[], Callable[[], None]]) -> None:
        """Log by ``plan`` from now on; the logger is reinstalled only where this rank's sends change."""
        me = dist.get_rank()

        def mine(p: Any) -> set[tuple[int, int]]:
            return {(e.src_rank, e.dst_rank) for e in p.logged_edges if e.src_rank == me}

        before, after = mine(self._plan), mine(plan)
        restart: Callable[[], None] = lambda: None  # noqa: E731
        if after < before and self.handle is not None:
            self.handle.narrow(plan)  # in place: hooks installed after the logger's stay
        elif after != before:
            restart = suspend()
        self._plan, self._decided = plan, True
        restart()

    def possible(self, engine: Any) -> bool:
        """The plan logs some pipeline send: logging-based recovery can be used."""
        plan = self.static_plan(engine) if self.enabled else None
        return plan is not None and bool(plan.logged_edges or plan.update_stages)

    # ------------------------------------------------------------------ per engine
    def attach_recorder(self, engine: Any, handles: list[Any]) -> None:
        # A replayed stage cannot recompute the step's pipeline-wide collectives (DeepSpeed's
        # gradient clipping all-reduces the norm over every stage); a survivor's records serve it.
        if not self.possible(engine):
            return
        from ds_swift.recovery.replay.collectives import CollectiveRecorder

        if self.recorder is None:
            self.recorder = CollectiveRecorder()
        handles.append(self.recorder.install(engine))

    def attach_log(self, engine: Any, handles: list[Any]) -> None:
        # Written from the start wherever the plan logs a machine boundary: the replay's input.
        self.handle = None
        if not self.possible(engine) or self.coverage_lost is not None:
            return  # (after a write error this rank's log has a hole until the job ends)
        try:
            from ds_swift.msglog import install_message_logging

            handle = install_message_logging(engine, self.static_plan(engine), self.cfg, on_error=self._lose_coverage)
        except Exception as exc:  # noqa: BLE001 - logging serves recovery; it must never stop training
            self._lose_coverage(f"message logging not installed on rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
            return
        handles.append(handle)
        self.handle = handle
        self._handles.append(handle)

    def bytes_logged(self) -> int:
        """Bytes this rank's message loggers wrote (records and headers, on disk), since it started."""
        return sum(int(h.stats.bytes) for h in self._handles)

    def detached(self) -> None:
        """The runtime removed every hook (its handles): the logger went with them."""
        self.handle = None

    def suspend(self, handles: list[Any], engine: Callable[[], Any]) -> Callable[[], None]:
        """Remove the message logger (the outermost hook) for a while; returns what puts it back."""
        handle = self.handle
        if handle is None:
            return lambda: None
        if not handles or handles[-1] is not handle:
            # Another hook wraps the logger's: removing it would take that one along. Said, not
            # skipped silently: this rank logs on (its bytes count against the storage budget).
            say_here("the message logger is not the outermost hook and stays installed")
            return lambda: None
        handles.pop().remove()
        self.handle = None
        return lambda: self.attach_log(engine(), handles)

    def restart_iteration(self) -> None:
        if self.handle is not None:
            self.handle.restart_iteration()

    # ------------------------------------------------------------------ events
    def after_checkpoint(self, done: int) -> None:
        """This job's newest complete global checkpoint holds ``done`` iterations: what the replay of
        later failures no longer needs goes."""
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
                say_here(f"message log GC before iteration {done} failed: {type(exc).__name__}: {exc}")

    def _lose_coverage(self, why: str) -> None:
        """This rank's sends are no longer logged (for the rest of the job): said loudly, once, and
        reported in every recovery (MessageLogHeld), where the stages whose inbound messages
        these were recover from the global checkpoint instead of a replay."""
        if self.coverage_lost is None:
            self.coverage_lost = why
            say(
                f"{why}; message logging of this rank's sends stops, training goes on: a failure of the stages "
                "receiving them recovers from the global checkpoint",
                dist.get_rank(),
                level=logging.WARNING,
                name=__name__,
            )

    def flush(self) -> None:
        """Survivor, before its teardown: every logged message to the global store."""
        self.log_error = None
        if self.handle is None or self.coverage_lost is not None:
            return  # a log with a hole serves no replay: the recovery hears of it in the report
        try:
            self.handle.upload(timeout_s=max(60.0, self.cfg.watchdog.op_timeout_s))
        except Exception as exc:  # noqa: BLE001 - said in the recovery's check round: checkpoint fallback
            self.log_error = f"{type(exc).__name__}: {exc}"
            say_here(f"message log not flushed to {self.cfg.logging.storage}: {self.log_error}")

    def log_plan(self, engine: Any) -> LogPlan | None:
        """What logging-based recovery may use in this recovery (None where nothing is logged)."""
        if not self.possible(engine):
            return None
        plan = self.static_plan(engine)
        return LogPlan(sorted(plan.replay_stages), plan.groups, sorted(plan.update_stages))

    def replay_runtime(self, survivor: bool, host: RecoveryHost) -> ReplayRuntime:
        """What this worker lends a replay of this recovery (its data, seed, hooks and records)."""
        return ReplayRuntime(
            batch_fn=self.batch_fn,
            seed=self.seed,
            storage=self.cfg.logging.storage,
            ds_config=self.ds_config,
            parallel=self.cfg.parallel_recovery,
            mode=self.cfg.parallel_recovery_mode,
            force_parallel=self.cfg.parallel_recovery_force,
            recorder=self.recorder,
            log_error=self.log_error if survivor else None,
            host=host,
            cache_dir=self.cache_dir,
        )


class MessageLogging(Protection):
    """The message log as a protection (``messages``): the worker's :class:`EngineLogging`, which the
    runtime's hooks install on every engine in the order the patches need (ds_swift.runtime.hooks)."""

    name = "messages"
    label = "message logging"

    def __init__(self, logs: EngineLogging, site: Site) -> None:
        self.logs, self._site = logs, site

    @classmethod
    def build(cls, site: Site) -> MessageLogging:
        return cls(site.hooks.logs, site)

    def quiesce(self, timeout_s: float) -> None:
        self.logs.flush()  # every logged message to the global store: replacements read it

    def held(self, kept: KeptState | None) -> MessageLogHeld | None:
        lost = self.logs.coverage_lost
        return MessageLogHeld(lost=lost) if lost is not None else None

    def lent(self, kept: KeptState | None) -> ReplayRuntime | None:
        engine = self._site.engine()
        if engine is None or not self.logs.possible(engine):
            return None
        return self.logs.replay_runtime(kept is not None, self._site.host)

    def after_checkpoint(self, done: int) -> None:
        self.logs.after_checkpoint(done)

    def usage(self) -> dict[str, Any]:
        return {"log_bytes": self.logs.bytes_logged()}

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        logs = self.logs
        if logs.possible(engine):
            return (
                "  message logging: on: the activations and gradients this rank sends across machines, copied off "
                "the device in the pipeline's bubbles and written by a background thread (bytes per iteration "
                "measured in the logs' end-of-job line)"
            )
        if logs.plan_error is not None:
            return (
                f"  message logging: off (topology analysis failed: {logs.plan_error}; a failure recovers from the "
                "global checkpoint): 0"
            )
        if not logs.enabled:
            return f"  message logging: OFF (benchmark: {ENV}): 0"
        return "  message logging: off for this rank (no send of its crosses a machine boundary that the plan logs): 0"


def copy_gbps(engine: Any) -> float | None:
    """Device-to-host bandwidth in GB/s, timed once on a 64 MB copy into pinned memory (where the
    logs' bubble-time copies go); None on CPU, where nothing is copied off a device."""
    import torch

    device = next((p.device for p in engine.module.parameters() if p.is_cuda), None)
    if device is None:
        return None
    src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return src.numel() / max(time.perf_counter() - t0, 1e-9) / 1e9


def cache_dir_for(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"log-cache-rank{rank}")
