"""SwiftPipelineEngine: a DeepSpeed PipelineEngine that survives machine failures in-process.

User code changes two lines (see ``examples/pretrain_gpt.py``)::

    ds_swift.init_distributed(ds_config)           # instead of deepspeed.init_distributed()
    engine, *_ = deepspeed.initialize(model=model_fn(), config=ds_config, model_parameters=...)
    engine = ds_swift.initialize(engine, ds_config, model_fn=model_fn, batch_fn=batch_fn)
    while engine.global_steps < train_iters:
        loss = engine.train_batch()

The wrapper passes every other attribute through to the DeepSpeed engine in force. When a
generation fails, ``train_batch`` (and ``save_checkpoint``) does not return until the job is whole
again: detection (ds_swift.detect) says how it failed, the rebuild (ds_swift.runtime.rebuild) tears
the engine down, joins the next generation, builds DeepSpeed again and runs the recovery protocol,
and the iteration is trained again. A replacement worker (``SWIFT_REPLACEMENT=1``) runs the same
recovery inside ``initialize``, so the user's loop simply continues at ``engine.global_steps``.

The per-engine hooks (RNG keying, fault injection, undo, message logging) are in
ds_swift.runtime.hooks; the checkpoint calls in ds_swift.runtime.engine_checkpoint; the data an
iteration reads in ds_swift.runtime.engine_inputs; its end in ds_swift.runtime.engine_close; what is set
up around the engine, and reported of it, in ds_swift.runtime.engine_setup; the recovery timeline
in ds_swift.recovery.timeline.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist

from ds_swift.checkpoint.periodic import origin_of
from ds_swift.checkpoint.setup import checkpoint_manager
from ds_swift.config import ConfigError, SwiftConfig, left_off, load_ds_config
from ds_swift.data.keyed import BatchFn
from ds_swift.detect.monitor import FailureMonitor
from ds_swift.detect.wake import pipeline_neighbours, poison_neighbours, watched_peers
from ds_swift.patches.determinism import ScopedDeterminism
from ds_swift.protect.costs import switched_off
from ds_swift.protect.message_logging import EngineLogging, cache_dir_for
from ds_swift.recovery.base import RecoveryOutcome
from ds_swift.recovery.gradmask import GradScale
from ds_swift.recovery.registry import load_config, services_of
from ds_swift.recovery.state.inflight import FinishIteration, finish_iteration, kept_inflight
from ds_swift.runtime.context import SwiftContext, check_machines, current_context
from ds_swift.runtime.engine_checkpoint import CheckpointCalls
from ds_swift.runtime.engine_close import EngineShutdown
from ds_swift.runtime.engine_inputs import IterationInputs
from ds_swift.runtime.engine_setup import (
    check_hang_timeout,
    failure_simulation,
    log_protection_costs,
)
from ds_swift.runtime.guard import GuardTripped, LossGuard
from ds_swift.runtime.hooks import EngineHooks, make_injector
from ds_swift.runtime.rebuild import MAX_ATTEMPTS, Rebuilder, Rejoined
from ds_swift.runtime.timeline import PendingTimeline
from ds_swift.runtime.warmup import WarmUp

__all__ = ["SwiftPipelineEngine", "initialize"]


def initialize(
    engine: Any,
    ds_config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    model_fn: Callable[[], Any] | None = None,
    batch_fn: BatchFn | None = None,
    seed: int = 1234,
    engine_fn: Callable[[], Any] | None = None,
) -> Any:
    """Wrap ``engine`` (a DeepSpeed PipelineEngine). Returns it untouched when swift is disabled.

    Args:
        engine: what ``deepspeed.initialize`` returned first.
        ds_config: the DeepSpeed config (dict or JSON path) with its ``swift`` section.
        model_fn: builds the model again (the same ``PipelineModule``) for the rebuild.
        batch_fn: ``batch_fn(iteration, micro_batch) -> (inputs, labels)``; see ds_swift.data.keyed.
        seed: keys the per-forward RNG reseeding (seed, iteration, micro-batch, stage).
        engine_fn: builds the whole DeepSpeed engine again instead of ``model_fn`` +
            ``deepspeed.initialize(model, config=ds_config)`` (for custom optimizers or schedulers).
    """
    if ds_config is None:
        raise ValueError("ds_swift.initialize needs the DeepSpeed config (dict or path) with its swift section")
    config = load_ds_config(ds_config)
    cfg = load_config(config)
    if not cfg.enabled:
        if why := left_off(config.get("swift")):
            raise ConfigError(why)
        return engine
    if model_fn is None and engine_fn is None:
        raise ValueError("ds_swift.initialize needs model_fn (or engine_fn) to rebuild the engine after a failure")
    if batch_fn is None:
        raise ValueError(
            "ds_swift.initialize needs batch_fn(iteration, micro_batch) so a resumed rank reads the right data"
        )
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("call ds_swift.init_distributed(ds_config) instead of deepspeed.init_distributed() first")
    try:
        return SwiftPipelineEngine(
            engine, config, cfg, ctx, model_fn=model_fn, batch_fn=batch_fn, seed=seed, engine_fn=engine_fn
        )
    except ConfigError as exc:
        # A configuration the job cannot serve, found once the engine is known: the job's own error
        # (its launcher ends the job with this line rather than replacing a sound machine).
        if ctx.store is not None:
            from ds_swift.detect.classify import record_job_error

            record_job_error(
                ctx.store, ctx.generation, dist.get_rank() if dist.is_initialized() else None, exc, early=True
            )
        raise


class SwiftPipelineEngine(CheckpointCalls, IterationInputs, EngineShutdown):
    """Wraps a DeepSpeed ``PipelineEngine``; attributes it does not define go to the engine in force."""

    _finish: int | None = None  # the iteration a partial recomputation left to step (ds_swift.recovery.state.inflight)
    _OWN = frozenset(
        {
            "_engine",
            "_ctx",
            "_batch_fn",
            "_hooks",
            "_monitor",
            "_rebuild",
            "_ckpt",
            "_timeline",
            "_recv_patch",
            "recoveries",
            "_user_iter_warned",
            "_closed",
            "_determinism",
            "_grad_scale",
            "_simulation",
            "_guard",
            "_finish",
            "_warmup",
        }
    )

    def __init__(
        self,
        engine: Any,
        config: dict[str, Any],
        cfg: SwiftConfig,
        ctx: SwiftContext,
        *,
        model_fn: Callable[[], Any] | None,
        batch_fn: BatchFn,
        seed: int,
        engine_fn: Callable[[], Any] | None,
    ) -> None:
        from ds_swift.patches.deepspeed_rebuild import patch_recv_check

        if ctx.ledger is not None:
            ctx.ledger.close()  # the start-up ends here: what follows is the same on every rank
        self._engine = engine
        self._ctx = ctx
        self._batch_fn = batch_fn
        self.recoveries: list[RecoveryOutcome] = []
        self._guard = LossGuard(cfg.verify.guard_iterations, cfg.verify.guard_loss_factor, dist.get_rank(), ctx.store)
        self._grad_scale: GradScale | None = None  # lossy forward: the next iteration's gradient scaling
        self._simulation = failure_simulation(cfg, ctx)
        if self._simulation is not None:
            self._grad_scale = self._simulation.grad_scale(engine)
        self._user_iter_warned = False
        self._closed = False
        # Message log and step-collective records, kept across rebuilds.
        logs = EngineLogging(cfg, config, batch_fn, seed, cache_dir_for(ctx.run_dir, dist.get_rank()), store=ctx.store)
        without = switched_off()  # empty but in benchmarks/gpu_overhead.py --breakdown
        logs.enabled = "logging" not in without
        on_gpu = any(p.is_cuda for p in engine.module.parameters())
        self._ckpt = checkpoint_manager(cfg, ctx, dist.get_rank(), dist.get_world_size(), services_of(cfg), gpu=on_gpu)
        self._set_origin(origin_of(engine, dist.get_rank()), publish=ctx.env is None or not ctx.env.replacement)
        self._hooks = EngineHooks(seed, make_injector(ctx), logs, without, kept_inflight(cfg, batch_fn, seed))
        self._monitor = FailureMonitor(
            ctx.store, ctx.generation, cfg.watchdog.poll_interval_s, "watchdog" not in without
        )
        check_machines(cfg, ctx.env)
        check_hang_timeout(cfg, ctx)
        if ctx.store is not None and cfg.watchdog.hang_timeout_s is not None and self._monitor.watch:
            self._hooks.progress = self._monitor.progress
        self._hooks.step_check = self._monitor.check_step
        self._timeline = PendingTimeline(ctx)
        self._warmup = WarmUp(cfg.watchdog.hang_timeout_s, dist.get_rank())
        self._rebuild = Rebuilder(
            self,
            ctx=ctx,
            cfg=cfg,
            ds_config=config,
            build=engine_fn,
            model_fn=model_fn,
            hooks=self._hooks,
            monitor=self._monitor,
            ckpt=self._ckpt,
            guard=self._guard,
        )
        self._recv_patch = patch_recv_check(self._monitor.check_after_receive)
        # Replays and retries must compute what the first run did; the user's settings return on close().
        self._determinism = ScopedDeterminism(on="determinism" not in without)
        self._hooks.install(engine)
        log_protection_costs(engine, cfg, ctx, self._rebuild.protect, self._ckpt, without, self._hooks.undo_off)
        if ctx.store is not None:
            assert ctx.env is not None
            self._monitor.start_watchdog(
                ctx.env,
                cfg.watchdog.heartbeat_timeout_s,
                watched_peers(engine),
                cfg.watchdog.hang_timeout_s,
                self._rebuild.machines,
            )
            with self._op_timeouts():
                if ctx.env.replacement:
                    self._resume(self._rebuild.as_replacement(), since=ctx.t_start)
                else:
                    self._rebuild.start_generation()  # a replacement starts it in its recovery, with the others
        if not (ctx.env is not None and ctx.env.replacement):
            self._warmup.start(self._monitor.generation, ctx.t_start, ctx.op_timeout_s, ctx.log)
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ attribute passthrough
    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the wrapper: everything DeepSpeed's engine has.
        if name.startswith("__") or name in SwiftPipelineEngine._OWN:
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SwiftPipelineEngine._OWN or name == "engine":
            object.__setattr__(self, name, value)
        else:
            # The user's own writes (``engine.x = ...`` on the wrapper) go where they would without ds-swift.
            setattr(self._engine, name, value)  # patch-seams: ok

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine in force (a new object after every recovery; None during one)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        # The rebuild drops the failed generation's engine and puts the rebuilt one here.
        object.__setattr__(self, "_engine", engine)

    @property
    def generation(self) -> int:
        return self._monitor.generation

    def _op_timeouts(self) -> AbstractContextManager[Any]:
        """ds-swift's op timeout on every process group for one of its calls, the job's own after it
        (a long evaluation or index build between calls is not a failure: ds_swift.patches.op_timeout)."""
        from ds_swift.patches.op_timeout import op_timeout_scope

        return op_timeout_scope(self._ctx.op_timeout_s, self._ctx.user_timeout, lambda: self._monitor.generation)

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Any = None) -> Any:
        """Train iteration ``global_steps``; recovers from failures before returning."""
        with self._op_timeouts():
            return self._train_batch(data_iter)

    def _train_batch(self, data_iter: Any) -> Any:
        attempts = 0
        target = int(self._engine.global_steps)
        loss = None
        while True:
            how = self._monitor.failure_seen()
            if how is None:
                engine = self._engine
                try:
                    if self._ckpt.due(int(engine.global_steps)):
                        # A recovery resumed at an iteration whose periodic checkpoint a failure cut
                        # short: every rank saves it again first (a replacement never ran the save).
                        self._save_checkpoint()
                    # After a failure in the periodic checkpoint that followed iteration ``target``,
                    # the recovery resumes after it: only the checkpoint is done again.
                    # (and always when this call trained nothing yet: it returns a trained iteration's loss)
                    if int(engine.global_steps) <= target or loss is None:
                        finishing, self._finish = self._finish == int(engine.global_steps), None
                        self._hooks.begin_iteration(finishing)
                        data = (
                            self._position(data_iter, attempts)
                            if data_iter is not None
                            else self._data_for(int(engine.global_steps))
                        )
                        if self._simulation is not None:
                            self._simulation.before(engine)
                        self._monitor.progress.arm(True)  # a hang is watched for while instructions run
                        try:
                            with self._scaled(engine), self._warmup.scope(self._ctx.op_timeout_s, self._gen):
                                loss = finish_iteration(engine) if finishing else engine.train_batch(data_iter=data)
                        finally:
                            self._monitor.progress.arm(False)
                        if self._simulation is not None and self._simulation.roll_back(engine):
                            attempts += 1  # the same mini-batch again (a plain data_iter cannot give it)
                            self._hooks.logs.restart_iteration()
                            continue
                    # Judged before the step's checkpoint: a tripped iteration's state is never saved.
                    how = self._guard.after_iteration(self._engine, loss, self._monitor.generation)
                    if how is None:
                        self._after_step()
                        return loss
                except GuardTripped:
                    raise  # the second trip: the job ends
                except Exception as exc:  # noqa: BLE001 - classified below, re-raised unless a failure
                    how = self._monitor.classify(exc, early=not self._ctx.stepped)
                finally:
                    engine = None
            attempts += 1
            if attempts > MAX_ATTEMPTS:
                raise RuntimeError(
                    f"ds-swift: {MAX_ATTEMPTS} recoveries in a row without a completed iteration (the last: {how})"
                )
            self._recover_as_survivor(how)
            self._hooks.logs.restart_iteration()  # the iteration runs again: its sends count from 0

    def _after_step(self) -> None:
        self._ctx.stepped = True
        self._warmup.stepped()
        self._rebuild.protect.iteration_done(self._engine)
        # Under a storage budget: the first iteration's messages are measured and the plan set.
        self._hooks.logs.after_iteration(self._engine, self.suspend_logging)
        if self._ckpt.after_iteration():  # an asynchronous checkpoint just completed
            self._checkpointed()
        if self._ckpt.due(int(self._engine.global_steps)):
            self._save_checkpoint()
        self._timeline.check_back(int(self._engine.global_steps))

    # ------------------------------------------------------------------ recovery
    def _recover_as_survivor(self, how: str) -> None:
        t_detect = self._monitor.begin_recovery()
        self._ckpt.on_failure()
        self._timeline.abandon()  # a new failure before the last timeline was gathered
        self._resume(self._rebuild.as_survivor(how, t_detect), since=t_detect)

    def _gen(self) -> int:
        return self._monitor.generation

    def _resume(self, done: Rejoined, since: float) -> None:
        """Training resumes after a recovery (``since``: when this rank's part of it began)."""
        self._warmup.start(done.generation, since, self._ctx.op_timeout_s, self._ctx.log)
        # The same on every rank: a checkpoint a failure cut short is saved again, by everyone.
        self._ckpt.last_saved = done.outcome.latest_checkpoint
        self._ckpt.new_generation(done.generation)
        self.recoveries.append(done.outcome)
        self._guard.after_recovery(
            self._engine,
            done.outcome,
            done.generation,
            dist.get_world_size(),
            self._ctx.join_timeout_s,
            rank=dist.get_rank(),
        )
        self._grad_scale = done.outcome.handed.get(GradScale)
        self._finish = finish.iteration if (finish := done.outcome.handed.get(FinishIteration)) else None
        self._simulation = None  # a real failure ends a simulated one
        self._timeline.start(done.outcome, done.timeline, done.generation)
        self._timeline.check_back(int(self._engine.global_steps))

    # ------------------------------------------------------------------ RecoveryHost
    def set_reseed(self, on: bool) -> None:
        self._hooks.set_reseed(on)

    def set_armed(self, on: bool) -> None:
        self._monitor.set_armed(on)

    def poison_neighbours(self) -> None:
        poison_neighbours(pipeline_neighbours(self._engine))

    def suspend_logging(self) -> Callable[[], None]:
        return self._hooks.suspend_logging(lambda: self._engine)
