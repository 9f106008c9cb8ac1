"""The undo of torch's Adam/AdamW step as one Triton kernel: inverse and forward replays in registers.

Why a kernel: the fast path (:mod:`ds_swift.undo.apply`) undoes a slice in some 90 torch ops that move
about 1 KB per fp32 element (float64 temporaries, one forward replay per candidate); the issue's goal
(undo of 256M AdamW elements <= 3x one step, <= 10x the HBM bound) leaves room for reading p, g, m, v
and writing p, m, v once. This kernel does per element what ``rules_torch.AdamRule.undo_param`` with
dense refinement does, in the same float64 and float32 operations, so it gives the same answer
element for element (tests/unit/test_undo_triton.py, on a CPU through Triton's interpreter).

Rounding: the refinement keeps a candidate only where a replay of the forward step reproduces the
stepped value bit for bit, so the replay must round as the kernels that ran the step did. It is
written out op by op (the kernel is compiled with ``enable_fp_fusion=False``, so no multiply-add is
contracted unless written as ``tl.fma``; division and square root are ``div_rn``/``sqrt_rn``, IEEE
round-to-nearest, where Triton's ``/`` and ``tl.sqrt`` on float32 are approximations). ``FLAVOUR``:

* ``CPU`` (0): torch's CPU kernels as ``rules_torch`` models them (measured on torch 2.13):
  ``addcdiv(m, d, value=s)`` is ``x + fl(fl(s*m)/d)``; ``addcmul(g, g, value=s)`` is
  ``fma(fl(s*g), g, v)``; ``lerp`` and ``add(alpha=)`` are one fma. Its float32 ``sqrt`` is not
  IEEE's (1 ulp off for about 0.6 % of inputs on torch 2.13 with AVX512), so this flavour reads the
  denominator, computed by torch's ops, instead of computing it (a CPU runs the kernel only in tests).
* ``CUDA_FOREACH`` (1): torch's foreach CUDA kernels (the default for CUDA parameters), from
  aten/src/ATen/native/cuda: ``_foreach_addcdiv_`` with a scalar list is ``x + s*(m/d)``
  (``PointwiseOpScalarListFunctor``), which nvcc contracts (``-fmad=true``, its default) to
  ``fma(s, fl(m/d), x)``; ``_foreach_addcmul_`` likewise ``fma(s, fl(g*g), v)``; ``_foreach_lerp_``
  is ``Lerp.h``'s ``self + w*(end - self)`` (``|w| < 0.5``) or ``end - (end - self)*(1 - w)``, each
  contracted to one fma; ``_foreach_add(grads, params, alpha=wd)`` is ``fma(wd, x, g)``;
  ``_foreach_div_`` by the list of ``sqrt(1 - beta2^t)`` is a true division (``std::divides``).
* ``CUDA_SINGLE`` (2): ``foreach=False`` on CUDA: as 1, except ``exp_avg_sq.sqrt() / bc2_sqrt``,
  a tensor divided by a host scalar (a Python float), which ``div_true_kernel_cuda`` computes as a
  multiplication by ``fl(1/bc2_sqrt)``: the reciprocal of the double, rounded once to float32
  (measured on an H100, torch 2.11: with ``fl(1/fl(bc2_sqrt))`` instead, 10-100 % of the products
  differ at some steps, e.g. t = 1, 3, 5 with beta2 = 0.999).

What a CUDA machine must confirm (tests/gpu/test_undo_triton_gpu.py): the replay of each flavour
equals torch's real CUDA step bit for bit, and the undo gives the fast path's answer within 2 ulp.
The forward step and nextafter as kernels of their own, for those checks: triton_adam_replay.
Not modelled: torch's ``fused=True`` CUDA kernel (it computes in double: see rules_torch.AdamRule's
refusal) and DeepSpeed's FusedAdam (compiled with ``--use_fast_math``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ds_swift.undo.numerics import f32 as _f32

if not torch.cuda.is_available():
    # No device to compile for: run the kernel on CPU tensors with Triton's interpreter (tests,
    # and the fused path's check on a CPU). Must be set before triton reads it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["CPU", "CUDA_FOREACH", "CUDA_SINGLE", "adam_undo", "constants", "interpreted", "launch_kwargs"]

CPU, CUDA_FOREACH, CUDA_SINGLE = 0, 1, 2
BLOCK = 1024

# Indices into the float64 constants tensor (every scalar goes through it: Triton types a Python
# float argument as float32, and the inverse needs some in float64).
_DECAY, _NSS, _BC2S, _INV_BC2S, _EPS, _WD, _WT, _WT_M1, _B2, _OMB2, _WT64, _OMWT64 = range(12)


def interpreted() -> bool:
    """Whether kernels run in Triton's interpreter (on CPU tensors) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _next(x, up):
    """torch.nextafter(x, +inf if up else -inf) for float32 x (through the bit pattern)."""
    bits = x.to(tl.int32, bitcast=True)
    away = (x >= 0) == up  # away from zero: the magnitude grows
    nb = tl.where(away, bits + 1, bits - 1)
    nb = tl.where(x == 0, tl.where(up, 1, -2147483647), nb)  # +-0 -> +-denorm_min (0x80000001)
    y = nb.to(tl.float32, bitcast=True)
    stay = (x != x) | tl.where(up, x == float("inf"), x == float("-inf"))
    return tl.where(stay, x, y)


