"""Rejoin and rebuild: a survivor's teardown, generation g+1, the DeepSpeed rebuild, the recovery.

survivor: wake its pipeline neighbours (poison on gloo, abort on NCCL: ds_swift.transport.shutdown)
-> flush its message log -> keep module/optimizer/scheduler references -> drop the engine and end
every process group (peers blocked on us fail at once) -> leave if its own machine failed -> join
generation g+1 (and open ds-swift's transport on it) -> ``model_fn()`` +
``deepspeed.initialize`` again (the same group-creation sequence a replacement runs) -> consensus,
undo, load the kept state, send it to replacements (ds_swift.recovery.coordinator).

replacement (``SWIFT_REPLACEMENT=1``): already joined by ``init_distributed`` and built by the
user's script; it runs the same recovery protocol to receive its state.

A failure during any of this (a cascading failure) moves on to the next generation and retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from ds_swift.checkpoint.periodic import CheckpointManager
from ds_swift.config import SwiftConfig
from ds_swift.detect.classify import STALL
from ds_swift.detect.monitor import FailureMonitor
from ds_swift.detect.wake import watched_peers
from ds_swift.detect.watchdog import declare_failure
from ds_swift.jobstore.membership import GenerationFailed, read_layout, resumed_key
from ds_swift.patches.deepspeed_optim_state import is_partitioned
from ds_swift.protect.base import Site
from ds_swift.protect.protections import Protections
from ds_swift.recovery.base import MembershipChange, RankContext, RecoveryOutcome
from ds_swift.recovery.coordinator import optimizer_wrapper, rank_report, run_recovery
from ds_swift.recovery.host import RecoveryHost
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.registry import STRATEGIES, services_of
from ds_swift.recovery.timeline import RankTimeline
from ds_swift.runtime.context import SwiftContext, join_generation
from ds_swift.runtime.guard import LossGuard, forced_strategy
from ds_swift.runtime.hooks import EngineHooks
from ds_swift.runtime.swap import EngineSwap, startup_times
from ds_swift.runtime.teardown import SurvivorSteps

__all__ = ["MAX_ATTEMPTS", "EngineHolder", "Rebuilder", "Rejoined"]

#: Recoveries in a row (cascading failures) before giving up.
MAX_ATTEMPTS = 5


class EngineHolder(RecoveryHost, Protocol):
    """Where the DeepSpeed engine in force lives (the engine wrapper), and the recovery's host."""

    engine: Any


@dataclass
class Rejoined:
    """A finished recovery: its outcome, this rank's timeline of it, the generation now in force."""

    outcome: RecoveryOutcome
    timeline: RankTimeline
    generation: int


