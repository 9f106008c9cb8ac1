"""The per-instruction hooks the runtime installs on every DeepSpeed engine it builds.

- RNG keying: torch is reseeded before every forward pass from (seed, iteration, micro-batch,
  stage) by :func:`ds_swift.data.keyed.key_forward_rng`, the one function training and the replay
  (ds_swift.recovery.replay.engine) both call, so a replayed forward draws the same dropout masks;
- fault injection (``ds-swift-launch --inject``): the injector fires at the phase it names;
- the update-undo step record, the step-collective recorder and the message logger
  (ds_swift.protect.message_logging), in the order their patches need.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_swift.data.keyed import key_forward_rng
from ds_swift.logs import say_here
from ds_swift.runtime.context import SwiftContext

if TYPE_CHECKING:
    # Not at run time: the logging wiring imports the replay.
    from ds_swift.detect.progress import Progress
    from ds_swift.protect.message_logging import EngineLogging
    from ds_swift.recovery.state.inflight import InflightKeeper

__all__ = ["EngineHooks", "attach_undo", "make_injector"]  # key_forward_rng, seed_generators: ds_swift.data.keyed


def make_injector(ctx: SwiftContext) -> Any:
    """The fault injector ``ds-swift-launch --inject`` asked for (None when none was)."""
    env, store = ctx.env, ctx.store
    if env is None or store is None or not env.inject:
        return None
    from ds_swift.testing.faults import Injector

    return Injector.from_env(store, env)


def attach_undo(engine: Any) -> tuple[Any, str | None]:
    """Make ``engine``'s optimizer step undoable: ``(the undo handle, None)``, or ``(None, why not)``,
    said loudly (the start-up cost line repeats the why)."""
    try:
        from ds_swift.undo import attach_to_engine

        return attach_to_engine(engine), None
    except ImportError as exc:
        # The undo module missing is a build without it; any other ImportError is a broken install
        # or a bug inside it: both named, never a silent None.
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("ds_swift.undo")
        why = f"{exc.name} is not installed" if missing else f"ImportError: {exc}"
    except Exception as exc:  # noqa: BLE001 - an optimizer without an inverse must not stop training
        why = f"unavailable for this optimizer: {exc}"
    say_here(
        f"update-undo is off ({why}); training goes on: a failure with a survivor one step ahead reloads "
        "the global checkpoint",
        level=logging.WARNING,
        name=__name__,
    )
    return None, why


def with_progress(
    progress: Progress, engine: Any, hooks: dict[type, Callable[..., Any]]
) -> dict[type, Callable[..., Any]]:
    """``hooks`` for every instruction type ``engine`` handles, each beating ``progress`` first
    (instructions without a hook of their own get one that only beats)."""
    from ds_swift.patches.instructions import instruction_types

    def passthrough(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        return call_next(**kw)

    def beating(name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            progress.beat(name, int(eng.global_steps))
            return inner(eng, call_next, **kw)

        return hook

    return {instr: beating(instr.__name__, hooks.get(instr, passthrough)) for instr in instruction_types(engine)}


class EngineHooks:
    """Installs the runtime's hooks on each engine and removes them before its teardown.

    Args:
        seed: keys the per-forward reseeding.
        injector: the fault injector (None: no faults are injected).
        logs: the worker's message log and step-collective records (kept across rebuilds).
        inflight: keeps the iteration in flight (PipeChurn's partial recomputation; None: nothing kept).
    """

    def __init__(
        self,
        seed: int,
        injector: Any,
        logs: EngineLogging,
        without: frozenset[str] = frozenset(),
        inflight: InflightKeeper | None = None,
    ) -> None:
        self.seed = seed
        #: what a benchmark switched off (ds_swift.protect.costs): "undo", "rng"
        self.without = without
        self.injector = injector
        self.logs = logs
        self._undo: Any = None  # the update-undo handle of the engine in force (None: no undo)
        #: why update-undo could not be attached to the last engine (None: it was, or a benchmark switched it off)
        self.undo_off: str | None = None
        self._handles: list[Any] = []
        self._micro = 0
        self._reseed = True  # off while a replay keys the RNG itself
        #: the training thread's progress, beaten at every instruction (None: hangs not watched)
        self.progress: Progress | None = None
        #: the copy of the iteration in flight (PipeChurn's partial recomputation; None: not kept)
        self.inflight = inflight
        if inflight is not None:
            inflight.reseed = self.set_reseed  # a redo of kept passes keys the RNG itself

    def set_reseed(self, on: bool) -> None:
        self._reseed = on

    def begin_iteration(self, finishing: bool = False) -> None:
        """The next forward pass is the iteration's first micro-batch (``finishing``: only the
        iteration's step runs, after a partial recomputation: its kept copy stays)."""
        self._micro = 0
        self.logs.begin_iteration()
        if self.inflight is not None and not finishing:
            self.inflight.restart()

    def install(self, engine: Any) -> None:
        """Hook ``engine``: undo, collective recorder, reseeding and faults, message logger."""
        from ds_swift.patches.instructions import hook_instructions, schedule

        def phase_hook(phase: str) -> Callable[..., Any]:
            def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
                if self.injector is not None:
                    self.injector.maybe_fire(phase, int(eng.global_steps))
                return call_next(**kw)

            return hook

        def forward(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if self._reseed and "rng" not in self.without:
                key_forward_rng(eng, self.seed, self._micro)
            self._micro += 1
            if self.injector is not None:
                self.injector.maybe_fire("forward", int(eng.global_steps))
            return call_next(**kw)

        hooks: dict[type, Callable[..., Any]] = {
            schedule.ForwardPass: forward,
            schedule.BackwardPass: phase_hook("backward"),
            schedule.OptimizerStep: phase_hook("step"),
            schedule.ReduceGrads: phase_hook("reduce"),
            schedule.SendActivation: phase_hook("send"),
            schedule.SendGrad: phase_hook("send"),
            schedule.RecvActivation: phase_hook("recv"),
            schedule.RecvGrad: phase_hook("recv"),
        }
        if self.progress is not None:
            hooks = with_progress(self.progress, engine, hooks)
        # Undo first: its step patch replaces the engine's instruction map instead of wrapping the
        # one in force, so hooks installed before it would be lost.
        self._undo, self.undo_off = attach_undo(engine) if "undo" not in self.without else (None, None)
        self.logs.attach_recorder(engine, self._handles)
        self._handles.append(hook_instructions(engine, "ds_swift.runtime", hooks))
        if self.inflight is not None:
            self._handles.extend(self.inflight.install(engine))
        self.logs.attach_log(engine, self._handles)

    @property
    def undo(self) -> Any:
        """The update-undo handle of the engine in force (None: not attached, or taken)."""
        return self._undo

    def take_undo(self) -> Any:
        """The update-undo handle of the engine in force (None: its steps cannot be undone), which
        the caller now owns: a survivor's kept state detaches it from the engine."""
        undo, self._undo = self._undo, None
        return undo

    def add(self, handle: Any) -> None:
        """Keep another patch handle on the engine in force; it is removed with the runtime's."""
        self._handles.append(handle)

    def uninstall(self) -> None:
        """Remove every hook (the undo handle stays: a survivor's kept state detaches it)."""
        while self._handles:
            self._handles.pop().remove()
        self.logs.detached()

    def suspend_logging(self, engine: Callable[[], Any]) -> Callable[[], None]:
        """Stop the message logger of ``engine()``; returns what restarts it."""
        return self.logs.suspend(self._handles, engine)