@triton.jit
def _fwd_x(x, m, d, decay, nss, DECAY: tl.constexpr, FLAVOUR: tl.constexpr):
    """[x*decay] then addcdiv(m, d, value=nss)."""
    if DECAY:
        x = x * decay
    if FLAVOUR == 0:
        return x + tl.div_rn(m * nss, d)
    else:
        return tl.fma(nss, tl.div_rn(m, d), x)


@triton.jit
def _fwd_m(m, gp, wt, wt_m1, SMALL_WT: tl.constexpr):
    """m.lerp(gp, wt): ATen's Lerp.h, one fma either way on CPU (vectorised) and CUDA."""
    diff = gp - m
    if SMALL_WT:
        return tl.fma(wt, diff, m)
    else:
        return tl.fma(wt_m1, diff, gp)


@triton.jit
def _fwd_v(v, gp, b2, omb2, FLAVOUR: tl.constexpr):
    """v.mul(b2).addcmul(gp, gp, value=omb2)."""
    t = v * b2
    if FLAVOUR == 0:
        return tl.fma(gp * omb2, gp, t)
    else:
        return tl.fma(omb2, gp * gp, t)


@triton.jit
def _denom(v, bc2s, inv_bc2s, eps, FLAVOUR: tl.constexpr):
    s = tl.sqrt_rn(v)
    if FLAVOUR == 2:
        q = s * inv_bc2s
    else:
        q = tl.div_rn(s, bc2s)
    return q + eps


@triton.jit
def _consts(c_ptr):
    decay = tl.load(c_ptr + 0).to(tl.float32)
    nss = tl.load(c_ptr + 1).to(tl.float32)
    bc2s = tl.load(c_ptr + 2).to(tl.float32)
    inv_bc2s = tl.load(c_ptr + 3).to(tl.float32)
    eps = tl.load(c_ptr + 4).to(tl.float32)
    wd = tl.load(c_ptr + 5).to(tl.float32)
    wt = tl.load(c_ptr + 6).to(tl.float32)
    wt_m1 = tl.load(c_ptr + 7).to(tl.float32)
    b2 = tl.load(c_ptr + 8).to(tl.float32)
    omb2 = tl.load(c_ptr + 9).to(tl.float32)
    return decay, nss, bc2s, inv_bc2s, eps, wd, wt, wt_m1, b2, omb2


@triton.jit
def _undo_x(x1, m1, d, decay, nss, DECAY: tl.constexpr, X_MONOTONE: tl.constexpr, FLAVOUR: tl.constexpr):
    """x0: the float64 inverse rounded, refined as numerics.refine_monotone / refine_dense."""
    if FLAVOUR == 0:
        inc = tl.div_rn(m1 * nss, d).to(tl.float64)
    else:
        inc = nss.to(tl.float64) * tl.div_rn(m1, d).to(tl.float64)  # exact: 24 x 24 bits
    xw = x1.to(tl.float64) - inc
    if DECAY:
        xw = xw / decay.to(tl.float64)
    c = xw.to(tl.float32)
    at = _fwd_x(c, m1, d, decay, nss, DECAY, FLAVOUR)
    if X_MONOTONE:
        up = at < x1
        s1 = _next(c, up)
        s2 = _next(s1, up)
        best = tl.where(_fwd_x(s2, m1, d, decay, nss, DECAY, FLAVOUR) == x1, s2, c)
        best = tl.where(_fwd_x(s1, m1, d, decay, nss, DECAY, FLAVOUR) == x1, s1, best)
    else:
        up = xw > c.to(tl.float64)
        down = xw <= c.to(tl.float64)
        n1 = _next(c, up)
        f1 = _next(c, down)
        n2 = _next(n1, up)
        f2 = _next(f1, down)
        best = tl.where(_fwd_x(f2, m1, d, decay, nss, DECAY, FLAVOUR) == x1, f2, c)
        best = tl.where(_fwd_x(n2, m1, d, decay, nss, DECAY, FLAVOUR) == x1, n2, best)
        best = tl.where(_fwd_x(f1, m1, d, decay, nss, DECAY, FLAVOUR) == x1, f1, best)
        best = tl.where(_fwd_x(n1, m1, d, decay, nss, DECAY, FLAVOUR) == x1, n1, best)
    return tl.where(at == x1, c, best)


