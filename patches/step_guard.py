"""Reversible patch: a check right before the optimizer applies a step, after DeepSpeed waited for the device.

On NCCL a collective's ``wait()`` returns before its data lands, and an abort ends it with a
partial buffer and no error on the host (ds_swift.transport.communicators). A step must therefore
not be applied from gradients an abort may have cut. The seam is the torch optimizer inside
DeepSpeed's wrapper: its ``step`` is where the update happens, and in DeepSpeed 0.19.8 every
wrapper reaches it only after its own gradient check has read a device value, i.e. after the host
waited for the gradient reduce:

* ``BF16_Optimizer.step`` (bf16, ZeRO 0/1 with fp32 accumulation; runtime/bf16_optimizer.py 384):
  ``is_invalid_grad_norm(all_groups_norm)`` reads the global norm (all-reduced over the model
  parallel group after the data-parallel reduce), then ``self.optimizer.step()`` (422);
* ``DeepSpeedZeroOptimizer.step`` (ZeRO 1; runtime/zero/stage_1_and_2.py 3013): ``check_overflow``
  (fp16) or ``is_invalid_grad_norm`` on the norm, and with clipping ``unscale_and_clip_grads``
  (3203) reads it too, before ``_optimizer_step``; with bf16 accumulation and no clipping no
  device value is read there;
* ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``: the overflow check reads the all-reduced flag;
* no wrapper (fp32 ZeRO 0): ``clip_fp32_gradients`` when clipping is on, else nothing.

``check`` is handed what to wait on (ds_swift.runtime: the device, then the generation's abort
mark and torch's own recorded errors), so where DeepSpeed already waited the wait returns at once,
and where it did not (the last two "no device value" cases) it is what makes the check sound.

ZeRO calls the inner ``step`` once per parameter group: ``check`` runs at the first call of each
``_take_model_step`` only, so a step is applied wholly or not at all. A refused step changes
nothing: what DeepSpeed's wrapper changed before the inner step (the loss scaler's update, the
overflow flag, the gradient norm: ``optimizer_scalars``) is put back as it was when the step began.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed
from ds_swift.patches.deepspeed_optim_state import load_optimizer_scalars, optimizer_scalars
from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper, WrapperKind, kind_of

__all__ = ["guard_step", "inner_optimizer"]

_MARK = "_ds_swift_step_guard"
_MISSING = object()


def inner_optimizer(engine: Any) -> Any:
    """The torch optimizer that applies ``engine``'s step (inside DeepSpeed's wrapper, or the
    engine's optimizer itself with fp32 ZeRO 0). Raises PatchError for a wrapper ds-swift does not
    know (ZeRO 2/3, offload), naming it."""
    try:
        kind = kind_of(engine.optimizer)
    except UnsupportedWrapper as exc:
        raise PatchError(f"the step guard cannot find the optimizer inside {exc.what}") from None
    return engine.optimizer if kind is WrapperKind.TORCH else engine.optimizer.optimizer


def _set(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    old = vars(obj).get(name, _MISSING)

    def restore() -> None:
        if vars(obj).get(name) is not value:
            raise PatchError(f"{name} was patched again after ds-swift's step guard; remove that patch first")
        if old is _MISSING:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, old)

    setattr(obj, name, value)
    undo.append(restore)


def guard_step(engine: Any, check: Callable[[], None]) -> PatchHandle:
    """Call ``check()`` once per step of ``engine``, right before its torch optimizer applies it; if
    ``check`` raises, the step is not applied and the wrapper's scalars are put back, then the
    error propagates (out of ``engine._take_model_step``). Install it after update-undo's step patch
    (ds_swift.undo), so that its ``_take_model_step`` and inner ``step`` wrap undo's: a refused
    step then leaves undo's record of it empty (nothing applied)."""
    check_deepspeed()
    if vars(engine).get(_MARK) is not None:
        raise PatchError("this engine's step is already guarded by ds-swift; remove() the first guard")
    inner = inner_optimizer(engine)
    wrapper = engine.optimizer
    state: dict[str, Any] = {"checked": True, "scalars": None}
    take, step = engine._take_model_step, inner.step

    def _take_model_step(lr_kwargs: Any = None) -> Any:
        state["checked"], state["scalars"] = False, optimizer_scalars(wrapper)
        return take(lr_kwargs)

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        if not state["checked"]:
            try:
                check()
            except BaseException:
                load_optimizer_scalars(wrapper, state["scalars"])
                raise
            state["checked"] = True
        return step(*args, **kwargs)

    undo: list[Callable[[], None]] = []
    _set(engine, "_take_model_step", _take_model_step, undo)
    _set(inner, "step", guarded_step, undo)
    _set(engine, _MARK, True, undo)

    def restore() -> None:
        while undo:
            undo.pop()()

    return PatchHandle("step guard", restore)
