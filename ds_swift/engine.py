"""SwiftPipelineEngine: a DeepSpeed PipelineEngine that survives machine failures in-process.

User code changes two lines (see ``examples/pretrain_gpt.py``)::

    ds_swift.init_distributed(ds_config)           # instead of deepspeed.init_distributed()
    engine, *_ = deepspeed.initialize(model=model_fn(), config=ds_config, model_parameters=...)
    engine = ds_swift.initialize(engine, ds_config, model_fn=model_fn, batch_fn=batch_fn)
    while engine.global_steps < train_iters:
        loss = engine.train_batch()

The wrapper passes every other attribute through to the DeepSpeed engine in force. When a
generation fails, ``train_batch`` does not return until the job is whole again:

survivor: comm error or failure flag -> declare it (first rank) -> poison its pipeline
neighbours -> keep module/optimizer/scheduler references -> drop the engine and destroy every
process group (peers blocked on us fail at once) -> join generation g+1 -> ``model_fn()`` +
``deepspeed.initialize`` again (the same group-creation sequence a replacement runs) -> consensus,
undo, load the kept state, send it to replacements (ds_swift.recovery.coordinator) -> train on.

replacement (``SWIFT_REPLACEMENT=1``): ``initialize`` itself runs the same consensus and receives
its state before returning, so the user's loop simply continues at ``engine.global_steps``.

Where the topology plan logs pipeline sends across machines (logging-based recovery), every rank
also records its optimizer step's pipeline-wide collectives (``CollectiveRecorder``, kept across
rebuilds); a survivor flushes and uploads its message log before its teardown; and a lost stage
without a replica is restored by replaying it from the last global checkpoint and the log
(ds_swift.recovery.logging_recovery) while the survivors keep their state.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.checkpoint import CheckpointManager
from ds_swift.config import SwiftConfig, load_ds_config
from ds_swift.data import BatchFn, global_micro_batch, micro_batches, rng_seed
from ds_swift.distributed import SwiftContext, current_context, join_generation
from ds_swift.engine_logging import EngineLogging, cache_dir_for
from ds_swift.membership import GenerationFailed, JobStore
from ds_swift.recovery.coordinator import KeptState, RecoveryOutcome, optimizer_wrapper, rank_report, run_recovery
from ds_swift.timeline import RankTimeline, collect_timeline
from ds_swift.watchdog import Watchdog, declare_failure, ensure_generation_moved, wait_failed_machine

__all__ = ["PeerFailure", "SwiftPipelineEngine", "initialize"]

#: Substrings of the errors gloo/NCCL raise when a peer died or an op timed out.
_COMM_ERROR_MARKERS = (
    "Connection closed",
    "Connection reset",
    "Connection refused",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket Timeout",
    "pair.cc",
    "NCCL",
    "gloo",
)
#: Recoveries in a row (cascading failures) before giving up.
_MAX_ATTEMPTS = 5


class PeerFailure(RuntimeError):
    """Raised after a receive when the generation has failed (the data may be a poison message)."""


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, PeerFailure):
        return True
    if not isinstance(exc, RuntimeError | OSError | dist.DistError):
        return False
    text = str(exc)
    return any(m in text for m in _COMM_ERROR_MARKERS)


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
        batch_fn: ``batch_fn(iteration, micro_batch) -> (inputs, labels)``; see ds_swift.data.
        seed: keys the per-forward RNG reseeding (seed, iteration, micro-batch, stage).
        engine_fn: builds the whole DeepSpeed engine again instead of ``model_fn`` +
            ``deepspeed.initialize(model, config=ds_config)`` (for custom optimizers or schedulers).
    """
    if ds_config is None:
        raise ValueError("ds_swift.initialize needs the DeepSpeed config (dict or path) with its swift section")
    config = load_ds_config(ds_config)
    cfg = SwiftConfig.from_ds_config(config)
    if not cfg.enabled:
        return engine
    if model_fn is None and engine_fn is None:
        raise ValueError("ds_swift.initialize needs model_fn (or engine_fn) to rebuild the engine after a failure")
    if batch_fn is None:
        raise ValueError("ds_swift.initialize needs batch_fn(iteration, micro_batch) so a resumed rank reads the right data")
    ctx = current_context()
    if ctx is None:
        raise RuntimeError("call ds_swift.init_distributed(ds_config) instead of deepspeed.init_distributed() first")
    return SwiftPipelineEngine(engine, config, cfg, ctx, model_fn=model_fn, batch_fn=batch_fn, seed=seed, engine_fn=engine_fn)