@triton.jit
def _undo_m(m1, gp, wt, wt_m1, wt64, omwt64, SMALL_WT: tl.constexpr):
    """m0: (m1 - wt*gp)/(1 - wt) in float64, refined densely (lerp reads m twice: not monotone)."""
    mw = (m1.to(tl.float64) - wt64 * gp.to(tl.float64)) / omwt64
    c = mw.to(tl.float32)
    up = mw > c.to(tl.float64)
    down = mw <= c.to(tl.float64)
    n1 = _next(c, up)
    f1 = _next(c, down)
    n2 = _next(n1, up)
    f2 = _next(f1, down)
    best = tl.where(_fwd_m(f2, gp, wt, wt_m1, SMALL_WT) == m1, f2, c)
    best = tl.where(_fwd_m(n2, gp, wt, wt_m1, SMALL_WT) == m1, n2, best)
    best = tl.where(_fwd_m(f1, gp, wt, wt_m1, SMALL_WT) == m1, f1, best)
    best = tl.where(_fwd_m(n1, gp, wt, wt_m1, SMALL_WT) == m1, n1, best)
    return tl.where(_fwd_m(c, gp, wt, wt_m1, SMALL_WT) == m1, c, best)


@triton.jit
def _undo_v(v1, gp, b2, omb2, V_MONOTONE: tl.constexpr, FLAVOUR: tl.constexpr):
    """v0: (v1 - term)/b2 in float64, clamped at 0, refined (monotone in v when b2 > 0)."""
    if FLAVOUR == 0:
        term = (gp * omb2).to(tl.float64) * gp.to(tl.float64)
    else:
        term = omb2.to(tl.float64) * (gp * gp).to(tl.float64)
    vw = (v1.to(tl.float64) - term) / b2.to(tl.float64)
    vw = tl.where(vw < 0, 0.0, vw)
    c = vw.to(tl.float32)
    at = _fwd_v(c, gp, b2, omb2, FLAVOUR)
    if V_MONOTONE:
        up = at < v1
        s1 = _next(c, up)
        s2 = _next(s1, up)
        best = tl.where(_fwd_v(s2, gp, b2, omb2, FLAVOUR) == v1, s2, c)
        best = tl.where(_fwd_v(s1, gp, b2, omb2, FLAVOUR) == v1, s1, best)
    else:
        up = vw > c.to(tl.float64)
        down = vw <= c.to(tl.float64)
        n1 = _next(c, up)
        f1 = _next(c, down)
        n2 = _next(n1, up)
        f2 = _next(f1, down)
        best = tl.where(_fwd_v(f2, gp, b2, omb2, FLAVOUR) == v1, f2, c)
        best = tl.where(_fwd_v(n2, gp, b2, omb2, FLAVOUR) == v1, n2, best)
        best = tl.where(_fwd_v(f1, gp, b2, omb2, FLAVOUR) == v1, f1, best)
        best = tl.where(_fwd_v(n1, gp, b2, omb2, FLAVOUR) == v1, n1, best)
    return tl.where(at == v1, c, best)


