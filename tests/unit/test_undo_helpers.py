"""Shared fixtures for the update-undo tests: optimizer factories and error measures."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.undo import InvertibleOptimizer, Lamb
from ds_swift.undo.numerics import elementwise_rel_error, f32, ulp_error, ulp_of

SHAPES = [(37,), (8, 5), (3,)]


@dataclass
class Case:
    family: str
    kwargs: dict[str, Any]
    dtype: torch.dtype
    steps: int
    seed: int
    grad_scale: float = 0.1

    def make(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cls: Callable[..., torch.optim.Optimizer] = {
            "sgd": torch.optim.SGD,
            "adam": torch.optim.Adam,
            "adamw": torch.optim.AdamW,
            "adagrad": torch.optim.Adagrad,
            "rmsprop": torch.optim.RMSprop,
            "lamb": Lamb,
        }[self.family]
        return cls(params, **self.kwargs)


def make_params(case: Case) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(case.seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(case.dtype)) for s in SHAPES]


def grads_for(case: Case, step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(case.seed * 1000 + step + 1)
    out: list[torch.Tensor | None] = []
    for i, s in enumerate(SHAPES):
        if i == len(SHAPES) - 1 and step % 2 == 1:
            out.append(None)  # a parameter without a gradient in some steps: not touched
        else:
            out.append((torch.randn(s, generator=g) * case.grad_scale).to(case.dtype))
    return out


def set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, gr in zip(params, grads, strict=True):
        p.grad = None if gr is None else gr.clone()


def state_copy(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            if p in opt.state:
                out[i] = copy.deepcopy(dict(opt.state[p]))
    return out


def ill_conditioned(case: Case, opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """Elements where the forward itself is (nearly) not injective: Adagrad/RMSprop with L2
    weight decay where lr*wd is close to the denominator sqrt(accumulator) (the Jacobian of
    the step, parameter and accumulator together, is 1 - lr*wd/denominator). Computed from
    the post-step state, as the undo sees it."""
    k = case.kwargs
    wd = float(k.get("weight_decay", 0.0))
    none = torch.zeros(p.shape, dtype=torch.bool)
    if wd == 0 or p not in opt.state:
        return none
    st = opt.state[p]
    if case.family == "adagrad":
        t = float(st["step"])
        clr = k.get("lr", 1e-2) / (1 + (t - 1) * k.get("lr_decay", 0.0))
        denom = st["sum"].double().sqrt() + k.get("eps", 1e-10)
        return (1 - clr * wd / denom).abs() < 0.25
    if case.family == "rmsprop" and not k.get("momentum", 0.0):
        q = st["square_avg"].double()
        if k.get("centered"):
            q = q - st["grad_avg"].double() ** 2
        denom = q.clamp_min(0).sqrt() + k.get("eps", 1e-8)
        return (1 - k.get("lr", 1e-2) * wd / denom).abs() < 0.25
    return none


def tolerance(case: Case, kind: str) -> float:
    """2 ulp, except for state that the inverse divides by a small decay factor, and where
    torch itself overwrote g_t.

    A buffer undone as b0 = (b1 - c*g')/beta carries b1's rounding (and that of g', which
    depends on the recovered x0) times 1/beta: for beta < 0.8 (SGD/RMSprop momentum 0.5, Adam
    beta1 or beta2 0.5) the bound is 0.5 + 2.5/beta ulp. torch's foreach SGD with nesterov (no weight
    decay, no maximize) adds mu*b into .grad in place, so g_t is recovered from the rounded
    sum: the same bound applies to its momentum buffer for every mu.
    """
    k = case.kwargs
    mutated = (
        case.family == "sgd"
        and k.get("nesterov", False)
        and k.get("foreach", False)
        and k.get("weight_decay", 0.0) == 0
        and not k.get("maximize", False)
    )
    decay = None
    if kind == "momentum_buffer":
        decay = float(k["momentum"])
    elif kind == "exp_avg" and "betas" in k:
        decay = float(k["betas"][0])
    elif kind == "exp_avg_sq" and "betas" in k:  # the same inverse, by beta2 (hypothesis found 2.9 ulp at 0.5)
        decay = float(k["betas"][1])
    if decay is not None and (decay < 0.8 or (mutated and kind == "momentum_buffer")):
        return 0.5 + 2.5 / decay
    return 2.0


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def l2_exp_avg_sq_bound(kwargs: dict[str, Any], grad: torch.Tensor, x: Triple, v: Triple) -> float:
    """Adam's exp_avg_sq under L2 weight decay (``Adam(weight_decay=wd)``, not AdamW): the bound on its
    undo error, in ulp_error's unit U (the ulp of the tensor's largest magnitude), that the parameter's
    own undo leaves; 0 where that undo changed no g'. ``x`` and ``v``: (before, post, restored).

    torch's step: g' = fl(g + wd*x0) (one fma), p = fl(b*v0), v1 = fl(p + T) with T = fl(s*g')*g'
    (addcmul: one fma; b and s = 1 - beta2 as float32). x1 = fl(x0 + c) with c free of x0 merges
    neighbours of x0 (where x1's binade is above x0's, or x0 + c is a tie); the undo may return another
    one (information the step destroyed: they step to the same x1), and then g'^ = fl(g + wd*x0^) can
    be a float or more away from g', so T^ != T. The undo's v0^ maps onto v1 under g'^ (refinement),
    the true v0 under g': b*v0 is within ulp(p)/2 of p, p + T within ulp(v1)/2 of v1, and likewise with
    hats, so per element

        |v0^ - v0| <= (ulp(v1) + ulp(p)/2 + ulp(p^)/2 + |T^ - T|) / b.

    (Where refinement found no pre-image, v0^ is the float64 (v1 - T^)/b rounded once: within
    ulp(v0^)/2 + (ulp(v1)/2 + ulp(p)/2 + |T^ - T|)/b, which is less, as ulp(p^) >= b*ulp(v0^)/2.)
    |T^ - T| is about 2*s*|g'|*|g'^ - g'|: for one ulp of g' up to 2^-22*s*g'^2, i.e. up to 4 ulp of
    v1, so tolerance()'s 2 ulp cannot hold here whatever beta2 is, and the bound depends on the data
    (|g'^ - g'| reaches wd*ulp(x) where wd*|x| outweighs |g|). Hypothesis found exp_avg_sq 2.375 U
    off at beta2 0.875, wd 0.1 (x0 one ulp off at a tie, g' then one ulp off: 2*s*|g'|*ulp(g')/b =
    2.55 U; this bound: 3.76 U)."""
    wd = float(kwargs.get("weight_decay", 0.0))
    if wd == 0 or kwargs.get("decoupled_weight_decay"):
        return 0.0
    b, s = f32(kwargs["betas"][1]), f32(1.0 - kwargs["betas"][1])
    g = grad.neg() if kwargs.get("maximize") else grad
    gp, gh = g.add(x[0], alpha=wd), g.add(x[2], alpha=wd)  # as torch forms g' (an fma)
    dt = (gh.mul(s).double() * gh.double() - gp.mul(s).double() * gp.double()).abs()  # products exact
    touched = dt > 0
    if not bool(touched.any()):
        return 0.0

    def ulp(t: torch.Tensor) -> torch.Tensor:
        return torch.nextafter(t.abs(), torch.tensor(math.inf, dtype=t.dtype)).double() - t.abs().double()

    before, post, restored = v
    per = (ulp(post) + ulp(before.mul(b)) / 2 + ulp(restored.mul(b)) / 2 + dt) / b
    unit = ulp_of(max(before.abs().max().item(), post.abs().max().item()), before.dtype)
    return float(per[touched].max()) / unit


@dataclass
class Outcome:
    """Per tensor: (kind, ulp error vs max(|pre|, |post|), elementwise relative errors,
    excluded count, ulp error vs |pre| only)."""

    rows: list[tuple[str, float, torch.Tensor, int, float]]


def run_case(case: Case, refine: bool = True, check_bitwise: bool = True) -> Outcome:
    """Train ``steps`` steps wrapped (and unwrapped alongside, comparing bit for bit), undo
    the last one, and measure every parameter and state tensor against its pre-step copy."""
    params = make_params(case)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = case.make(params)
    ref = case.make(twin)
    wrapped = InvertibleOptimizer(opt, refine=refine)
    before_p: list[torch.Tensor] = []
    before_s: dict[int, dict[str, Any]] = {}
    for step in range(case.steps):
        grads = grads_for(case, step)
        if step == case.steps - 1:
            before_p = [p.detach().clone() for p in params]
            before_s = state_copy(opt)
        set_grads(params, grads)
        set_grads(twin, grads)
        wrapped.step()
        ref.step()
        if check_bitwise:
            for a, b in zip(params, twin, strict=True):
                assert torch.equal(a.detach(), b.detach()), f"wrapped step differs from unwrapped at step {step}"
            for sa, sb in zip(state_copy(opt).values(), state_copy(ref).values(), strict=True):
                for key, va in sa.items():
                    vb = sb[key]
                    same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
                    assert same, f"state {key} differs from unwrapped at step {step}"
    masks = [ill_conditioned(case, opt, p) for p in params]
    post_p = [p.detach().clone() for p in params]
    post_s = state_copy(opt)
    wrapped.undo()
    rows: list[tuple[str, float, torch.Tensor, int, float]] = []
    after_s = state_copy(opt)
    assert after_s.keys() == before_s.keys(), "state entries differ after undo"
    for i, (param, pre) in enumerate(zip(params, before_p, strict=True)):
        keep = ~masks[i]
        pa = param.detach()
        rows.append(
            (
                "param",
                ulp_error(pa[keep], pre[keep], post_p[i][keep]),
                elementwise_rel_error(pa, pre)[keep],
                int((~keep).sum()),
                ulp_error(pa[keep], pre[keep]),
            )
        )
        for key, vb in before_s.get(i, {}).items():
            va = after_s[i][key]
            if not isinstance(vb, torch.Tensor) or vb.dim() == 0:
                assert float(va) == float(vb), f"{key} not restored: {va} != {vb}"
                continue
            vp = post_s[i][key]
            rows.append(
                (
                    key,
                    ulp_error(va[keep], vb[keep], vp[keep]),
                    elementwise_rel_error(va, vb)[keep],
                    int((~keep).sum()),
                    ulp_error(va[keep], vb[keep]),
                )
            )
        assert set(after_s.get(i, {})) == set(before_s.get(i, {}))
    return Outcome(rows)


#: tensor sizes of the undo-path tests: larger and smaller than a slice, odd, and single elements
PATH_SIZES = [5000, 3001, 37, 40, 3, 1, 129]


def step_and_undo(
    path: str,
    cls: type,
    kwargs: dict[str, Any],
    *,
    seed: int,
    steps: int = 3,
    dtype: torch.dtype = torch.float32,
    scale: float = 0.02,
    last_grads: list[torch.Tensor] | None = None,
) -> dict[str, Triple]:
    """Step ``cls`` over PATH_SIZES ``steps`` times through ``InvertibleOptimizer(undo_path=path)``,
    undo the last step; per tensor (before the last step, after it, after its undo). ``last_grads``,
    if given, receives the gradients of the step that was undone."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(n, generator=g) * scale).to(dtype)) for n in PATH_SIZES]
    opt = InvertibleOptimizer(cls(params, **kwargs), undo_path=path)  # type: ignore[arg-type]
    before: dict[str, torch.Tensor] = {}
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2 * (1 + i)).to(dtype)
        if step == steps - 1:
            before = _path_snapshot(opt, params)
            if last_grads is not None:
                last_grads[:] = [p.grad.clone() for p in params if p.grad is not None]
        opt.step()
    post = _path_snapshot(opt, params)
    opt.undo()
    restored = _path_snapshot(opt, params)
    assert restored.keys() == before.keys()
    return {k: (before[k], post[k], restored[k]) for k in before}


def _path_snapshot(opt: InvertibleOptimizer, params: list[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    out = {f"param{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                out[f"{k}{i}"] = copy.deepcopy(v)
    return out