class SwiftPipelineEngine:
    """Wraps a DeepSpeed ``PipelineEngine``; attributes it does not define go to the engine in force."""

    _OWN = frozenset(
        {
            "_engine", "_config", "_cfg", "_ctx", "_model_fn", "_batch_fn", "_seed", "_engine_fn", "_handles",
            "_undo", "_watchdog", "_ckpt", "_injector", "_micro", "_recv_patch", "_pending", "_generation",
            "recoveries", "_user_iter_warned", "_closed", "_armed", "_logs", "_reseed",
        }
    )  # fmt: skip

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

        self._engine = engine
        self._config = config
        self._cfg = cfg
        self._ctx = ctx
        self._model_fn = model_fn
        self._batch_fn = batch_fn
        self._seed = seed
        self._engine_fn = engine_fn
        self._handles: list[Any] = []
        self._undo: Any = None
        self._micro = 0
        self._pending: tuple[RecoveryOutcome, RankTimeline, int] | None = None
        self._generation = ctx.generation
        self.recoveries: list[RecoveryOutcome] = []
        self._user_iter_warned = False
        self._closed = False
        self._armed = True  # the recv check applies to the generation in force, not during a recovery
        self._reseed = True  # the forward hook reseeds (off while a replay keys the RNG itself)
        self._logs = EngineLogging(
            cfg, config, batch_fn, seed, cache_dir_for(ctx.run_dir, dist.get_rank()), self._log
        )  # message log and step-collective records, kept across rebuilds
        self._ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.interval, dist.get_rank())
        self._injector = self._make_injector()
        self._watchdog: Watchdog | None = None
        self._recv_patch = patch_recv_check(self._check_failed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        self._install(engine)
        if ctx.store is not None:
            env = ctx.env
            assert env is not None
            self._watchdog = Watchdog(
                lambda: JobStore.from_env(env),
                env.rank,
                self._generation,
                cfg.watchdog.poll_interval_s,
                cfg.watchdog.heartbeat_timeout_s,
                self._peers(),
            ).start()
            if env.replacement:
                self._recover_as_replacement()
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ attribute passthrough
    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the wrapper: everything DeepSpeed's engine has.
        if name.startswith("__") or name in SwiftPipelineEngine._OWN:
            raise AttributeError(name)
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in SwiftPipelineEngine._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine in force (a new object after every recovery)."""
        return self._engine

    @property
    def generation(self) -> int:
        return self._generation

    # ------------------------------------------------------------------ training
    def train_batch(self, data_iter: Any = None) -> Any:
        """Train iteration ``global_steps``; recovers from failures before returning."""
        if data_iter is not None and not self._user_iter_warned:
            self._user_iter_warned = True
            self._log("train_batch(data_iter) given: after a recovery the iterator cannot be rewound; use batch_fn")
        attempts = 0
        target = int(self._engine.global_steps)
        loss = None
        while True:
            how = self._failure_seen()
            if how is None:
                engine = self._engine
                try:
                    if self._ckpt.due(int(engine.global_steps)):
                        # A recovery resumed at an iteration whose periodic checkpoint a failure cut
                        # short: every rank saves it again first (a replacement never ran the save).
                        self._save_checkpoint()
                    # After a failure in the periodic checkpoint that followed iteration ``target``,
                    # the recovery resumes after it: only the checkpoint is done again.
                    if int(engine.global_steps) <= target:
                        self._micro = 0
                        data = data_iter if data_iter is not None else self._data_for(int(engine.global_steps))
                        loss = engine.train_batch(data_iter=data)
                    self._after_step()
                    return loss
                except Exception as exc:  # noqa: BLE001 - classified below, re-raised unless a failure
                    how = self._classify(exc)
                finally:
                    engine = None
            attempts += 1
            if attempts > _MAX_ATTEMPTS:
                raise RuntimeError(f"ds-swift: {_MAX_ATTEMPTS} recoveries in a row without a completed iteration")
            self._recover_as_survivor(how)
            self._logs.restart_iteration()  # the iteration runs again: its sends count from 0

    def _data_for(self, iteration: int) -> Any:
        e = self._engine
        return micro_batches(self._batch_fn, iteration, e.grid.get_data_parallel_id(), e.gradient_accumulation_steps())

    def _after_step(self) -> None:
        if self._ckpt.due(int(self._engine.global_steps)):
            self._save_checkpoint()
        self._check_back()

    def _save_checkpoint(self) -> None:
        self._ckpt.save(self._engine)
        self._logs.after_checkpoint(self._ckpt.ckpt_dir)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        """DeepSpeed's ``save_checkpoint``, protected: a failure during the save is recovered from,
        the iterations lost to it are trained again, and the save is retried."""
        target = int(self._engine.global_steps)
        for _ in range(_MAX_ATTEMPTS):
            how = self._failure_seen()
            if how is None:
                try:
                    return self._engine.save_checkpoint(
                        save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs
                    )
                except Exception as exc:  # noqa: BLE001 - classified, re-raised unless a failure
                    how = self._classify(exc)
            self._recover_as_survivor(how)
            while int(self._engine.global_steps) < target:
                self.train_batch()
        raise RuntimeError(f"ds-swift: save_checkpoint failed {_MAX_ATTEMPTS} times in a row")

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - at interpreter exit the job store may be gone already
            self._log(f"closing at exit: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the watchdog and remove the hooks (the engine stays usable, unprotected)."""
        if self._closed:
            return
        self._closed = True
        env, store = self._ctx.env, self._ctx.store
        if self._pending is not None and env is not None and env.rank == 0:
            self._finish_timeline(block=True)
        if self._watchdog is not None:
            self._watchdog.stop()
        if store is not None and env is not None:
            store.mark_done(env.rank)
        self._uninstall()
        self._recv_patch.remove()

    # ------------------------------------------------------------------ per-engine hooks
    def _install(self, engine: Any) -> None:
        from ds_swift.patches.instructions import hook_instructions, schedule

        def phase_hook(phase: str) -> Callable[..., Any]:
            def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
                if self._injector is not None:
                    self._injector.maybe_fire(phase, int(eng.global_steps))
                return call_next(**kw)

            return hook

        def forward(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            # Dropout & co. depend only on the micro-batch's position, never on what ran before.
            if self._reseed:
                mb = global_micro_batch(eng.grid.get_data_parallel_id(), eng.gradient_accumulation_steps(), self._micro)
                torch.manual_seed(rng_seed(self._seed, int(eng.global_steps), mb, eng.stage_id))
            self._micro += 1
            if self._injector is not None:
                self._injector.maybe_fire("forward", int(eng.global_steps))
            return call_next(**kw)

        hooks = {
            schedule.ForwardPass: forward,
            schedule.BackwardPass: phase_hook("backward"),
            schedule.OptimizerStep: phase_hook("step"),
            schedule.SendActivation: phase_hook("send"),
            schedule.SendGrad: phase_hook("send"),
            schedule.RecvActivation: phase_hook("recv"),
            schedule.RecvGrad: phase_hook("recv"),
        }
        # Undo first: its step patch replaces the engine's instruction map instead of wrapping the
        # one in force, so hooks installed before it would be lost.
        self._undo = self._attach_undo(engine)
        self._logs.attach_recorder(engine, self._handles)
        self._handles.append(hook_instructions(engine, "ds_swift.runtime", hooks))
        self._logs.attach_log(engine, self._handles)

    def _uninstall(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._logs.detached()

    def _attach_undo(self, engine: Any) -> Any:
        try:
            from ds_swift.undo import attach_to_engine
        except ImportError:
            return None
        try:
            return attach_to_engine(engine)
        except ImportError:
            return None  # ds_swift.undo.engine not built yet: recovery without undo falls back loudly
        except Exception as exc:  # noqa: BLE001 - an optimizer without an inverse must not stop training
            self._log(f"update-undo unavailable for this optimizer ({exc}); a survivor ahead will force a checkpoint reload")
            return None

    def _make_injector(self) -> Any:
        env, store = self._ctx.env, self._ctx.store
        if env is None or store is None or not env.inject:
            return None
        from ds_swift.testing.faults import Injector

        return Injector.from_env(store, env)

    def _peers(self) -> list[int]:
        e = self._engine
        peers = [r for r in (self._neighbour(e, -1), self._neighbour(e, +1)) if r is not None]
        return peers

    @staticmethod
    def _neighbour(engine: Any, delta: int) -> int | None:
        stage = engine.stage_id + delta
        if 0 <= stage < engine.num_stages:
            return int(engine.grid.stage_to_global(stage_id=stage))
        return None

    # ------------------------------------------------------------------ failure detection
    def _check_failed(self) -> None:
        """After every pipeline receive: raise if the generation failed (the buffer may be poison)."""
        if not self._armed:
            return
        wd, store = self._watchdog, self._ctx.store
        if wd is not None and wd.failed.is_set():
            raise PeerFailure(f"generation {self._generation} failed (watchdog)")
        if store is not None:
            reason = store.failure(self._generation)
            if reason is not None:
                raise PeerFailure(f"generation {self._generation} failed: {reason}")

    def _failure_seen(self) -> str | None:
        if self._ctx.store is None:
            return None
        wd = self._watchdog
        if wd is not None and wd.failed.is_set():
            return "failure flag (watchdog)"
        if self._ctx.store.failure(self._generation) is not None:
            return "failure flag"
        return None

    def _classify(self, exc: BaseException) -> str:
        store = self._ctx.store
        if store is None:
            raise exc  # no job store, no recovery: fail as DeepSpeed alone would
        if store.failure(self._generation) is not None:
            return f"{type(exc).__name__} after the failure flag"
        if _is_comm_error(exc):
            # Let the node agent speak first: a dead peer is usually seen by its agent within
            # ~100 ms, and the rank that sees it first may be that peer's machine-mate, about to
            # be killed mid-declaration (which would leave a half-written failure record).
            deadline = time.monotonic() + max(0.5, 5 * self._cfg.watchdog.poll_interval_s)
            while time.monotonic() < deadline:
                if store.failure(self._generation) is not None:
                    return f"comm error, failure declared: {str(exc)[:120]}"
                time.sleep(0.01)
            first = declare_failure(store, self._generation, f"rank {dist.get_rank()}: {type(exc).__name__}: {str(exc)[:200]}")
            return f"comm error ({'declared' if first else 'already declared'}): {str(exc)[:120]}"
        raise exc

    # ------------------------------------------------------------------ recovery
    def _log(self, msg: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else (self._ctx.env.rank if self._ctx.env else -1)
        print(f"[ds-swift] rank {rank}: {msg}", file=sys.stderr, flush=True)

    def _machine(self) -> int:
        env = self._ctx.env
        return env.machine if env is not None else dist.get_rank() // self._cfg.machines.gpus_per_node

    def _poison_neighbours(self) -> None:
        """Wake pipeline neighbours blocked in a recv from us (they then see the flag and raise).

        Gloo completes a send only once the peer receives, so we do not wait long: a neighbour
        that is not receiving gets "connection closed" from the teardown that follows instead.
        """
        works = []
        for peer in self._peers():
            try:
                work = dist.isend(torch.zeros(1), peer)
                if work is not None:
                    works.append(work)
            except Exception:  # noqa: BLE001, S110 - a dead peer cannot be woken and needs no waking
                pass
        deadline = time.monotonic() + 0.02
        for w in works:
            try:
                while not w.is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
            except Exception:  # noqa: BLE001, S110
                pass

    def _rebuild(self) -> Any:
        import deepspeed

        if self._engine_fn is not None:
            return self._engine_fn()
        assert self._model_fn is not None
        model = self._model_fn()
        engine, *_ = deepspeed.initialize(
            model=model, config=self._config, model_parameters=[p for p in model.parameters() if p.requires_grad]
        )
        return engine

    def _recover_as_survivor(self, how: str) -> None:
        from ds_swift.patches.deepspeed_rebuild import release_process_groups, teardown_process_groups

        store = self._ctx.store
        assert store is not None and self._ctx.env is not None
        g = self._generation
        seen = self._watchdog.seen if self._watchdog is not None else None
        t_detect = min(time.time(), seen.t_seen) if seen is not None else time.time()
        self._armed = False
        ensure_generation_moved(store, g)
        if self._pending is not None:
            # A new failure before the last recovery's timeline was gathered: write what is there.
            if self._ctx.env.rank == 0:
                self._finish_timeline(block=False)
            self._pending = None
        self._log(f"generation {g} failed ({how}); recovering in-process")
        tl = RankTimeline(rank=self._ctx.env.rank, role="survivor", failed_generation=g, t_detect=t_detect, detect_how=how)
        self._poison_neighbours()
        self._logs.flush()
        self._uninstall()
        engine = self._engine
        kept = KeptState.capture(engine, self._undo)
        # The user's script may still hold the old module (or engine): cut the groups out of them.
        release_process_groups(engine, engine.module, engine.optimizer)
        self._engine = None
        self._undo = None
        engine = None  # noqa: F841 - the last reference: the process groups must be freed now
        teardown_process_groups()
        tl.t_torn_down = time.time()
        self._leave_if_my_machine_failed(g)
        self._rejoin(g + 1, kept, tl)

    def _leave_if_my_machine_failed(self, g: int) -> None:
        """A rank of the failed machine that lives on for a moment (its agent kills it within
        ~100 ms) must not join the next generation: it would be counted as arrived there and the
        rendezvous would complete without its replacement. Waiting for the agent's verdict also
        keeps survivors from joining before the agent declared (it would then fail g+1 too)."""
        store, env = self._ctx.store, self._ctx.env
        assert store is not None and env is not None
        machine = wait_failed_machine(store, g, max(2.0, 20 * self._cfg.watchdog.poll_interval_s))
        if machine == env.machine:
            self._log(f"machine {machine} (this rank's) failed in generation {g}: leaving the job")
            os._exit(70)

    def _rejoin(self, generation: int, kept: KeptState | None, tl: RankTimeline) -> None:
        """Join ``generation``, rebuild, run the recovery protocol; retries on cascading failures."""
        import deepspeed

        from ds_swift.patches.deepspeed_rebuild import teardown_process_groups

        ctx, env, store = self._ctx, self._ctx.env, self._ctx.store
        assert env is not None and store is not None
        for _ in range(_MAX_ATTEMPTS):
            try:
                if not dist.is_initialized():
                    generation = join_generation(
                        store, generation, env.rank, env.world_size, ctx.op_timeout_s, ctx.join_timeout_s, ctx.backend,
                        log=self._log,
                    )
                    tl.t_joined = time.time()
                    if self._watchdog is not None:
                        self._watchdog.set_generation(generation)
                    deepspeed.init_distributed(dist_backend=ctx.backend)
                    self._engine = self._rebuild()
                    tl.t_rebuilt = time.time()
                    self._install(self._engine)
                self._generation = generation
                tl.failed_generation = generation - 1
                outcome = run_recovery(
                    store=store,
                    generation=generation,
                    rank=env.rank,
                    world_size=env.world_size,
                    engine=self._engine,
                    report=rank_report(self._engine, kept, self._machine()),
                    kept=kept,
                    strategy=self._cfg.strategy,
                    zero_stage=int(self._engine.zero_optimization_stage()),
                    optimizer_wrapper=optimizer_wrapper(self._engine),
                    ckpt=self._ckpt,
                    timeline=tl,
                    gather_timeout_s=ctx.join_timeout_s,
                    log=self._log,
                    logging=self._logs.log_plan(
                        self._engine, kept is not None,
                        set_reseed=lambda on: setattr(self, "_reseed", on),
                        set_armed=lambda on: setattr(self, "_armed", on),
                        poison=self._poison_neighbours,
                        suspend_logging=lambda: self._logs.suspend(self._handles, lambda: self._engine),
                    ),  # fmt: skip
                )
                break
            except (GenerationFailed, RuntimeError, TimeoutError) as exc:
                if isinstance(exc, RuntimeError) and not isinstance(exc, GenerationFailed) and not _is_comm_error(exc):
                    raise
                self._log(f"generation {generation} failed during recovery ({exc}); joining {generation + 1}")
                declare_failure(store, generation, f"rank {env.rank}: failed during recovery: {str(exc)[:160]}")
                self._uninstall()
                self._engine = None
                self._undo = None
                teardown_process_groups()
                generation += 1
        else:
            raise RuntimeError(f"ds-swift: recovery failed {_MAX_ATTEMPTS} times in a row")
        kept = None  # the old optimizer, its step record and g_t go now
        # The same on every rank: a checkpoint a failure cut short is saved again, by everyone.
        self._ckpt.last_saved = outcome.latest_checkpoint
        self.recoveries.append(outcome)
        if self._watchdog is not None:
            self._watchdog.set_generation(generation, self._peers())
        self._armed = True
        self._pending = (outcome, tl, generation)
        plan = outcome.plan
        self._log(
            f"generation {generation}: {plan.strategy} ({plan.reason}); resuming at iteration {outcome.resume_iteration}"
        )
        self._check_back()

    def _recover_as_replacement(self) -> None:
        env = self._ctx.env
        assert env is not None
        now = time.time()
        tl = RankTimeline(
            rank=env.rank,
            role="replacement",
            failed_generation=self._generation - 1,
            t_start=self._ctx.t_start,
            t_joined=self._ctx.t_joined,
            t_rebuilt=now,
        )
        self._armed = False
        self._rejoin(self._generation, None, tl)

    # ------------------------------------------------------------------ timeline
    def _check_back(self) -> None:
        if self._pending is None:
            return
        outcome, tl, generation = self._pending
        store = self._ctx.store
        assert store is not None
        if tl.t_back is None and int(self._engine.global_steps) >= outcome.plan.pre_failure_iteration:
            tl.t_back = time.time()
            store.publish(generation, "timeline", tl.rank, tl.to_json())
        if tl.t_back is not None:
            if dist.get_rank() != 0 or self._finish_timeline(block=False):
                self._pending = None

    def _finish_timeline(self, block: bool) -> bool:
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
            replay=outcome.replay,
            block=block,
            log=self._log,
        )
