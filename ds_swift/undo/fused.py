"""The fused undo path: Adam undone by one Triton kernel per tensor (or packed run of small ones).

Kernels: torch's Adam/AdamW (ds_swift.undo.triton_adam: inverse and refinement, replaying the step)
and DeepSpeed's FusedAdam (ds_swift.undo.triton_ds_adam: its rule's float64 inverse).
``InvertibleOptimizer(undo_path="fused")`` (or ``"auto"``: fused for CUDA tensors when Triton can be
imported, the fast path otherwise). The driver (:mod:`ds_swift.undo.apply`) packs and slices as on the
fast path; each rule call goes to the kernel when it can model it (float32 tensors; for torch's Adam a
replayable step: plain-number hyper-parameters, not ``fused``/``capturable``, refinement on) and to
the fast path's rule otherwise, said once per reason in the log. Where Triton is missing, or its
kernel fails to compile, the whole path falls back to the fast one, said once at start-up (or at the
failure) as a warning: never silently.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ds_swift.undo.rules import UndoContext, UndoRule, is_plain_number

__all__ = [
    "FUSED_CHUNK",
    "TritonAdamRule",
    "TritonDeepSpeedAdamRule",
    "announce",
    "fused_rule",
    "triton_error",
    "use_fused",
]

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


def _kernel_for(rule: UndoRule) -> type[_TritonRule] | None:
    from ds_swift.undo.rules_deepspeed import DeepSpeedFusedAdamRule
    from ds_swift.undo.rules_torch import AdamRule

    if isinstance(rule, AdamRule):
        return TritonAdamRule
    if isinstance(rule, DeepSpeedFusedAdamRule):
        return TritonDeepSpeedAdamRule
    return None


def announce(rule: UndoRule, path: str, optimizer: Any) -> None:
    """Say once at start-up which path will undo ``optimizer`` when the fused one was asked for."""
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if path not in ("fused", "auto") or (path == "auto" and "cuda" not in devices):
        return
    if _kernel_for(rule) is None:
        if path == "fused":
            _once(
                logging.WARNING,
                f"update-undo: undo_path='fused' has kernels for torch Adam/AdamW and DeepSpeed's "
                f"FusedAdam only; {rule.name} is undone by the fast path",
            )
        return
    err = triton_error()
    if err is not None:
        _once(
            logging.WARNING,
            f"update-undo: the fused Triton undo kernel is unavailable ({err}); {rule.name} is "
            "undone by the fast path (about 10x slower on a GPU). Install Triton "
            "(pip install 'ds-swift[triton]') to use it",
        )
        return
    _once(
        logging.INFO,
        f"update-undo: {rule.name} on " + ", ".join(sorted(devices)) + " is undone by the fused "
        "Triton kernel (ds_swift.undo.fused)",
    )


def use_fused(rule: UndoRule, path: str, devices: set[str]) -> bool:
    """Whether ``path`` ("fused" or "auto") takes the fused path for tensors on ``devices``."""
    if path == "auto" and "cuda" not in devices:
        return False  # (without importing Triton: a CPU job never needs it)
    return _kernel_for(rule) is not None and triton_error() is None


def fused_rule(rule: UndoRule) -> UndoRule:
    """``rule`` with its undo_param done by a Triton kernel where one models the step."""
    cls = _kernel_for(rule)
    assert cls is not None  # checked by use_fused
    return cls(rule)


class _TritonRule(UndoRule):
    """``rule`` with its undo_param done by a kernel (``run``) where it can, and by ``rule`` elsewhere."""

    def __init__(self, rule: UndoRule) -> None:
        self.base = rule
        self.name = rule.name
        self.broken = False

    def why_not(self, ctx: UndoContext) -> str | None:
        """Why the kernel cannot undo ``ctx`` (None: it can)."""
        from ds_swift.undo import triton_adam

        if self.broken:
            return "the kernel failed earlier in this process"
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

    def run(self, ctx: UndoContext) -> None:
        raise NotImplementedError

    def undo_param(self, ctx: UndoContext) -> None:
        reason = self.why_not(ctx)
        if reason is not None:
            _once(
                logging.WARNING,
                f"update-undo: {self.name} step undone by the fast path, not the fused kernel: {reason}",
            )
            self.base.undo_param(ctx)
            return
        try:
            self.run(ctx)
        except Exception as exc:  # Triton's compile or launch failure, raised before the kernel stores anything
            self.broken = True
            log.error(
                "update-undo: the fused Triton undo kernel failed (%s: %s); this and later undos use the fast path",
                type(exc).__name__,
                exc,
            )
            self.base.undo_param(ctx)

    def check_group(self, group: dict[str, Any]) -> None:
        self.base.check_group(group)

    def post_step(self, optimizer: Any, groups: list[Any], call_kwargs: dict[str, Any]) -> None:
        self.base.post_step(optimizer, groups, call_kwargs)

    def undo_counters(self, state: dict[str, Any], pr: Any) -> None:
        self.base.undo_counters(state, pr)


class TritonAdamRule(_TritonRule):
    """rules_torch.AdamRule by ds_swift.undo.triton_adam: the same answer, element for element."""

    def why_not(self, ctx: UndoContext) -> str | None:
        h = ctx.hyper
        if not ctx.exact:
            return "refinement is off (refine=False)"
        if h.get("fused") or h.get("capturable") or h.get("differentiable") or h.get("amsgrad"):
            return "fused/capturable/differentiable/amsgrad steps are not modelled"
        if not is_plain_number(h["lr"], h["eps"], h["weight_decay"], *h["betas"]):
            return "tensor hyper-parameters are not modelled"
        return super().why_not(ctx)

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

    def run(self, ctx: UndoContext) -> None:
        from ds_swift.undo import triton_adam

        assert ctx.step is not None
        triton_adam.adam_undo(
            ctx.param,
            ctx.grad,
            ctx.state["exp_avg"],
            ctx.state["exp_avg_sq"],
            ctx.hyper,
            ctx.step,
            flavour=self.flavour(ctx),
            moments="exp_avg" not in ctx.new_keys,
        )


class TritonDeepSpeedAdamRule(_TritonRule):
    """rules_deepspeed.DeepSpeedFusedAdamRule by ds_swift.undo.triton_ds_adam (its float64 inverse)."""

    def run(self, ctx: UndoContext) -> None:
        from ds_swift.undo import triton_ds_adam
        from ds_swift.undo.rules_deepspeed import DeepSpeedFusedAdamRule

        triton_ds_adam.ds_adam_undo(
            ctx.param,
            ctx.grad,
            ctx.state["exp_avg"],
            ctx.state["exp_avg_sq"],
            DeepSpeedFusedAdamRule.kernel_scalars(ctx),
            decoupled=ctx.extra["adam_w_mode"] == 1,
            moments="exp_avg" not in ctx.new_keys,
        )
