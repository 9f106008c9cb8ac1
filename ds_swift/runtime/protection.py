"""What runs while nothing fails: the configured strategy's services
(:class:`~ds_swift.recovery.services.StrategyServices`), made for the engine in force.

buddy copies of each rank's optimizer partition (or PipeChurn's erasure-coded chunks of its whole
state, ds_swift.runtime.buddy), state digests (ds_swift.runtime.digest) and the update log
(ds_swift.runtime.update_logging): each is made here from the strategy's services, never from its
name, and hooked into each generation's engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ds_swift.config import SwiftConfig
from ds_swift.jobstore.membership import JobStore
from ds_swift.patches.deepspeed_optim_state import is_partitioned
from ds_swift.plan.buddy_cost import copies_kept
from ds_swift.recovery.consensus import RankReport
from ds_swift.runtime.buddy import BuddyCopier, BuddyHoldings, StoreLanding
from ds_swift.runtime.context import SwiftContext
from ds_swift.runtime.digest import DigestPublisher
from ds_swift.runtime.hooks import EngineHooks
from ds_swift.runtime.update_logging import UpdateLogger

__all__ = ["Protections", "partition_copies"]


class Protections:
    """The failure-free services of one rank.

    Args:
        engine: the engine in force (None during a rebuild).
        ctx: the distributed context.
        cfg: the swift config (its ``services``, and the sub-sections they read).
        hooks: the runtime's per-engine hooks (each service hooks the optimizer step there).
        generation: the generation in force.
        check_after_receive: raises where the generation failed while a copy was received.
        machine: this rank's machine.
    """

    def __init__(
        self,
        engine: Callable[[], Any],
        *,
        ctx: SwiftContext,
        cfg: SwiftConfig,
        hooks: EngineHooks,
        generation: Callable[[], int],
        check_after_receive: Callable[[], None],
        machine: Callable[[], int],
    ) -> None:
        self._engine, self._ctx, self._cfg, self._hooks = engine, ctx, cfg, hooks
        self._generation, self._check_after_receive, self._machine = generation, check_after_receive, machine
        services = cfg.services
        self.buddy: BuddyCopier | None = None
        if services.erasure_chunks:  # the same copier, sending erasure-coded chunks
            erasure = (cfg.pipechurn.data_chunks, cfg.pipechurn.parity_chunks)
            self.buddy = BuddyCopier(
                1, cfg.machines.failure_domains, erasure=erasure, land_timeout_s=_land_timeout_s(cfg, ctx)
            )
        elif cfg.buddy.enabled and services.buddy_copies:
            self.buddy = BuddyCopier(
                cfg.buddy.replication_factor,
                cfg.machines.failure_domains,
                interval=cfg.buddy.fixed_interval,
                land_timeout_s=_land_timeout_s(cfg, ctx),
            )
        elif cfg.buddy.enabled and (ctx.env is None or ctx.env.rank == 0):
            # A strategy that never reads buddy copies does not pay for them.
            ctx.log(f"buddy copies off: strategy {cfg.strategy!r} does not use them (set strategy auto to use them)")
        # Published digests check what is rebuilt without a donor (a replay, re-applied updates, a
        # state decoded from chunks), and what a donor sends (replication, buddy copies: the donor's
        # digest proves the transport, the lost rank's own the copy) or an elastic resize reshards.
        env = ctx.env
        self.digests = (
            DigestPublisher(env.rank, cfg.verify.digest_interval, lambda: JobStore.from_env(env))
            if cfg.verify.enabled and services.digests and env is not None and ctx.store is not None
            else None
        )
        # The update log: every rank's update after each step (TranLogs); under a per-stage mix
        # (logging.kinds) only the ranks of the stages the logging plan has log theirs.
        self.updates = (
            UpdateLogger(
                env.rank if env is not None else dist.get_rank(),
                cfg.logging.storage,
                lambda: hooks.undo,
                enabled=self._logs_updates if services.update_log == "per_stage" else None,
                hang_timeout_s=cfg.watchdog.hang_timeout_s,
            )
            if services.update_log != "off"
            else None
        )
        hooks.logs.updates = self.updates

    def _logs_updates(self) -> bool:
        engine = self._engine()
        return engine is not None and self._hooks.logs.logs_updates(engine)

    def start_generation(self) -> None:
        """Every rank, once per generation, at the same point (after generation 0's build, after each
        recovery, never during one): buddy copies, state digests and update logging of the engine in force."""
        from ds_swift.patches.instructions import hook_instructions

        self.start_buddy()
        if self.digests is not None:
            self._hooks.add(hook_instructions(self._engine(), "ds_swift.digest", self.digests.hooks()))
        if self.updates is not None:
            self._hooks.add(hook_instructions(self._engine(), "ds_swift.updates", self.updates.hooks()))

    def after_checkpoint(self, done: int) -> None:
        """A global checkpoint of ``done`` iterations is complete: update records before it go."""
        if self.updates is not None:
            self.updates.gc_before(done)

    def start_buddy(self) -> None:
        """Every rank, once per generation, at the same point (after generation 0's build, after each
        recovery): start copying this rank's optimizer partition to its buddies after every step."""
        from ds_swift.patches.instructions import hook_instructions, schedule

        engine, buddy, env = self._engine(), self.buddy, self._ctx.env
        if buddy is None or env is None:
            return
        generation = self._generation()

        def landing(world: int) -> StoreLanding:
            return StoreLanding(JobStore.from_env(env), generation, world, timeout_s=buddy.land_timeout_s)

        if not buddy.start(engine, self._machine(), landing if self._ctx.store is not None else None):
            return

        def step(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            buddy.before_step(self._check_after_receive)
            out = call_next(**kw)
            buddy.after_step(eng)
            return out

        hooks = {schedule.OptimizerStep: step}
        self._hooks.add(hook_instructions(engine, "ds_swift.buddy", hooks))

    def quiesce(self) -> None:
        """Before the teardown: the copier stops; the last digest and update records finish (or are said lost)."""
        if self.buddy is not None:
            self.buddy.stop()
        if self.digests is not None and not self.digests.wait(self._ctx.op_timeout_s):
            self._ctx.log("the state digest of the last step did not finish before the teardown")
        if self.updates is not None and not self.updates.flush(self._ctx.op_timeout_s):
            self._ctx.log("the update records of the last steps were not all stored before the teardown")

    def holdings(self) -> BuddyHoldings | None:
        """The copies this rank holds for its buddies (a survivor keeps them across the rebuild)."""
        return self.buddy.holdings if self.buddy is not None else None

    def forget_holdings(self) -> None:
        """After an elastic resize: copies keyed by the old ranks; the new generation copies afresh."""
        if self.buddy is not None:
            self.buddy.holdings = BuddyHoldings()

    def report(self, report: RankReport) -> RankReport:
        """``report`` with the copies or chunks this rank holds for the consensus."""
        if self.buddy is None:
            return report
        if self.buddy.erasure is not None:
            return dataclasses.replace(
                report, ec_chunks=self.buddy.holdings.chunks(), ec_k=self._cfg.pipechurn.data_chunks
            )
        return dataclasses.replace(report, buddy_copies=self.buddy.holdings.copies())


def partition_copies(cfg: SwiftConfig, engine: Any) -> bool:
    """Whether the copier :class:`Protections` starts keeps every rank's optimizer state on other
    machines (buddy copies of a partitioned state, or PipeChurn's chunks): the topology analyzer then
    logs nothing for a stage those copies restore (ds_swift.plan.analysis.analyze)."""
    return copies_kept(cfg, is_partitioned(getattr(engine, "optimizer", None)))


def _land_timeout_s(cfg: SwiftConfig, ctx: SwiftContext) -> float:
    """How long a step waits for the previous buddy round to land: the round's transfers are bounded by
    the op timeout and its store round by as much again; under the hang timeout, which the step is
    inside (a lost round turns copying off, it never makes this healthy rank look hung)."""
    land = 2 * ctx.op_timeout_s
    hang = cfg.watchdog.hang_timeout_s
    return land if hang is None else min(land, 0.9 * hang)
