"""LAMB in plain PyTorch, with DeepSpeed FusedLamb's arithmetic, keeping its trust ratios.

Same update as ``deepspeed.ops.lamb.FusedLamb`` (csrc/lamb/fused_lamb_cuda_kernel.cu):

    m1 = b1*m0 + (1-b1)*g;   v1 = b2*v0 + (1-b2)*g^2
    step_size = lr*sqrt(1-b2^t)/(1-b1^t)   (lr without bias correction)
    r = m1 / (sqrt(v1) + eps)              (sqrt(v1 + eps) with eps_inside_sqrt)
    u = r + wd*x0
    trust = clamp(|x0| / |u|, min_coeff, max_coeff)  (1 if either norm is 0)
    x1 = x0 - step_size*trust*u

so it runs on the CPU and anywhere torch does. ``lamb_coeffs`` holds this step's trust
ratios (0-dim tensors, one per updated parameter, in update order), as FusedLamb's does:
they are the one thing undo needs that the post-step state does not determine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb", "lamb_direction", "lamb_step_size"]


def lamb_step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    if not bias_correction:
        return lr
    return lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def lamb_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """r = m / denom (a new tensor)."""
    denom = exp_avg_sq.add(eps).sqrt_() if eps_inside_sqrt else exp_avg_sq.sqrt().add_(eps)
    return exp_avg / denom


class Lamb(torch.optim.Optimizer):
    """LAMB optimizer (You et al., 2019), DeepSpeed FusedLamb semantics, torch only.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled weight decay inside the trust-ratio update.
        bias_correction: apply Adam's bias correction to the step size.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        eps_inside_sqrt: use sqrt(v + eps) instead of sqrt(v) + eps.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"Invalid trust-ratio clamp: min_coeff={min_coeff}, max_coeff={max_coeff}")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
            "eps_inside_sqrt": eps_inside_sqrt,
        }
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coeffs: list[torch.Tensor] = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lamb_step_size(group["lr"], beta1, beta2, state["step"], group["bias_correction"])
                update = lamb_direction(exp_avg, exp_avg_sq, group["eps"], group["eps_inside_sqrt"])
                if wd != 0:
                    update.add_(p, alpha=wd)
                coeff = trust_ratio(p, update, group["min_coeff"], group["max_coeff"])
                p.sub_(update.mul_(coeff * step_size))
                coeffs.append(coeff)
        self.lamb_coeffs = coeffs
        return loss


def trust_ratio(param: torch.Tensor, update: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """|param| / |update| clamped, 1 where a norm is 0: a 0-dim tensor, at least float32 (no sync)."""
    dtype = torch.promote_types(param.dtype, torch.float32)  # norms of bf16/fp16 in fp32
    w_norm = torch.linalg.vector_norm(param, dtype=dtype)
    u_norm = torch.linalg.vector_norm(update, dtype=dtype)
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
