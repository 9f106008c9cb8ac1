"""Let DeepSpeed's CPU accelerator train in fp16 (tests of the fp16 wrappers on CPU machines).

DeepSpeed 0.19.8's ``CPU_Accelerator.is_fp16_supported`` is true only where oneDNN has fp16
kernels (AVX512-FP16); elsewhere ``deepspeed.initialize`` refuses an ``"fp16"`` config, although
torch computes fp16 on any CPU (slowly). The fp16 optimizer wrappers (FP16_Optimizer,
DeepSpeedZeroOptimizer with a dynamic loss scaler) are what GPU jobs run, so tests on CPU
machines need them: :func:`allow_cpu_fp16` makes the accelerator say yes, reversibly.
"""

from __future__ import annotations

from typing import Any

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed

__all__ = ["allow_cpu_fp16"]


def allow_cpu_fp16() -> PatchHandle:
    """Make the CPU accelerator report fp16 as supported; the handle puts the original back."""
    check_deepspeed()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    acc = get_accelerator()
    if not isinstance(acc, CPU_Accelerator):
        raise PatchError(f"allow_cpu_fp16 is for DeepSpeed's CPU accelerator, not {type(acc).__name__}")
    if "is_fp16_supported" in vars(acc):
        raise PatchError("the CPU accelerator's fp16 support is already patched")

    def yes(*_: Any) -> bool:
        return True

    acc.is_fp16_supported = yes  # type: ignore[method-assign]

    def restore() -> None:
        del acc.is_fp16_supported

    return PatchHandle("cpu fp16", restore)
