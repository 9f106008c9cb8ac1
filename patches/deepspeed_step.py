"""Reversible, idempotent patch of one DeepSpeed engine's optimizer-step path (0.19.x).

What it changes, on the engine *instance* only (no class or module is touched, so other
engines in the process are unaffected and ``remove()`` restores exactly):

* ``engine._take_model_step`` is wrapped: ``on_step_begin`` runs first, ``on_step_end``
  last (also when the step raises), and during the call a set of attribute overrides
  chosen by the caller is installed (used to defer DeepSpeed's gradient zeroing and to
  observe clipping), then removed again.
* The start of every backward pass calls ``on_backward_begin``: the pipeline engine's
  ``BackwardPass`` instruction (through the shared instruction-hook seam,
  ``patches.instructions.hook_instructions``, so it composes with the other features' hooks;
  hooks are removed last-in first-out) and ``engine.backward`` (the plain engine).
* ``set_attr`` lets the caller add more instance patches (the wrapped torch optimizer's
  ``step``) that ``remove()`` undoes in reverse order.

Line references are to deepspeed 0.19.8: runtime/engine.py ``_take_model_step`` (3505),
runtime/pipe/engine.py ``_exec_backward_pass`` (792), ``_INSTRUCTION_MAP`` (1360).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ds_swift.patches._base import SUPPORTED_DEEPSPEED, PatchError, PatchHandle, check_deepspeed

__all__ = ["SUPPORTED_DEEPSPEED", "DeepSpeedStepPatch", "PatchError", "StepHooks", "apply", "check_version"]

HOOK_NAME = "ds_swift.undo.step"
_INSTRUCTION_STACK = "_ds_swift_instruction_hooks"  # kept by patches.instructions
_MISSING = object()
_MARK = "_ds_swift_step_patch"

Override = tuple[Any, str, Any]


def _noop(*_: Any) -> None:
    return None


@dataclass
class StepHooks:
    """Callbacks the patched engine calls. All optional."""

    on_step_begin: Callable[[], None] = _noop
    on_step_end: Callable[[BaseException | None], None] = _noop
    """Called after the step, with the exception if it raised (it is re-raised after)."""
    on_backward_begin: Callable[[], None] = _noop
    step_overrides: Callable[[], list[Override]] = field(default=lambda: [])
    """(object, attribute, value) to install on instances for the duration of each step."""


def check_version(version: str | None = None) -> None:
    """Raise PatchError unless the installed (or given) deepspeed is in SUPPORTED_DEEPSPEED."""
    check_deepspeed(version)


class DeepSpeedStepPatch(PatchHandle):
    """Handle of an applied patch; ``remove()`` (or leaving a ``with`` block) restores, in
    the reverse order of application."""

    def __init__(self, engine: Any) -> None:
        super().__init__(HOOK_NAME, self._undo_all)
        self.engine = engine
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an instance attribute, remembering whether one shadowed the class before."""
        old = vars(obj).get(name, _MISSING)

        def restore() -> None:
            if old is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(restore)

    def add_handle(self, handle: PatchHandle) -> None:
        self._undo.append(handle.remove)

    def remove(self) -> None:
        # Refuse before touching anything when instruction hooks installed after ours are
        # still in place (the seam removes last-in first-out): a half-removed patch would
        # leave the engine neither patched nor restored.
        stack = vars(self.engine).get(_INSTRUCTION_STACK) or []
        if self.active and HOOK_NAME in stack and stack[-1] != HOOK_NAME:
            raise PatchError(
                f"{HOOK_NAME} removed out of order: remove the instruction hooks installed after it first "
                f"(innermost is {stack[-1]!r})"
            )
        super().remove()

    def _undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()


class _Temporary:
    """Install overrides for one call, restoring exactly even if the call raises."""

    def __init__(self, overrides: list[Override]) -> None:
        self.overrides = overrides
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> None:
        for obj, name, value in self.overrides:
            self.saved.append((obj, name, vars(obj).get(name, _MISSING)))
            setattr(obj, name, value)

    def __exit__(self, *exc: object) -> None:
        for obj, name, old in reversed(self.saved):
            if old is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, old)


def apply(engine: Any, hooks: StepHooks, *, version: str | None = None) -> DeepSpeedStepPatch:
    """Patch ``engine`` (a DeepSpeedEngine or PipelineEngine) as described in the module doc."""
    check_version(version)
    if not callable(getattr(engine, "_take_model_step", None)) or not callable(getattr(engine, "backward", None)):
        raise PatchError(f"{type(engine).__name__} has no _take_model_step/backward: not a DeepSpeed engine?")
    existing = vars(engine).get(_MARK)
    if existing is not None and existing.active:
        raise PatchError("this engine's step path is already patched by ds-swift; remove() the first patch")

    patch = DeepSpeedStepPatch(engine)
    orig_take = engine._take_model_step

    def _take_model_step(lr_kwargs: Any = None) -> Any:
        hooks.on_step_begin()
        error: BaseException | None = None
        try:
            with _Temporary(hooks.step_overrides()):
                return orig_take(lr_kwargs)
        except BaseException as e:
            error = e
            raise
        finally:
            hooks.on_step_end(error)

    patch.set_attr(engine, "_take_model_step", _take_model_step)

    orig_backward = engine.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        hooks.on_backward_begin()
        return orig_backward(*args, **kwargs)

    patch.set_attr(engine, "backward", backward)

    if getattr(type(engine), "_INSTRUCTION_MAP", None) is not None:
        from ds_swift.patches.instructions import hook_instructions, schedule

        def backward_pass(eng: Any, call_next: Callable[..., Any], **kwargs: Any) -> Any:
            hooks.on_backward_begin()
            return call_next(**kwargs)

        patch.add_handle(hook_instructions(engine, HOOK_NAME, {schedule.BackwardPass: backward_pass}))
    patch.set_attr(engine, _MARK, patch)
    return patch
