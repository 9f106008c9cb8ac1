"""Inverse of deepspeed.ops.adam.FusedAdam (DeepSpeed's default Adam on GPUs).

The kernel (csrc/adam/multi_tensor_adam.cu) cannot be replayed op for op from Python, so the
inverse is the float64 formula only (no refinement), with the hyperparameters as the kernel sees
them: ``lr``, the betas, ``eps`` and ``weight_decay`` arrive as C ``float``, so ``1 - beta1`` is
``1 - float(0.9)`` = 0.10000002, 2 ulp away from 0.1, and the bias corrections are
``float(1 - pow(float(beta), step))``. Tested against a torch stand-in of the kernel
(tests/unit/test_undo_fused_adam.py) and, on a GPU, against the kernel itself built from DeepSpeed's
sources (tests/gpu/test_undo_fused_adam_gpu.py, ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_swift.undo.numerics import f32, w
from ds_swift.undo.records import GroupRecord, ParamRecord
from ds_swift.undo.rules import UndoContext, UndoRule

__all__ = ["DeepSpeedFusedAdamRule"]


class DeepSpeedFusedAdamRule(UndoRule):
    """deepspeed.ops.adam.FusedAdam (csrc/adam/multi_tensor_adam.cu), float64 inverse:
    mode 0 (L2): g' = g + wd*x0, x1 = x0 - lr*r; mode 1 (adam_w_mode): x1 = x0 - lr*(r + wd*x0),
    with r = (m1/bc1) / (sqrt(v1/bc2) + eps). FusedAdam increments the step counter of only the
    last updated parameter of each dtype in a group (``state`` after its loop) and feeds that
    count to the kernel for all of them: undo follows the same bookkeeping."""

    name = "FusedAdam"
    refused_flags = {"amsgrad": "FusedAdam has no amsgrad, and the amsgrad maximum is not invertible"}

    def post_step(self, optimizer: Any, groups: list[GroupRecord], call_kwargs: dict[str, Any]) -> None:
        mode = int(getattr(optimizer, "adam_w_mode", 1))
        for g in groups:
            carriers: dict[torch.dtype, ParamRecord] = {}
            for pr in g.params:
                carriers[pr.param.dtype] = pr  # the last one of each dtype wins, as in FusedAdam.step
                pr.extra["adam_w_mode"] = mode
            for pr in g.params:
                carrier = carriers[pr.param.dtype]
                pr.extra["step_carrier"] = carrier is pr
                pr.extra["kernel_step"] = optimizer.state[carrier.param]["step"]

    def undo_counters(self, state: dict[str, Any], pr: ParamRecord) -> None:
        if pr.extra.get("step_carrier") and "step" not in pr.new_state_keys:
            state["step"] -= 1

    @staticmethod
    def kernel_scalars(ctx: UndoContext) -> dict[str, float]:
        """The hyper-parameters as FusedAdam's kernel sees them (C floats), and its bias corrections."""
        h = ctx.hyper
        beta1, beta2 = (f32(b) for b in h["betas"])
        t = int(ctx.extra["kernel_step"])
        bc1, bc2 = (f32(1 - beta1**t), f32(1 - beta2**t)) if h.get("bias_correction", True) else (1.0, 1.0)
        return {
            "lr": f32(h["lr"]),
            "eps": f32(h["eps"]),
            "weight_decay": f32(h["weight_decay"]),
            "beta1": beta1,
            "beta2": beta2,
            "bc1": bc1,
            "bc2": bc2,
        }

    def undo_param(self, ctx: UndoContext) -> None:
        s = self.kernel_scalars(ctx)
        lr, eps, wd, beta1, beta2, bc1, bc2 = (
            s[k] for k in ("lr", "eps", "weight_decay", "beta1", "beta2", "bc1", "bc2")
        )
        m1, v1, x1 = ctx.state["exp_avg"], ctx.state["exp_avg_sq"], ctx.param
        r = (w(m1) / bc1) / ((w(v1) / bc2).sqrt() + eps)
        decoupled = ctx.extra["adam_w_mode"] == 1
        xw = (w(x1) + lr * r) / (1 - lr * wd) if decoupled else w(x1) + lr * r
        x0 = xw.to(x1.dtype)
        if "exp_avg" not in ctx.new_keys:
            gw = w(ctx.grad) if decoupled or wd == 0 else w(ctx.grad) + wd * w(x0)
            m1.copy_((w(m1) - (1 - beta1) * gw) / beta1)
            v1.copy_(((w(v1) - (1 - beta2) * gw * gw) / beta2).clamp_min_(0))
        x1.copy_(x0)
