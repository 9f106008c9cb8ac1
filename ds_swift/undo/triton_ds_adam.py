"""The undo of DeepSpeed's FusedAdam step (the optimizer ds-swift's users train with) as one Triton kernel.

``rules_deepspeed.DeepSpeedFusedAdamRule`` inverts FusedAdam's kernel (csrc/adam/multi_tensor_adam.cu,
built with ``--use_fast_math``: approximate division and square root, so no op-for-op replay and no
refinement) by its float64 formula; as torch ops that is a dozen float64 temporaries per element.
This kernel evaluates the same formula, operation for operation in float64, in registers: one read of
p, g, m, v and one write of p, m, v. It gives the rule's answer (tests/unit/test_undo_triton.py;
float64 division is IEEE in both, and a float64 square root 1 ulp apart, as torch's CPU one can be,
moves the float32 result only in about 2^-29 of cases).
"""

from __future__ import annotations

import torch

from ds_swift.undo import triton_adam
from ds_swift.undo.triton_adam import BLOCK, tl, triton  # (triton_adam selects the interpreter where there is no GPU)

__all__ = ["ds_adam_undo"]


@triton.jit
def _ds_adam_undo_kernel(
    x_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    c_ptr,
    n,
    DECOUPLED: tl.constexpr,
    L2: tl.constexpr,
    MOMENTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lr = tl.load(c_ptr + 0)
    eps = tl.load(c_ptr + 1)
    wd = tl.load(c_ptr + 2)
    bc1 = tl.load(c_ptr + 3)
    bc2 = tl.load(c_ptr + 4)
    decay = tl.load(c_ptr + 5)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    m1 = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    v1 = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    r = (m1 / bc1) / (tl.sqrt(v1 / bc2) + eps)
    if DECOUPLED:
        xw = (x1 + lr * r) / decay
    else:
        xw = x1 + lr * r
    x0 = xw.to(tl.float32)
    tl.store(x_ptr + offs, x0, mask=mask)
    if MOMENTS:
        gw = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float64)
        if L2:
            gw = gw + wd * x0.to(tl.float64)
        omb1 = tl.load(c_ptr + 6)
        b1 = tl.load(c_ptr + 7)
        omb2 = tl.load(c_ptr + 8)
        b2 = tl.load(c_ptr + 9)
        m0 = (m1 - omb1 * gw) / b1
        v0 = (v1 - omb2 * gw * gw) / b2
        v0 = tl.where(v0 < 0, 0.0, v0)
        tl.store(m_ptr + offs, m0.to(tl.float32), mask=mask)
        tl.store(v_ptr + offs, v0.to(tl.float32), mask=mask)


def ds_adam_undo(
    x: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    scalars: dict[str, float],
    *,
    decoupled: bool,
    moments: bool,
) -> None:
    """Undo one FusedAdam step in place on contiguous float32 tensors. ``scalars``: lr, eps,
    weight_decay, bc1, bc2, beta1, beta2 as DeepSpeedFusedAdamRule computes them (C floats)."""
    n = x.numel()
    if n == 0:
        return
    s = scalars
    lr, wd = s["lr"], s["weight_decay"]
    values = [lr, s["eps"], wd, s["bc1"], s["bc2"], 1 - lr * wd, 1 - s["beta1"], s["beta1"], 1 - s["beta2"], s["beta2"]]
    c = _on(values, x.device)
    grid = (triton.cdiv(n, BLOCK),)
    _ds_adam_undo_kernel[grid](
        x,
        g,
        m,
        v,
        c,
        n,
        DECOUPLED=decoupled,
        L2=(not decoupled) and wd != 0,
        MOMENTS=moments,
        BLOCK=BLOCK,
        **triton_adam.launch_kwargs(),
    )


def _on(values: list[float], device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)