class Rebuilder(SurvivorSteps):
    """Replaces the DeepSpeed engine of ``holder`` after a failure, in-process.

    Args:
        holder: holds the engine in force (set to None on teardown, to the new engine on rebuild).
        ctx: the distributed context (job store, worker env, timeouts, backend).
        cfg: the swift config.
        ds_config: the DeepSpeed config dict the engine is built from again.
        build: builds the whole DeepSpeed engine again (``engine_fn``), or None to call
            ``model_fn()`` and ``deepspeed.initialize``.
        model_fn: builds the model again (used when ``build`` is None).
        hooks: the runtime's per-engine hooks (removed before the teardown, installed after).
        monitor: the failure monitor (moved to each generation joined).
        ckpt: the periodic checkpoints (the recovery may load one).
    """

    def __init__(
        self,
        holder: EngineHolder,
        *,
        ctx: SwiftContext,
        cfg: SwiftConfig,
        ds_config: Mapping[str, Any],
        build: Callable[[], Any] | None,
        model_fn: Callable[[], Any] | None,
        hooks: EngineHooks,
        monitor: FailureMonitor,
        ckpt: CheckpointManager,
        guard: LossGuard | None = None,
    ) -> None:
        self._holder = holder
        self._guard = guard
        self._ctx = ctx
        self._cfg = cfg
        self._ds_config = ds_config
        self._build = build
        self._model_fn = model_fn
        self._hooks = hooks
        self._monitor = monitor
        self._ckpt = ckpt
        self._op_timeout_s0 = ctx.op_timeout_s  # the configured one (a stall lengthens ctx's)
        #: whether a survivor keeps its engine through a recovery, and the swap of its groups
        self.engine_swap = EngineSwap(ctx)
        #: the membership change being recovered into (None: the failed machine is replaced)
        self.change: MembershipChange | None = None
        #: the job's machines in rank order, where the strategy may change them (ds_swift.recovery.base)
        self._machines: list[int] | None = None
        if ctx.env is not None and ctx.store is not None and services_of(cfg).elastic:
            self._machines = read_layout(ctx.store, ctx.env.num_machines)
        #: what runs while nothing fails (ds_swift.protect), built from the strategy's services
        self.protect = Protections(
            Site(
                cfg=cfg,
                services=services_of(cfg),
                ctx=ctx,
                hooks=hooks,
                engine=lambda: self._holder.engine,
                generation=lambda: self._monitor.generation,
                machine=self._machine,
                check_after_receive=monitor.check_after_receive,
                ckpt=ckpt,
                host=holder,
            )
        )

    def start_generation(self) -> None:
        """Every rank, once per generation (see :meth:`Protections.start_generation`)."""
        self.protect.start_generation()

    def build_engine(self) -> Any:
        """The DeepSpeed rebuild, on the process groups of the generation just joined."""
        import deepspeed

        if self._build is not None:
            return self._build()
        assert self._model_fn is not None
        model = self._model_fn()
        engine, *_ = deepspeed.initialize(
            model=model, config=self._ds_config, model_parameters=[p for p in model.parameters() if p.requires_grad]
        )
        return engine

    # ------------------------------------------------------------------ survivor
    def as_survivor(self, how: str, t_detect: float) -> Rejoined:
        """Tear down the failed generation, join the next one and recover into it."""
        env = self._ctx.env
        assert env is not None
        g = self._monitor.generation
        self._ctx.log(f"generation {g} failed ({how}); recovering in-process")
        tl = RankTimeline(rank=env.rank, role="survivor", failed_generation=g, t_detect=t_detect, detect_how=how)
        kept = self._tear_down()
        tl.t_torn_down = time.time()
        tl.extra["teardown_s"] = self.teardown_steps
        if (self._monitor.failure_reason(g) or "").startswith(STALL):
            self._lengthen_op_timeout()
        self._before_rejoin(g, kept)
        if self.change is not None and self.engine_swap.active:
            self._drop_kept_engine(f"{self.change.describe()}: the job changes its shape")
        elif self.engine_swap.active and self._ckpt.complete < 0:
            # Any fallback would restart from the initial state, which only a rebuilt engine holds
            # (model_fn seeds it); a kept engine holds the trained one.
            self._drop_kept_engine(
                "no global checkpoint of this job is complete yet: a fallback would restart from the initial "
                "state, which only a rebuilt engine holds"
            )
        return self.rejoin(g + 1, kept, tl)

    # ------------------------------------------------------------------ replacement
    def as_replacement(self) -> Rejoined:
        """A replacement worker (already joined and built): receive its state."""
        env = self._ctx.env
        assert env is not None
        generation = self._monitor.generation
        tl = RankTimeline(
            rank=env.rank,
            role="replacement",
            failed_generation=generation - 1,
            t_start=self._ctx.t_start,
            t_joined=self._ctx.t_joined,
            t_rebuilt=time.time(),
        )
        tl.extra["startup_s"] = startup_times(self._ctx, time.time())
        tl.extra["t_arrived"] = self._ctx.t_arrived
        self._monitor.set_armed(False)
        if services_of(self._cfg).elastic:  # a new rank of a machine the job takes back (a grow)?
            self.change = STRATEGIES.membership_change(self._cfg.strategy, self._view(generation - 1, None))
        return self.rejoin(generation, None, tl)

    # ------------------------------------------------------------------ both
    def rejoin(self, generation: int, kept: KeptState | None, tl: RankTimeline) -> Rejoined:
        """Join ``generation``, rebuild, run the recovery protocol; retries on cascading failures."""
        import deepspeed

        from ds_swift.patches.deepspeed_rebuild import teardown_process_groups

        ctx, env, store = self._ctx, self._ctx.env, self._ctx.store
        assert env is not None and store is not None
        for _ in range(MAX_ATTEMPTS):
            try:
                if not dist.is_initialized():
                    tl.extra["t_arrived"] = time.time()  # at the rendezvous (t_joined: everyone had)
                    generation = join_generation(
                        store,
                        generation,
                        env.rank,
                        env.world_size,
                        ctx.op_timeout_s,
                        ctx.join_timeout_s,
                        ctx.backend,
                        timeout=ctx.user_timeout,
                        watch=self._monitor.set_generation,
                    )
                    tl.t_joined = time.time()
                    self._monitor.set_generation(generation)
                    ctx.generation, ctx.stepped = generation, False
                    # Creating the generation's communicators waits for every member: bounded, and
                    # a peer lost meanwhile ends it by the abort (ds_swift.transport.nccl).
                    self._monitor.arm_deadline(2 * ctx.join_timeout_s, f"rebuilding generation {generation}")
                    deepspeed.init_distributed(dist_backend=ctx.backend)
                    if self.engine_swap.active:
                        tl.extra["engine_kept_s"] = self.engine_swap.swap_in(self._holder.engine)
                    else:
                        self._holder.engine = self._rebuild_engine()
                    tl.t_rebuilt = time.time()
                    self._hooks.install(self._holder.engine)
                    self._monitor.arm_deadline(None)
                tl.failed_generation = generation - 1
                outcome = self._recover(generation, kept, tl)
                break
            except (GenerationFailed, RuntimeError, TimeoutError) as exc:
                self._monitor.arm_deadline(None)
                if isinstance(exc, RuntimeError) and not isinstance(exc, GenerationFailed):
                    # Declared only on evidence (the flag, a stale heartbeat, an agreed stall), never
                    # for "gloo" or "timed out" in a message; the job's own error is raised.
                    how = self._monitor.classify(exc, generation, early=True)
                else:  # the generation failed, or a rank did not arrive within the join timeout
                    how = f"{type(exc).__name__}: {exc}"
                    declare_failure(store, generation, f"rank {env.rank}: failed during recovery: {str(exc)[:160]}")
                ctx.log(f"generation {generation} failed during recovery ({how}); joining {generation + 1}")
                self._hooks.uninstall()
                undo = self._hooks.take_undo()  # a rebuilt engine's goes with it
                if undo is not None and self.engine_swap.active:
                    undo.detach()  # a kept engine is hooked again in the next generation: its step unpatched first
                if self.engine_swap.refused is not None and self.engine_swap.active:
                    self._drop_kept_engine(self.engine_swap.refused)
                if self.engine_swap.active:
                    self.engine_swap.cut(self._holder.engine)
                else:
                    self._holder.engine = None
                held = teardown_process_groups(engine_kept=self.engine_swap.active)
                if self.engine_swap.active:
                    self.engine_swap.release(held)
                generation += 1
        else:
            raise RuntimeError(f"ds-swift: recovery failed {MAX_ATTEMPTS} times in a row")
        kept = None  # the old optimizer, its step record and g_t go now
        self.engine_swap.swap = None  # the next failure looks for the groups again
        if env.rank == 0:
            store.set(resumed_key(generation), "1")
        self.start_generation()
        self._monitor.set_generation(generation, watched_peers(self._holder.engine))
        self._monitor.set_armed(True)
        plan = outcome.plan
        # The plan is the same on every rank: its reason is said once, by rank 0 (a thousand ranks
        # printing it is a thousand copies of one paragraph).
        why = f" ({plan.reason})" if env.rank == 0 else ""
        ctx.log(f"generation {generation}: {plan.strategy}{why}; resuming at iteration {outcome.resume_iteration}")
        return Rejoined(outcome, tl, generation)

    def _rebuild_engine(self) -> Any:
        """A survivor's new engine on the generation just joined, its start-up recorded for the next
        failure's swap (ds_swift.runtime.swap)."""
        from ds_swift.patches.deepspeed_rebuild import patient_group_creation
        from ds_swift.patches.group_swap import StartupLedger

        # The groups' members include replacements still starting: wait for them as long as for
        # their join, then the op timeout applies again.
        with patient_group_creation(self._ctx.join_timeout_s, self._ctx.op_timeout_s):
            ledger = StartupLedger.start(restored=True)  # its state: the kept one
            try:
                engine = self.build_engine()
            finally:
                ledger.close()
        self._ctx.ledger = ledger
        return engine

    def _drop_kept_engine(self, why: str) -> None:
        """The survivor rebuilds its engine after all (a membership change, a failed replay)."""
        from ds_swift.patches.deepspeed_rebuild import release_megatron_groups

        trouble = self.engine_swap.drop(self._holder.engine, why)
        if trouble is not None:
            self._ctx.log(trouble + ": it may stay in memory")
        self._holder.engine = None
        release_megatron_groups()  # the rebuild initializes megatron-core's parallel state again

    def _recover(self, generation: int, kept: KeptState | None, tl: RankTimeline) -> RecoveryOutcome:
        """The recovery protocol (ds_swift.recovery.coordinator) in ``generation``, joined and rebuilt."""
        env, store = self._ctx.env, self._ctx.store
        assert env is not None and store is not None
        engine = self._holder.engine
        ctx = RankContext(
            store,
            generation,
            env.rank,
            engine,
            kept,
            self._ckpt,
            tl,
            self._ctx.join_timeout_s,
            verify=self._cfg.verify.enabled,
            lent=self.protect.lend(kept),  # what the protections kept for the strategies
        )
        rider = self._guard.rider(generation) if self._guard is not None else None
        if rider is not None:
            ctx.lent.put(rider)  # the post-recovery guard's round rides the restore round
        change, self.change = self.change, None
        if change is not None:
            self.protect.forget()  # what they held is keyed by the old ranks: the new generation starts afresh
        holdings = self.protect.holdings(kept) if change is None else {}  # before the report says whether it can undo
        return run_recovery(
            ctx,
            world_size=env.world_size,
            report=rank_report(engine, kept, self._machine(), holdings),
            strategy=forced_strategy(store, self._cfg.strategy),  # the post-recovery guard's step back
            zero_stage=int(engine.zero_optimization_stage()),
            optimizer_wrapper=optimizer_wrapper(engine),
            partitioned=is_partitioned(engine.optimizer),
            logging=self._hooks.logs.log_plan(engine),
            change=change,
        )

    @property
    def machines(self) -> list[int] | None:
        """The job's machines in rank order where an elastic shrink may change them (else None: all)."""
        return self._machines

    def _machine(self) -> int:
        env = self._ctx.env
        return env.machine if env is not None else dist.get_rank() // self._cfg.machines.gpus_per_node
