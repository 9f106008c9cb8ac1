"""Inverse of LAMB: ds_swift.undo.Lamb and deepspeed.ops.lamb.FusedLamb (same arithmetic).

With c = step_size*trust (trust recorded at step time: it depends on |x0|, which only the
pre-step parameter determines) and r = m1/denom(v1) known after the step,

    x1 = x0 - c*(r + wd*x0)   =>   x0 = (x1 + c*r) / (1 - c*wd)
    m0 = (m1 - (1-b1)*g) / b1,   v0 = (v1 - (1-b2)*g^2) / b2,   g = grad / combined_scale.

apex's FusedLAMB is refused (see rule_registry.rule_for): its kernel overwrites .grad with the update.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_swift.undo.lamb import Lamb, lamb_direction, lamb_step_size
from ds_swift.undo.numerics import WORK_DTYPE, f32, w
from ds_swift.undo.records import GroupRecord, NotInvertibleError, UndoError
from ds_swift.undo.rules import UndoContext, UndoRule, is_plain_number
from ds_swift.undo.rules_torch import addcmul_term, sc, solve

__all__ = ["DeepSpeedFusedLambRule", "LambRule", "lamb_class"]


def lamb_class() -> type:
    return Lamb


class LambRule(UndoRule):
    """ds_swift.undo.Lamb: forward replayable op for op (exact refinement)."""

    name = "Lamb"
    replayable = True
    kernel_floats = False

    def post_step(self, optimizer: Any, groups: list[GroupRecord], call_kwargs: dict[str, Any]) -> None:
        coeffs = list(getattr(optimizer, "lamb_coeffs", []))
        records = [pr for g in groups for pr in g.params]
        if len(coeffs) != len(records):
            # Without the trust ratios the step has no inverse: say so at undo time.
            for pr in records:
                pr.extra["trust_ratio_missing"] = f"{len(coeffs)} trust ratios for {len(records)} updated tensors"
            return
        for pr, coeff in zip(records, coeffs, strict=True):
            pr.extra["trust_ratio"] = coeff
        for g in groups:
            for pr in g.params:
                pr.extra["eps_inside_sqrt"] = self._eps_inside(optimizer, g.hyper)

    def _eps_inside(self, optimizer: Any, hyper: dict[str, Any]) -> bool:
        return bool(hyper.get("eps_inside_sqrt", False))

    def undo_param(self, ctx: UndoContext) -> None:
        h = ctx.hyper
        if "trust_ratio" not in ctx.extra:
            raise UndoError(f"LAMB trust ratio was not recorded: {ctx.extra.get('trust_ratio_missing', 'unknown')}")
        # A CUDA kernel takes its hyperparameters as C floats: 1 - float(0.9) is 2 ulp from 0.1.
        real = f32 if self.kernel_floats else float
        lr, eps, wd = real(h["lr"]), real(h["eps"]), real(h["weight_decay"])
        beta1, beta2 = (real(b) for b in h["betas"])
        assert ctx.step is not None
        t = int(ctx.step)
        coeff = ctx.extra["trust_ratio"]
        grad_scale = float(ctx.extra.get("grad_scale", 1.0))
        exact = (
            self.replayable
            and ctx.exact
            and grad_scale == 1.0
            and is_plain_number(lr, eps, wd, beta1, beta2)
            and isinstance(coeff, torch.Tensor)
        )
        m1, v1, x1 = ctx.state["exp_avg"], ctx.state["exp_avg_sq"], ctx.param
        step_size = lamb_step_size(lr, beta1, beta2, t, bool(h["bias_correction"]))
        r = lamb_direction(m1, v1, eps, bool(ctx.extra.get("eps_inside_sqrt", False)))
        # A recorded trust ratio is a device tensor: read it as a 0-dim float64 tensor, not with
        # float() (a host sync per slice); the float64 product is the same either way.
        c: torch.Tensor | float = (
            coeff.reshape(-1)[0].to(WORK_DTYPE) if isinstance(coeff, torch.Tensor) else float(coeff)
        ) * step_size
        scale = coeff * step_size if isinstance(coeff, torch.Tensor) else None
        if wd == 0 and scale is not None and self.replayable:
            xw = w(x1) + w(r.mul(scale))  # the increment exactly as Lamb.step formed it
        else:
            xw = (w(x1) + c * w(r)) / (1 - c * wd)

        def fwd(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            assert scale is not None  # only replayed with a tensor trust ratio (see exact)
            u = r.add(x, alpha=wd) if wd != 0 else r
            return x.sub(u.mul(scale))

        x0 = solve(xw, x1, exact, fwd, r)
        if "exp_avg" not in ctx.new_keys:
            g = ctx.grad
            if grad_scale == 1.0:
                mw = (w(m1) - sc(1 - beta1, m1) * w(g)) / sc(beta1, m1)
                vw = ((w(v1) - addcmul_term(1 - beta2, g, g)) / sc(beta2, v1)).clamp_min_(0)
            else:
                gw = w(g) / grad_scale
                mw = (w(m1) - (1 - beta1) * gw) / beta1
                vw = ((w(v1) - (1 - beta2) * gw * gw) / beta2).clamp_min_(0)
            m0 = solve(mw, m1, exact, lambda m, g: m.mul(beta1).add(g, alpha=1 - beta1), g)
            v0 = solve(vw, v1, exact, lambda v, g: v.mul(beta2).addcmul(g, g, value=1 - beta2), g)
            m1.copy_(m0)
            v1.copy_(v0)
        x1.copy_(x0)


class DeepSpeedFusedLambRule(LambRule):
    """deepspeed.ops.lamb.FusedLamb (CUDA kernel): same inverse, float64 without replay, and
    the gradient divided by the combined loss/clip scale the kernel divided it by."""

    name = "FusedLamb"
    replayable = False
    kernel_floats = True

    def _eps_inside(self, optimizer: Any, hyper: dict[str, Any]) -> bool:
        return getattr(optimizer, "eps_mode", 1) == 0

    def select(
        self, optimizer: Any, group: dict[str, Any], call_kwargs: dict[str, Any], group_index: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        grads = call_kwargs.get("grads")
        if grads is None:
            return super().select(optimizer, group, call_kwargs, group_index)
        if not isinstance(grads, list | tuple):
            raise NotInvertibleError("FusedLamb.step(grads=<generator>) cannot be recorded; pass a list")
        per_group = grads if grads and isinstance(grads[0], list | tuple) else [grads]
        chosen = per_group[group_index] if group_index < len(per_group) else [None] * len(group["params"])
        pairs = []
        for p, g in zip(group["params"], chosen, strict=False):
            grad = g if g is not None else p.grad
            if grad is not None:
                pairs.append((p, grad))
        return pairs

    def post_step(self, optimizer: Any, groups: list[GroupRecord], call_kwargs: dict[str, Any]) -> None:
        super().post_step(optimizer, groups, call_kwargs)
        scale = float(call_kwargs.get("scale", 1.0))
        grad_norms = call_kwargs.get("grad_norms")
        for gi, g in enumerate(groups):
            norms = grad_norms[gi] if grad_norms is not None and gi < len(grad_norms) else None
            if norms is not None and not isinstance(norms, list):
                norms = [norms]
            # FusedLamb pairs grad_norms with group["params"] by position, with or without a grad.
            position = {id(p): i for i, p in enumerate(g.group["params"])}
            for pr in g.params:
                combined = scale
                max_norm = float(g.hyper.get("max_grad_norm", 0.0))
                pi = position.get(id(pr.param), -1)
                if max_norm > 0 and norms is not None and 0 <= pi < len(norms) and norms[pi] is not None:
                    clip = ((float(norms[pi]) / scale) + 1e-6) / max_norm
                    if clip > 1:
                        combined = clip * scale
                pr.extra["grad_scale"] = combined
