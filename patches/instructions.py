"""Per-engine hooks on DeepSpeed's pipeline instruction table (the narrowest seam).

``PipelineEngine._exec_schedule`` looks instructions up in ``self._INSTRUCTION_MAP``; a dict set
on the *instance* shadows the class's, so hooks affect one engine and leave the class (and any
other engine) untouched. Several features hook the same instructions (message logging, failure
injection, RNG keying, the watchdog's flag check); each :func:`hook_instructions` call wraps the
map in force, so hooks compose. They must be removed in reverse order: removing an inner one
first would drop the outer ones too, so that is refused.

A hook is ``hook(engine, call_next, **kwargs)``; it must call ``call_next(**kwargs)`` exactly
once (or raise) and return its result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deepspeed.runtime.pipe import schedule

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed

__all__ = ["ALL_INSTRUCTIONS", "Hook", "hook_instructions", "instruction_types", "schedule"]

Hook = Callable[..., Any]

#: every instruction type the train schedule emits
ALL_INSTRUCTIONS: tuple[type, ...] = (
    schedule.OptimizerStep,
    schedule.ReduceGrads,
    schedule.ReduceTiedGrads,
    schedule.LoadMicroBatch,
    schedule.ForwardPass,
    schedule.BackwardPass,
    schedule.SendActivation,
    schedule.RecvActivation,
    schedule.SendGrad,
    schedule.RecvGrad,
)

_STACK_ATTR = "_ds_swift_instruction_hooks"


def instruction_types(engine: Any) -> tuple[type, ...]:
    """Every instruction type ``engine`` has a handler for (the keys of its table in force)."""
    return tuple(engine._INSTRUCTION_MAP)


def hook_instructions(engine: Any, name: str, hooks: Mapping[type, Hook]) -> PatchHandle:
    """Wrap ``engine``'s handlers of the given instruction types. Returns the handle that unwraps.

    Args:
        engine: a ``deepspeed.runtime.pipe.engine.PipelineEngine``.
        name: a unique name for this hook set; applying the same name twice is refused.
        hooks: instruction type -> hook.
    """
    check_deepspeed()
    stack: list[str] = engine.__dict__.setdefault(_STACK_ATTR, [])
    if name in stack:
        raise PatchError(f"instruction hooks {name!r} are already installed on this engine")
    current: dict[type, Callable[..., Any]] = dict(engine._INSTRUCTION_MAP)
    had_instance_map = "_INSTRUCTION_MAP" in engine.__dict__
    previous = engine.__dict__.get("_INSTRUCTION_MAP")
    wrapped = dict(current)
    for instr, hook in hooks.items():
        if instr not in current:
            raise PatchError(f"{type(engine).__name__} has no handler for {instr.__name__}")
        wrapped[instr] = _wrap(current[instr], hook)
    engine._INSTRUCTION_MAP = wrapped
    stack.append(name)

    def restore() -> None:
        if not stack or stack[-1] != name:
            raise PatchError(f"instruction hooks {name!r} removed out of order; innermost is {stack[-1:]}")
        stack.pop()
        if had_instance_map:
            engine._INSTRUCTION_MAP = previous
        else:
            del engine.__dict__["_INSTRUCTION_MAP"]

    return PatchHandle(name, restore)


def _wrap(handler: Callable[..., Any], hook: Hook) -> Callable[..., Any]:
    # The map holds plain functions that _exec_schedule binds to the engine with MethodType.
    def wrapped(engine: Any, **kwargs: Any) -> Any:
        return hook(engine, lambda **kw: handler(engine, **kw), **kwargs)

    wrapped.__wrapped__ = handler  # type: ignore[attr-defined]
    return wrapped
