"""The forward step as the undo kernel (:mod:`ds_swift.undo.triton_adam`) replays it, and its
nextafter, as kernels of their own: the checks that the kernel's model is torch's step
(tests/unit/test_undo_triton.py on a CPU, tests/gpu/test_undo_triton_gpu.py bit for bit on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

# (triton_adam selects Triton's interpreter where there is no GPU, before triton is imported)
from ds_swift.undo.triton_adam import (
    BLOCK,
    CPU,
    _consts,
    _cpu_denominator,
    _denom,
    _flags,
    _fwd_m,
    _fwd_v,
    _fwd_x,
    _next,
    constants,
    launch_kwargs,
    tl,
    triton,
)

__all__ = ["adam_forward", "nextafter"]


@triton.jit
def _adam_forward_kernel(
    x_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    d_ptr,
    c_ptr,
    n,
    FLAVOUR: tl.constexpr,
    DECAY: tl.constexpr,
    L2: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    SMALL_WT: tl.constexpr,
    MOMENTS: tl.constexpr,
    X: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The forward step as the undo kernel replays it (the GPU check compares it with torch's step);
    for the CPU flavour in two passes, moments then x (the denominator is torch's, in between)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    decay, nss, bc2s, inv_bc2s, eps, wd, wt, wt_m1, b2, omb2 = _consts(c_ptr)
    x0 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    m1 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v1 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if MOMENTS:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if MAXIMIZE:
            g = -g
        if L2:
            g = tl.fma(wd, x0, g)
        m1 = _fwd_m(m1, g, wt, wt_m1, SMALL_WT)
        v1 = _fwd_v(v1, g, b2, omb2, FLAVOUR)
        tl.store(m_ptr + offs, m1, mask=mask)
        tl.store(v_ptr + offs, v1, mask=mask)
    if X:
        if FLAVOUR == 0:
            d = tl.load(d_ptr + offs, mask=mask, other=1.0)
        else:
            d = _denom(v1, bc2s, inv_bc2s, eps, FLAVOUR)
        tl.store(x_ptr + offs, _fwd_x(x0, m1, d, decay, nss, DECAY, FLAVOUR), mask=mask)


@triton.jit
def _next_kernel(x_ptr, out_ptr, n, UP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _next(x, tl.full([BLOCK], UP, tl.int1)), mask=mask)


def nextafter(x: torch.Tensor, *, up: bool) -> torch.Tensor:
    """The kernel's nextafter on a float32 tensor (for the test that it is torch.nextafter)."""
    out = torch.empty_like(x)
    _next_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), UP=up, BLOCK=BLOCK)
    return out


def adam_forward(
    x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: dict[str, Any], step: float, *, flavour: int
) -> None:
    """The step the undo kernel models, in place (for the checks that it is torch's step)."""
    n = x.numel()
    if n == 0:
        return
    flags = _flags(h, flavour)
    flags.pop("_monotone_x")
    flags.pop("_monotone_v")
    c = constants(h, step, x.device)
    grid = (triton.cdiv(n, BLOCK),)
    if flavour == CPU:
        _adam_forward_kernel[grid](x, g, m, v, v, c, n, MOMENTS=True, X=False, BLOCK=BLOCK, **flags)
        d = _cpu_denominator(v, h, step)
        _adam_forward_kernel[grid](x, g, m, v, d, c, n, MOMENTS=False, X=True, BLOCK=BLOCK, **flags)
        return
    _adam_forward_kernel[grid](x, g, m, v, v, c, n, MOMENTS=True, X=True, BLOCK=BLOCK, **flags, **launch_kwargs())
