"""Inverse updates of torch.optim's SGD, Adam/AdamW, Adagrad and RMSprop (torch 2.13).

Each inverse is derived from the exact op sequence of torch's ``_single_tensor_*`` and
``_multi_tensor_*`` implementations (the two compute the same per-element arithmetic on
CPU), not from the paper's Appendix A, whose formulas differ from torch's in places (the
Adam inverse there squares g_t instead of g_t + lambda*x_t; AdamW's divides eps outside the
sqrt term and applies decay to x_{t-1} instead of the pre-update x). Notation: x1, m1, v1
are post-step values, x0, m0, v0 the pre-step values we solve for, g the gradient torch
read (negated when ``maximize``), g' = g + wd*x0 (L2 weight decay). Each inverse is done in
float64 and, when the forward can be replayed op for op, refined (see numerics.refine).

The float64 inverse models how torch's CPU kernels round (measured on torch 2.13): scalars
are cast to the op-math type (float32 for float32/bf16/fp16 tensors); ``add(b, alpha)`` and
``lerp`` are one fused multiply-add; ``addcmul(t1, t2, value)`` is fma(fl(value*t1), t2, self);
``addcdiv(t1, t2, value)`` is self + fl(fl(value*t1)/t2). Subtracting the increment exactly as
the kernel formed it leaves only the final rounding, which is the information the forward
destroyed (elsewhere refinement or the error bound covers it).

The step that created a state entry (lazy initialisation) is undone by dropping the entry
(done by the driver), which restores exactly; only the parameter needs solving then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_swift.undo.numerics import REFINE, WORK_DTYPE, Replay, f32, refine, refine_dense, refine_monotone, w
from ds_swift.undo.records import STRATEGY_HINT, NotInvertibleError, UndoError
from ds_swift.undo.rules import UndoContext, UndoRule, is_plain_number

__all__ = ["AdagradRule", "AdamRule", "RMSpropRule", "SGDRule"]

Forward = Callable[..., torch.Tensor]


def solve(
    xw: torch.Tensor,
    target: torch.Tensor,
    exact: bool,
    forward: Forward,
    *tensors: torch.Tensor,
    monotone: bool = False,
) -> torch.Tensor:
    """Round the float64 solution to ``target``'s dtype; refine it against the forward
    ``forward(x, *tensors)`` (``tensors``: the elementwise operands it reads besides x). ``monotone``:
    the forward is non-decreasing in x (see numerics.refine_monotone), which dense refinement uses."""
    x = xw.to(target.dtype)
    if not exact:
        return x
    replay = Replay(forward, tensors)
    if REFINE.get() == "gather":
        return refine(x, target, replay, estimate=xw)
    return refine_monotone(x, target, replay) if monotone else refine_dense(x, target, replay, estimate=xw)


def first_step_x0(
    x1w: torch.Tensor, gw: torch.Tensor, wd: float, scale: torch.Tensor, magnitude: torch.Tensor
) -> torch.Tensor:
    """x0 for x1 = x0 - scale*g', g' = g + wd*x0, when |g'| is known from the state.

    Solving the linear equation x0*(1 - scale*wd) = x1 + scale*g amplifies x1's rounding by
    1/|1 - scale*wd|, unbounded where the denominator (sqrt of the accumulator) is close to
    lr*wd. On a first step the accumulator started from a known constant, so |g'| is known
    too and x0 = x1 + scale*sign(g')*|g'| is well conditioned; the sign is the one whose
    candidate x0 reproduces it. Elements where the linear form is well conditioned keep it.
    """
    linear = (x1w + scale * gw) / (1 - scale * wd)
    plus = x1w + scale * magnitude
    minus = x1w - scale * magnitude
    pick_plus = (gw + wd * plus - magnitude).abs() <= (gw + wd * minus + magnitude).abs()
    by_magnitude = torch.where(pick_plus, plus, minus)
    return torch.where((1 - scale * wd).abs() >= 0.5, linear, by_magnitude)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sc(value: float, like: torch.Tensor) -> float:
    """A Python scalar as the kernel sees it (cast to the op-math type of ``like``); rounded on the
    host (not through a tensor: a scalar read per call shows up as a sync in profiles)."""
    return float(value) if _opmath(like.dtype) == torch.float64 else f32(value)


def rnd(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Round a float64 intermediate as the kernel does (to the op-math type)."""
    return t.to(_opmath(like.dtype)).to(WORK_DTYPE)


def _ieee_same(t1: torch.Tensor, t2: torch.Tensor | None = None) -> bool:
    """Whether an op on ``t1`` (and ``t2``) in its own dtype rounds as rnd() of the float64 op: for
    float32 (float64) tensors, the op-math type is the dtype, and one multiplication or division of
    two float32 values done in float64 and rounded to float32 is the correctly rounded float32
    result (53 >= 2*24 + 2 bits). Doing it in float32 moves a quarter of the bytes."""
    return t1.dtype in (torch.float32, torch.float64) and (t2 is None or t2.dtype == t1.dtype)


def addcmul_term(value: float, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """The increment ``addcmul(t1, t2, value)`` adds, unrounded: fl(value*t1)*t2."""
    if _ieee_same(t1):
        return w(t1.mul(sc(value, t1))) * w(t2)
    return rnd(sc(value, t1) * w(t1), t1) * w(t2)


def addcdiv_term(value: float, t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
    """The increment ``addcdiv(t1, t2, value)`` adds: fl(fl(value*t1)/t2)."""
    if _ieee_same(t1, t2):
        return w(t1.mul(sc(value, t1)).div_(t2))
    return rnd(rnd(sc(value, t1) * w(t1), t1) / w(t2), t1)


def _grad(ctx: UndoContext) -> torch.Tensor:
    return torch.neg(ctx.grad) if ctx.hyper.get("maximize") else ctx.grad


def _exact(ctx: UndoContext, *keys: str) -> bool:
    if not ctx.exact or ctx.hyper.get("fused") or ctx.hyper.get("capturable"):
        return False
    values: list[Any] = []
    for k in keys:
        v = ctx.hyper[k]
        values.extend(v if isinstance(v, tuple | list) else [v])
    return is_plain_number(*values)


class SGDRule(UndoRule):
    """SGD: g' = g + wd*x0; b1 = mu*b0 + (1-damp)*g' (b1 = g' on the first step);
    d = g' + mu*b1 (nesterov) or b1 (momentum) or g'; x1 = x0 - lr*d."""

    name = "SGD"
    mutates_grad_ok = True

    def undo_param(self, ctx: UndoContext) -> None:
        h = ctx.hyper
        lr, mu, damp, wd = float(h["lr"]), float(h["momentum"]), float(h["dampening"]), float(h["weight_decay"])
        exact = _exact(ctx, "lr", "momentum", "dampening", "weight_decay")
        g = _grad(ctx)
        x1 = ctx.param
        lr_k = sc(lr, x1)

        def g_wd(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return g.add(x, alpha=wd) if wd != 0 else g

        buf = ctx.state.get("momentum_buffer") if mu != 0 else None
        fwd: Forward
        if ctx.grad_mutated:
            # torch's _multi_tensor_sgd with nesterov (no weight decay, no maximize) adds
            # mu*b1 into the gradient tensors in place: .grad now holds the direction d.
            if buf is None or not h["nesterov"] or wd != 0 or h.get("maximize"):
                raise UndoError("the optimizer step modified the gradient in an unknown way")
            d = ctx.grad
            x0 = solve(w(x1) + lr_k * w(d), x1, exact, lambda x, d: x.add(d, alpha=-lr), d)
            if "momentum_buffer" not in ctx.new_keys:
                # g from d = g + mu*b1 (refined against d), then b0 from b1 = mu*b0 + (1-damp)*g.
                g0 = solve(w(d) - sc(mu, buf) * w(buf), d, exact, lambda t, b: t.add(b, alpha=mu), buf)
                bw = (w(buf) - sc(1.0 - damp, buf) * w(g0)) / sc(mu, buf)
                b0 = solve(bw, buf, exact, lambda b, g: b.mul(mu).add(g, alpha=1 - damp), g0)
                buf.copy_(b0)
            x1.copy_(x0)
            return
        if buf is not None and not h["nesterov"]:
            # x1 = x0 - lr*b1, and b1 is known: no dependence on x0 left.
            xw = w(x1) + lr_k * w(buf)

            def fwd(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return x.add(b, alpha=-lr)
        elif buf is not None:
            # x1 = x0 - lr*(g + wd*x0 + mu*b1)  =>  x0 = (x1 + lr*(g + mu*b1)) / (1 - lr*wd)
            if wd == 0:
                xw = w(x1) + lr_k * w(g.add(buf, alpha=mu))
            else:
                xw = (w(x1) + lr * (w(g) + mu * w(buf))) / (1.0 - lr * wd)

            def fwd(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return x.add(g_wd(g, x).add(b, alpha=mu), alpha=-lr)
        else:
            # x1 = x0 - lr*(g + wd*x0)  =>  x0 = (x1 + lr*g) / (1 - lr*wd)
            xw = w(x1) + lr_k * w(g) if wd == 0 else (w(x1) + lr * w(g)) / (1.0 - lr * wd)

            def fwd(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return x.add(g_wd(g, x), alpha=-lr)

        x0 = solve(xw, x1, exact, fwd, g, buf if buf is not None else g)
        if buf is not None and "momentum_buffer" not in ctx.new_keys:
            gp = g_wd(g, x0)  # bit-identical to the forward's g' when x0 is
            bw = (w(buf) - sc(1.0 - damp, buf) * w(gp)) / sc(mu, buf)
            b0 = solve(bw, buf, exact, lambda b, gp: b.mul(mu).add(gp, alpha=1 - damp), gp)
            buf.copy_(b0)
        x1.copy_(x0)


class AdamRule(UndoRule):
    """Adam/AdamW: [AdamW: x' = x0*(1-lr*wd) | Adam: g' = g + wd*x0]; m1 = lerp(m0, g', 1-b1);
    v1 = v0*b2 + (1-b2)*g'^2; denom = sqrt(v1)/sqrt(1-b2^t) + eps;
    x1 = x' - lr/(1-b1^t) * m1/denom. Post-step m1, v1 fix the update, so x0 first."""

    name = "Adam"
    refused_flags = {
        "amsgrad": (
            "the amsgrad running maximum max(v_max, v_t) forgets the previous v_max, so the step cannot be inverted"
        ),
    }

    def check_group(self, group: dict[str, Any]) -> None:
        super().check_group(group)
        if group.get("fused"):
            devices = sorted({p.device.type for p in group["params"]} - {"cpu"})
            if devices:
                raise NotInvertibleError(
                    f"{self.name}(fused=True) on {', '.join(devices)} is not invertible within the promised 2 ulp: "
                    "torch's fused GPU kernel rounds its moments differently from the foreach and single-tensor "
                    "paths this inverse models (its undo left exp_avg_sq 147 ulp off on an H100). Construct the "
                    "optimizer without fused=True (foreach, torch's default on GPUs, is undone within 2 ulp), "
                    f"or {STRATEGY_HINT}."
                )

    def undo_param(self, ctx: UndoContext) -> None:
        h = ctx.hyper
        lr, eps, wd = float(h["lr"]), float(h["eps"]), float(h["weight_decay"])
        beta1, beta2 = (float(b) for b in h["betas"])
        decoupled = bool(h.get("decoupled_weight_decay", False))
        exact = _exact(ctx, "lr", "betas", "eps", "weight_decay")
        assert ctx.step is not None
        t = ctx.step
        m1, v1, x1 = ctx.state["exp_avg"], ctx.state["exp_avg_sq"], ctx.param

        bc1 = 1 - beta1**t
        bc2 = 1 - beta2**t
        step_size = lr / bc1
        denom = (v1.sqrt() / bc2**0.5).add_(eps)  # same ops as torch: bit-identical
        decay = 1 - lr * wd

        xw = w(x1) - addcdiv_term(-step_size, m1, denom)
        if decoupled and wd != 0:
            xw = xw / sc(decay, x1)

        def fwd(x: torch.Tensor, m: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
            if decoupled and wd != 0:
                x = x.mul(decay)
            return x.addcdiv(m, d, value=-step_size)

        # x*decay (decay > 0) then one rounded add of a term free of x: non-decreasing in x.
        x0 = solve(xw, x1, exact, fwd, m1, denom, monotone=decay > 0 or not (decoupled and wd != 0))
        if "exp_avg" not in ctx.new_keys:
            g = _grad(ctx)
            gp = g.add(x0, alpha=wd) if (wd != 0 and not decoupled) else g
            wt = 1 - beta1
            mw = (w(m1) - wt * w(gp)) / (1 - wt)
            vw = ((w(v1) - addcmul_term(1 - beta2, gp, gp)) / sc(beta2, v1)).clamp_min_(0)
            m0 = solve(mw, m1, exact, lambda m, gp: m.lerp(gp, wt), gp)
            # (lerp, for m, reads m twice: not monotone at the rounding level, so searched both ways.)
            v0 = solve(
                vw, v1, exact, lambda v, gp: v.mul(beta2).addcmul(gp, gp, value=1 - beta2), gp, monotone=beta2 > 0
            )
            m1.copy_(m0)
            v1.copy_(v0)
        x1.copy_(x0)


class AdagradRule(UndoRule):
    """Adagrad: g' = g + wd*x0; s1 = s0 + g'^2; clr = lr/(1+(t-1)*lr_decay);
    x1 = x0 - clr*g'/(sqrt(s1)+eps). s1 is known, so x0 solves a linear equation."""

    name = "Adagrad"

    def undo_param(self, ctx: UndoContext) -> None:
        h = ctx.hyper
        lr, eps, wd, lr_decay = float(h["lr"]), float(h["eps"]), float(h["weight_decay"]), float(h["lr_decay"])
        exact = _exact(ctx, "lr", "eps", "weight_decay", "lr_decay")
        assert ctx.step is not None
        t = ctx.step
        s1, x1 = ctx.state["sum"], ctx.param
        g = _grad(ctx)
        clr = lr / (1 + (t - 1) * lr_decay)
        std = s1.sqrt().add_(eps)

        def g_wd(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return g.add(x, alpha=wd) if wd != 0 else g

        std_w = w(std)
        if wd == 0:
            xw = w(x1) - addcdiv_term(-clr, g, std)
        elif t == 1:
            init = float(h.get("initial_accumulator_value", 0.0))
            xw = first_step_x0(w(x1), w(g), wd, clr / std_w, (w(s1) - init).clamp_min_(0).sqrt_())
        else:
            xw = (w(x1) + clr * w(g) / std_w) / (1 - clr * wd / std_w)
        x0 = solve(xw, x1, exact, lambda x, g, std: x.addcdiv(g_wd(g, x), std, value=-clr), g, std)
        if "sum" not in ctx.new_keys:
            gp = g_wd(g, x0)
            if t == 1:
                # The accumulator started as a constant: restore it exactly.
                s0 = torch.full_like(s1, float(h.get("initial_accumulator_value", 0.0)))
            else:
                sw = (w(s1) - addcmul_term(1.0, gp, gp)).clamp_min_(0)
                s0 = solve(sw, s1, exact, lambda s, gp: s.addcmul(gp, gp, value=1), gp)
            s1.copy_(s0)
        x1.copy_(x0)


class RMSpropRule(UndoRule):
    """RMSprop: g' = g + wd*x0; q1 = q0*a + (1-a)*g'^2; [centered: c1 = lerp(c0, g', 1-a),
    avg = sqrt(q1 - c1^2) + eps | avg = sqrt(q1) + eps]; momentum: b1 = mu*b0 + g'/avg,
    x1 = x0 - lr*b1; else x1 = x0 - lr*g'/avg."""

    name = "RMSprop"

    def undo_param(self, ctx: UndoContext) -> None:
        h = ctx.hyper
        lr, alpha, eps, wd, mu = (float(h[k]) for k in ("lr", "alpha", "eps", "weight_decay", "momentum"))
        centered = bool(h["centered"])
        exact = _exact(ctx, "lr", "alpha", "eps", "weight_decay", "momentum")
        q1, x1 = ctx.state["square_avg"], ctx.param
        c1 = ctx.state.get("grad_avg") if centered else None
        b1 = ctx.state.get("momentum_buffer") if mu > 0 else None
        g = _grad(ctx)

        def g_wd(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return g.add(x, alpha=wd) if wd != 0 else g

        avg = (q1.addcmul(c1, c1, value=-1).sqrt_() if c1 is not None else q1.sqrt()).add_(eps)
        fwd: Forward
        if b1 is not None:
            xw = w(x1) + sc(lr, x1) * w(b1)

            def fwd(x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return x.add(b, alpha=-lr)
        else:
            avg_w = w(avg)
            if wd == 0:
                xw = w(x1) - addcdiv_term(-lr, g, avg)
            elif "square_avg" in ctx.new_keys:
                # First step: q0 = 0, so |g'| = sqrt(q1 / (1 - alpha)).
                xw = first_step_x0(w(x1), w(g), wd, lr / avg_w, (w(q1) / (1 - alpha)).sqrt_())
            else:
                xw = (w(x1) + lr * w(g) / avg_w) / (1 - lr * wd / avg_w)

            def fwd(x: torch.Tensor, g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return x.addcdiv(g_wd(g, x), a, value=-lr)

        x0 = solve(xw, x1, exact, fwd, g, avg, b1 if b1 is not None else g)
        if "square_avg" not in ctx.new_keys:
            gp = g_wd(g, x0)
            qw = ((w(q1) - addcmul_term(1 - alpha, gp, gp)) / sc(alpha, q1)).clamp_min_(0)
            q0 = solve(qw, q1, exact, lambda q, gp: q.mul(alpha).addcmul(gp, gp, value=1 - alpha), gp)
            if b1 is not None:
                bw = (w(b1) - addcdiv_term(1.0, gp, avg)) / sc(mu, b1)
                b0 = solve(bw, b1, exact, lambda b, gp, a: b.mul(mu).addcdiv(gp, a), gp, avg)
                b1.copy_(b0)
            if c1 is not None:
                wt = 1 - alpha
                cw = (w(c1) - wt * w(gp)) / (1 - wt)
                c0 = solve(cw, c1, exact, lambda c, gp: c.lerp(gp, wt), gp)
                c1.copy_(c0)
            q1.copy_(q0)
        x1.copy_(x0)