@triton.jit
def _adam_undo_kernel(
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
    MOMENTS: tl.constexpr,
    X_MONOTONE: tl.constexpr,
    V_MONOTONE: tl.constexpr,
    SMALL_WT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    decay, nss, bc2s, inv_bc2s, eps, wd, wt, wt_m1, b2, omb2 = _consts(c_ptr)
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    m1 = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v1 = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if FLAVOUR == 0:
        d = tl.load(d_ptr + offs, mask=mask, other=1.0)  # torch's CPU sqrt (see _cpu_denominator)
    else:
        d = _denom(v1, bc2s, inv_bc2s, eps, FLAVOUR)
    x0 = _undo_x(x1, m1, d, decay, nss, DECAY, X_MONOTONE, FLAVOUR)
    tl.store(x_ptr + offs, x0, mask=mask)
    if MOMENTS:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if MAXIMIZE:
            g = -g
        if L2:
            g = tl.fma(wd, x0, g)  # grad.add(param, alpha=wd), bit-identical to the step's when x0 is
        wt64 = tl.load(c_ptr + 10)
        omwt64 = tl.load(c_ptr + 11)
        tl.store(m_ptr + offs, _undo_m(m1, g, wt, wt_m1, wt64, omwt64, SMALL_WT), mask=mask)
        tl.store(v_ptr + offs, _undo_v(v1, g, b2, omb2, V_MONOTONE, FLAVOUR), mask=mask)


def constants(h: dict[str, Any], step: float, device: torch.device) -> torch.Tensor:
    """The scalars as the step's kernels see them: Python doubles cast to float32, except the two
    the float64 inverse of m uses as rules_torch does (``1 - beta1`` and ``beta1``, as doubles)."""
    lr, eps, wd = float(h["lr"]), float(h["eps"]), float(h["weight_decay"])
    beta1, beta2 = (float(b) for b in h["betas"])
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    bc2s = _f32(bc2**0.5)
    wt = 1 - beta1
    values = [
        _f32(1 - lr * wd),  # decay
        _f32(-(lr / bc1)),  # -step_size
        bc2s,
        _f32(1.0 / bc2**0.5),  # CUDA: the reciprocal a division by a host double multiplies by
        _f32(eps),
        _f32(wd),
        _f32(wt),
        _f32(_f32(wt) - 1.0),  # lerp's weight - 1 (exact in float32 for weights in [0.5, 1])
        _f32(beta2),
        _f32(1 - beta2),
        wt,
        1 - wt,
    ]
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    # From pinned memory, asynchronously: a pageable copy would make the host wait for the device
    # (the undo path issues no host sync; tests/gpu checks it under torch.cuda.set_sync_debug_mode).
    return torch.tensor(values, dtype=torch.float64, pin_memory=True).to(device, non_blocking=True)


def _flags(h: dict[str, Any], flavour: int) -> dict[str, Any]:
    lr, wd = float(h["lr"]), float(h["weight_decay"])
    decoupled = bool(h.get("decoupled_weight_decay", False))
    decay = 1 - lr * wd
    return dict(
        FLAVOUR=flavour,
        DECAY=decoupled and wd != 0,
        L2=(not decoupled) and wd != 0,
        MAXIMIZE=bool(h.get("maximize", False)),
        SMALL_WT=abs(_f32(1 - float(h["betas"][0]))) < 0.5,
    ) | {"_monotone_x": decay > 0 or not (decoupled and wd != 0), "_monotone_v": float(h["betas"][1]) > 0}


def _cpu_denominator(v: torch.Tensor, h: dict[str, Any], step: float) -> torch.Tensor:
    """``sqrt(v)/sqrt(1 - beta2^t) + eps`` by torch's CPU ops, as the step and the fast path compute it:
    torch's CPU float32 sqrt is not IEEE's (about 0.6 % of results 1 ulp off on torch 2.13, AVX512),
    so the CPU flavour reads its denominator instead of computing it (CUDA's sqrtf is IEEE's)."""
    beta2 = float(h["betas"][1])
    return (v.sqrt() / (1 - beta2**step) ** 0.5).add_(float(h["eps"]))


def launch_kwargs() -> dict[str, Any]:
    # No contraction of a*b+c into an fma unless the replay says tl.fma (see the module docstring).
    # 8 warps: 4 elements of a 1024 block per thread, for the float64 temporaries' registers.
    return {} if interpreted() else {"enable_fp_fusion": False, "num_warps": 8}


def adam_undo(
    x: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    h: dict[str, Any],
    step: float,
    *,
    flavour: int,
    moments: bool,
) -> None:
    """Undo one Adam/AdamW step in place on flat contiguous float32 tensors (x, m, v: post-step)."""
    n = x.numel()
    if n == 0:
        return
    flags = _flags(h, flavour)
    xm, vm = flags.pop("_monotone_x"), flags.pop("_monotone_v")
    c = constants(h, step, x.device)
    d = _cpu_denominator(v, h, step) if flavour == CPU else v  # (v: an unread placeholder)
    grid = (triton.cdiv(n, BLOCK),)
    _adam_undo_kernel[grid](
        x, g, m, v, d, c, n, MOMENTS=moments, X_MONOTONE=xm, V_MONOTONE=vm, BLOCK=BLOCK, **flags, **launch_kwargs()
    )
