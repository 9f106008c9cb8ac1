"""A survivor's steps between a failure and joining the next generation (a mixin of
:class:`~ds_swift.runtime.rebuild.Rebuilder`, which owns the state named below).

Tear the failed engine down and keep its state; after a stall, lengthen the op timeout; take this
rank's place in the next generation's shape where the strategy changes the job's machines
(ds_swift.recovery.base), else leave the job if its own machine failed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_swift.detect.failed_machine import FailedMachine
from ds_swift.detect.wake import pipeline_neighbours, poison_neighbours
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.recovery.base import MembershipChange, MembershipRefused, MembershipView
from ds_swift.recovery.kept import KeptState, grid_of
from ds_swift.recovery.registry import STRATEGIES, services_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from ds_swift.config import SwiftConfig
    from ds_swift.detect.monitor import FailureMonitor
    from ds_swift.protect.protections import Protections
    from ds_swift.runtime.context import SwiftContext
    from ds_swift.runtime.hooks import EngineHooks
    from ds_swift.runtime.rebuild import EngineHolder
    from ds_swift.runtime.swap import EngineSwap

__all__ = ["SurvivorSteps"]


class SurvivorSteps:
    """Teardown, a longer op timeout after a stall, a membership change or leaving before the next generation."""

    # Set by Rebuilder.__init__ (annotations only).
    _holder: EngineHolder
    _ctx: SwiftContext
    _cfg: SwiftConfig
    _ds_config: Mapping[str, Any]
    _build: Callable[[], Any] | None
    _hooks: EngineHooks
    _monitor: FailureMonitor
    _op_timeout_s0: float
    change: MembershipChange | None
    _machines: list[int] | None
    protect: Protections
    engine_swap: EngineSwap
    teardown_steps: dict[str, float]

    def _tear_down(self) -> KeptState:
        from ds_swift.patches.deepspeed_rebuild import (
            release_failed_engine,
            release_process_groups,
            teardown_process_groups,
        )

        steps: list[tuple[str, float]] = []  # a slow teardown says which step was slow
        clock = [time.perf_counter()]

        def done(step: str) -> None:
            now = time.perf_counter()
            steps.append((step, now - clock[0]))
            clock[0] = now

        poison_neighbours(pipeline_neighbours(self._holder.engine))
        self.protect.quiesce()  # the message log flushed, the copier threads stopped...
        done("protections quiesced")
        self._hooks.uninstall()
        engine = self._holder.engine
        keep = self.engine_swap.find(engine)  # before the capture: it reads the groups' ranks
        done("finding the engine's process groups")
        kept = KeptState.capture(engine, self._hooks.take_undo(), engine_kept=keep)
        if services_of(self._cfg).elastic:  # the job may change its shape: a membership change plans from it
            kept.grid = grid_of(engine)
        buddy = self.protect.get(BuddyCopier)
        kept.buddy = buddy.holdings if buddy is not None else None
        done("keeping the state")
        if keep:
            self.engine_swap.cut(engine)  # the engine stays; only its groups go (ds_swift.runtime.swap)
        else:
            # Its graphs in flight and DeepSpeed's hooks would keep the whole engine (and a second copy
            # of the state) alive beside the rebuilt one; the user's script may still hold the old
            # module (or engine): cut the groups out of them.
            trouble = release_failed_engine(engine)
            if trouble is not None:
                self._ctx.log(trouble + ": it may stay in memory")
            release_process_groups(engine, engine.module, engine.optimizer)
            self._holder.engine = None
        engine = None  # noqa: F841 - the last reference: the process groups must be freed now
        done("cutting the groups out of the engine" if keep else "releasing the engine")
        held = teardown_process_groups(engine_kept=keep)
        if keep:
            self.engine_swap.release(held)  # the groups close on a thread of their own (it empties held)
        done("destroying the process groups")
        if sum(s for _, s in steps) > 5.0:
            self._ctx.log("slow teardown: " + ", ".join(f"{name} {s:.2f} s" for name, s in steps))
        self.teardown_steps = {name: round(s, 4) for name, s in steps}  # the timeline's detail
        return kept

    def _lengthen_op_timeout(self) -> None:
        """After a stall (an op timed out with every rank alive) the next generation's ops get twice
        the time, up to 4 x the configured op timeout, and below the hang timeout (a rank waiting on
        a hung peer must time out before it looks hung itself): a slow op is retried with a longer
        bound rather than timing out again. Every rank sees the same stall, so every rank does it."""
        ctx, hang = self._ctx, self._cfg.watchdog.hang_timeout_s
        limit = 4 * self._op_timeout_s0 if hang is None else min(4 * self._op_timeout_s0, 0.9 * hang)
        longer = min(2 * ctx.op_timeout_s, limit)
        if longer > ctx.op_timeout_s:
            ctx.log(f"after a stall: the op timeout goes from {ctx.op_timeout_s:g} s to {longer:g} s")
            ctx.op_timeout_s = longer

    def _before_rejoin(self, g: int, kept: KeptState | None) -> None:
        """Between the teardown and the join of generation ``g + 1``: the strategy's membership change
        (a shrink or grow of the job's machines instead of a replacement, applied here), else leave
        if this rank's own machine failed.

        A rank of the failed machine that lives on for a moment (its agent kills it within ~100 ms)
        must not join the next generation: it would be counted as arrived there and the rendezvous
        would complete without its replacement. Waiting for the agent's verdict also keeps survivors
        from joining before the agent declared (it would then fail g+1 too)."""
        store, env = self._ctx.store, self._ctx.env
        assert store is not None and env is not None
        # Also where the job's generation is moved past g, if no agent did (a declarer died half-way).
        failed_machine = FailedMachine(store, g, max(2.0, 20 * self._cfg.watchdog.poll_interval_s))
        change = STRATEGIES.membership_change(self._cfg.strategy, self._view(g, kept, failed_machine))
        if change is not None:
            failed_machine.settle()
            self._apply(change)
            return
        machine = failed_machine()
        if machine == env.machine:
            self._ctx.log(f"machine {machine} (this rank's) failed in generation {g}: leaving the job")
            os._exit(70)

    def _view(
        self, g: int, kept: KeptState | None, failed_machine: Callable[[], int | None] = lambda: None
    ) -> MembershipView:
        """What the strategy reads to decide a membership change (``kept``: a survivor's; None: a new rank)."""
        store, env = self._ctx.store, self._ctx.env
        assert store is not None and env is not None
        return MembershipView(
            store=store,
            generation=g,
            env=env,
            cfg=self._cfg,
            ds_config=self._ds_config,
            kept=kept,
            machines=self._machines,
            failed_machine=failed_machine,
            join_timeout_s=self._ctx.join_timeout_s,
            log=self._ctx.log,
        )

    def _apply(self, change: MembershipChange) -> None:
        """The next generation has another shape (``change``): this rank's rank and world in it, the
        DeepSpeed config its engine is built from, the watchdog on its ranks."""
        env, cfg = self._ctx.env, self._cfg
        assert env is not None
        if self._build is not None:
            raise MembershipRefused(
                f"strategy {change.strategy!r} ({change.describe()}): ds-swift rebuilds the engine at the new "
                "shape from the DeepSpeed config; pass model_fn to ds_swift.initialize, not engine_fn"
            )
        self.change, self._machines, self._ds_config = change, change.machines, change.ds_config
        self._ctx.env = env = dataclasses.replace(env, rank=change.rank, world_size=change.world)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
        self._monitor.stop()
        self._monitor.start_watchdog(
            env, cfg.watchdog.heartbeat_timeout_s, (), cfg.watchdog.hang_timeout_s, change.machines
        )
