"""A survivor's steps between a failure and joining the next generation (a mixin of
:class:`~ds_swift.runtime.rebuild.Rebuilder`, which owns the state named below).

Tear the failed engine down and keep its state; after a stall, lengthen the op timeout; leave the
job if its own machine failed; with ``elastic`` in the strategy's services, take this rank's place
in a shrunk or grown world (ds_swift.recovery.strategies.resize).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_swift.detect.wake import pipeline_neighbours, poison_neighbours
from ds_swift.detect.watchdog import wait_failed_machine
from ds_swift.jobstore.membership import fate_key, grow_key, read_layout
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.registry import services_of
from ds_swift.recovery.strategies.resize import Resize, ResizeRefused, grid_of, plan_resize, resized_ds_config

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
    """Teardown, a longer op timeout after a stall, leaving or resizing before the next generation."""

    # Set by Rebuilder.__init__ (annotations only).
    _holder: EngineHolder
    _ctx: SwiftContext
    _cfg: SwiftConfig
    _ds_config: Mapping[str, Any]
    _build: Callable[[], Any] | None
    _hooks: EngineHooks
    _monitor: FailureMonitor
    _op_timeout_s0: float
    resize: Resize | None
    _old_grid: tuple[tuple[tuple[int, int, int], ...], int, int, bool] | None
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
        self._hooks.logs.flush()
        done("message log flush")
        self.protect.quiesce()
        done("copier threads")
        self._hooks.uninstall()
        engine = self._holder.engine
        if services_of(self._cfg).elastic:
            self._old_grid = grid_of(engine)
        if self._hooks.inflight is not None:  # the gradients of the passes that ran, before they go
            self._hooks.inflight.on_teardown(engine)
        keep = self.engine_swap.find(engine)  # before the capture: it reads the groups' ranks
        kept = KeptState.capture(engine, self._hooks.take_undo(), engine_kept=keep)
        kept.buddy = self.protect.holdings()
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
        done("keeping the state")
        teardown_process_groups(engine_kept=keep)
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

    def _leave_if_my_machine_failed(self, g: int) -> None:
        """A rank of the failed machine that lives on for a moment (its agent kills it within
        ~100 ms) must not join the next generation: it would be counted as arrived there and the
        rendezvous would complete without its replacement. Waiting for the agent's verdict also
        keeps survivors from joining before the agent declared (it would then fail g+1 too)."""
        store, env = self._ctx.store, self._ctx.env
        assert store is not None and env is not None
        if services_of(self._cfg).elastic:
            back = store.get(grow_key(g))
            if back is not None:  # not a failure: a machine came back (its agent set the key first)
                self._resize(g, "grow", int(back))
                return
        machine = wait_failed_machine(store, g, max(2.0, 20 * self._cfg.watchdog.poll_interval_s))
        if machine == env.machine:
            self._ctx.log(f"machine {machine} (this rank's) failed in generation {g}: leaving the job")
            os._exit(70)
        if machine is not None and services_of(self._cfg).elastic:
            fate = store.wait_value(fate_key(g, machine), self._ctx.join_timeout_s)
            if fate == "shrink":
                self._resize(g, "shrink", machine)
            elif fate is None:
                self._ctx.log(
                    f"the launcher did not say within {self._ctx.join_timeout_s:g} s what becomes of "
                    f"machine {machine}: waiting for its replacement"
                )

    def _resize(self, g: int, kind: str, machine: int) -> None:
        """The launcher goes on without ``machine`` (a shrink: no spare left, ``--elastic``) or takes it
        back (a grow): this rank's place in the new world, the DeepSpeed config with its batch, the
        watchdog on the new ranks."""
        store, env, cfg = self._ctx.store, self._ctx.env, self._cfg
        assert store is not None and env is not None and self._machines is not None and self._old_grid is not None
        if self._build is not None:
            raise ResizeRefused(
                f"strategy {cfg.strategy!r}: ds-swift rebuilds the engine with another data-parallel size "
                "from the DeepSpeed config; pass model_fn to ds_swift.initialize, not engine_fn"
            )
        layout = read_layout(store, env.num_machines)
        resize = plan_resize(kind, machine, self._machines, layout, self._old_grid, cfg.elastic, env.rank)
        rank = resize.new_rank_of(env.rank)
        assert rank is not None  # this rank's machine is in the new layout
        self._ctx.log(resize.describe() + f"; rank {env.rank} -> {rank}")
        self.resize, self._machines = resize, layout
        self._ctx.env = env = dataclasses.replace(env, rank=rank, world_size=resize.new_world)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.rank), str(env.world_size)
        self._ds_config = resized_ds_config(self._ds_config, resize)
        self._monitor.stop()
        self._monitor.start_watchdog(env, cfg.watchdog.heartbeat_timeout_s, (), cfg.watchdog.hang_timeout_s, layout)
