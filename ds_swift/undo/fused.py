"""The fused undo path: torch's Adam/AdamW undone by one Triton kernel (ds_swift.undo.triton_adam).

``InvertibleOptimizer(undo_path="fused")`` (or ``"auto"``: fused for CUDA tensors when Triton can be
imported, the fast path otherwise). The driver (:mod:`ds_swift.undo.apply`) packs and slices as on the
fast path; each rule call goes to the kernel when it can model it (a torch Adam/AdamW step on float32
tensors, replayable: plain-number hyper-parameters, not ``fused``/``capturable``, refinement on) and
to the fast path's rule otherwise, said once per reason in the log. Where Triton is missing, or its
kernel fails to compile, the whole path falls back to the fast one, said once at start-up (or at the
failure) as a warning: never silently.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ds_swift.undo.rules import UndoContext, UndoRule, is_plain_number

__all__ = ["FUSED_CHUNK", "TritonAdamRule", "announce", "fused_rule", "triton_error"]

log = logging.getLogger(__name__)

FUSED_CHUNK = 1 << 30
"""Slice size of the fused path: the kernel takes any size; slicing only keeps one launch's float64
constants and offsets small next to a multi-GB flat ZeRO partition."""


@functools.cache
def _once(level: int, message: str) -> None:
    """Log ``message`` once per process (not at every undo)."""
    log.log(level, message)


def triton_error() -> str | None:
    """Why the Triton kernel cannot be used in this process (None: it can)."""
    try:
        from ds_swift.undo import triton_adam  # noqa: F401  (imports triton)
    except Exception as exc:  # ImportError, or triton failing to initialise its backend
        return f"{type(exc).__name__}: {exc}"
    return None


def _is_adam(rule: UndoRule) -> bool:
    from ds_swift.undo.rules_torch import AdamRule

    return isinstance(rule, AdamRule)


def announce(rule: UndoRule, path: str, optimizer: Any) -> None:
    """Say once at start-up which path will undo ``optimizer`` when the fused one was asked for."""
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if path == "auto" and "cuda" not in devices:
        return
    if path not in ("fused", "auto"):
        return
    if not _is_adam(rule):
        if path == "fused":
            _once(logging.WARNING, f"update-undo: undo_path='fused' has a kernel for torch Adam/AdamW only; "
                                   f"{rule.name} is undone by the fast path")  # fmt: skip
        return
    err = triton_error()
    if err is not None:
        _once(logging.WARNING, f"update-undo: the fused Triton undo kernel is unavailable ({err}); Adam/AdamW is "
                               "undone by the fast path (about 10x slower on a GPU). Install Triton "
                               "(pip install 'ds-swift[triton]') to use it")  # fmt: skip
        return
    _once(logging.INFO, "update-undo: Adam/AdamW on " + ", ".join(sorted(devices)) + " is undone by the fused "
                        "Triton kernel (ds_swift.undo.triton_adam)")  # fmt: skip


def use_fused(rule: UndoRule, path: str, devices: set[str]) -> bool:
    """Whether ``path`` ("fused" or "auto") takes the fused path for tensors on ``devices``."""
    if not _is_adam(rule) or triton_error() is not None:
        return False
    if path == "auto":
        return "cuda" in devices
    return True


def fused_rule(rule: UndoRule) -> UndoRule:
    return TritonAdamRule(rule)


class TritonAdamRule(UndoRule):
    """``rule`` (a rules_torch.AdamRule) with its undo_param done by the Triton kernel where it models
    the step, and by ``rule`` elsewhere."""

    def __init__(self, rule: UndoRule) -> None:
        self.base = rule
        self.name = rule.name
        self.broken = False

    def why_not(self, ctx: UndoContext) -> str | None:
        """Why the kernel cannot undo ``ctx`` (None: it can)."""
        from ds_swift.undo import triton_adam

        h = ctx.hyper
        if self.broken:
            return "the kernel failed earlier in this process"
        if not ctx.exact:
            return "refinement is off (refine=False)"
        if h.get("fused") or h.get("capturable") or h.get("differentiable") or h.get("amsgrad"):
            return "fused/capturable/differentiable/amsgrad steps are not modelled"
        if not is_plain_number(h["lr"], h["eps"], h["weight_decay"], *h["betas"]):
            return "tensor hyper-parameters are not modelled"
        tensors = [ctx.param, ctx.grad, ctx.state.get("exp_avg"), ctx.state.get("exp_avg_sq")]
        if any(t is None or t.dtype != torch.float32 for t in tensors):
            return "the kernel handles float32 parameters, gradients and moments only"
        if any(not t.is_contiguous() or t.device != ctx.param.device for t in tensors):  # type: ignore[union-attr]
            return "non-contiguous or mixed-device tensors"
        dev = ctx.param.device.type
        if dev == "cpu" and not triton_adam.interpreted():
            return "CPU tensors run the kernel only in Triton's interpreter (TRITON_INTERPRET=1)"
        if dev not in ("cpu", "cuda"):
            return f"no kernel for {dev} tensors"
        if ctx.grad_mutated:
            return "the step wrote into the gradient"
        return None

    def flavour(self, ctx: UndoContext) -> int:
        """Which of torch's implementations ran the step (see triton_adam's docstring)."""
        from ds_swift.undo import triton_adam

        if ctx.param.device.type == "cpu":
            return triton_adam.CPU
        foreach = ctx.hyper.get("foreach")
        if foreach is None:
            # torch.optim.adam.adam's default for CUDA tensors with plain-number hyper-parameters.
            foreach = not ctx.hyper.get("differentiable", False)
        return triton_adam.CUDA_FOREACH if foreach else triton_adam.CUDA_SINGLE

    def undo_param(self, ctx: UndoContext) -> None:
        reason = self.why_not(ctx)
        if reason is not None:
            _once(
                logging.WARNING,
                f"update-undo: {self.name} step undone by the fast path, not the fused kernel: {reason}",
            )
            self.base.undo_param(ctx)
            return
        from ds_swift.undo import triton_adam

        assert ctx.step is not None
        try:
            triton_adam.adam_undo(
                ctx.param, ctx.grad, ctx.state["exp_avg"], ctx.state["exp_avg_sq"], ctx.hyper, ctx.step,
                flavour=self.flavour(ctx), moments="exp_avg" not in ctx.new_keys,
            )  # fmt: skip
        except Exception as exc:  # Triton's compile or launch failure, raised before the kernel stores anything
            self.broken = True
            log.error("update-undo: the fused Triton undo kernel failed (%s: %s); this and later undos use the "
                      "fast path", type(exc).__name__, exc)  # fmt: skip
            self.base.undo_param(ctx)

    def check_group(self, group: dict[str, Any]) -> None:
        self.base.check_group(group)

    def undo_counters(self, state: dict[str, Any], pr: Any) -> None:
        self.base.undo_counters(state, pr)
