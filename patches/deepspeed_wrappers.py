"""Which DeepSpeed optimizer wrapper an engine's ``optimizer`` is: the one classifier ds-swift has.

Update-undo (ds_swift.undo.engine), the state a survivor keeps, a donor sends and a buddy holds
(ds_swift.patches.deepspeed_optim_state) and the gradient accumulation of parallel recovery
(ds_swift.patches.deepspeed_grad_accum) all branch on it. Each kind names the DeepSpeed class it
is (DeepSpeed 0.19.8 module paths); what each caller supports of them is the caller's to say.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from ds_swift.patches._base import check_deepspeed

__all__ = ["UnsupportedWrapper", "WrapperKind", "kind_of"]


class WrapperKind(str, enum.Enum):
    """A DeepSpeed optimizer wrapper ds-swift can read and write, by its class."""

    TORCH = "torch"
    """No wrapper: ``engine.optimizer`` is the torch optimizer itself (ZeRO-0, fp32); the module's
    parameters are the masters."""
    BF16_OPTIMIZER = "bf16_optimizer"
    """``deepspeed.runtime.bf16_optimizer.BF16_Optimizer`` (bf16 + ZeRO-0/1 with fp32 gradient
    accumulation: what the pipeline engine builds for bf16)."""
    ZERO_STAGE1 = "zero_stage1"
    """``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer`` at stage 1 without CPU offload."""
    FP16_FUSED = "fp16_fused"
    """``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer`` (fp16, ZeRO-0, a fused optimizer)."""
    FP16_UNFUSED = "fp16_unfused"
    """``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`` (fp16, ZeRO-0, per-tensor)."""

    @property
    def partitioned_by_dp(self) -> bool:
        """Whether the fp32 masters are cut across data-parallel ranks (one flat buffer per group)."""
        return self in (WrapperKind.BF16_OPTIMIZER, WrapperKind.ZERO_STAGE1)

    @property
    def fp16(self) -> bool:
        """Whether it is one of the fp16 wrappers (a ``loss_scale_config`` of dynamic loss scaling)."""
        return self in (WrapperKind.FP16_FUSED, WrapperKind.FP16_UNFUSED)


class UnsupportedWrapper(RuntimeError):
    """An optimizer wrapper whose state ds-swift cannot read or write (ZeRO 2/3, CPU offload...).

    ``what`` names it as a noun ("ZeRO stage 2 (...)"), for callers that word their own refusal.
    """

    def __init__(self, what: str) -> None:
        super().__init__(f"{what}: ds-swift cannot read or write its state (ZeRO stage 0 or 1 without offload can)")
        self.what = what


def kind_of(opt: Any) -> WrapperKind:
    """The kind of ``opt`` (an engine's ``optimizer``); raises UnsupportedWrapper naming what it is."""
    check_deepspeed()
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(opt, torch.optim.Optimizer):
        return WrapperKind.TORCH
    if isinstance(opt, BF16_Optimizer):
        return WrapperKind.BF16_OPTIMIZER
    if isinstance(opt, DeepSpeedZeroOptimizer):
        if opt.partition_gradients:
            raise UnsupportedWrapper("ZeRO stage 2 (DeepSpeedZeroOptimizer with partition_gradients)")
        if opt.cpu_offload:
            raise UnsupportedWrapper("ZeRO CPU offload (DeepSpeedZeroOptimizer with cpu_offload)")
        return WrapperKind.ZERO_STAGE1
    # FP16_UnfusedOptimizer is not a subclass of FP16_Optimizer in 0.19; tested first all the same.
    if isinstance(opt, FP16_UnfusedOptimizer):
        return WrapperKind.FP16_UNFUSED
    if isinstance(opt, FP16_Optimizer):
        return WrapperKind.FP16_FUSED
    name = type(opt).__name__
    if "Stage3" in name:
        raise UnsupportedWrapper(f"ZeRO stage 3 ({name})")
    raise UnsupportedWrapper(f"the DeepSpeed optimizer wrapper {name}")
