"""The fused Triton undo kernel (ds_swift.undo.triton_adam) against torch's real CUDA AdamW step.

The one risk a CPU cannot check: the kernel's refinement replays the forward step and keeps a
candidate only where the replay reproduces the stepped value bit for bit, so the replay must round as
torch's CUDA kernels do (which multiply-adds nvcc contracted to an fma, true division or a multiplied
reciprocal). Here each flavour's replay (``adam_forward``) is compared bit for bit with torch's step
(foreach, the CUDA default, and foreach=False), and the undo through ``undo_path="fused"`` must be
within 2 ulp, at least as exact as the fast path (element count), and free of host
syncs. Skipped without CUDA or Triton.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer
from ds_swift.undo.numerics import ulp_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton_adam = pytest.importorskip("ds_swift.undo.triton_adam", reason="needs Triton")
triton_adam_replay = pytest.importorskip("ds_swift.undo.triton_adam_replay", reason="needs Triton")

N = 1 << 22  # 4M elements: every rounding case many times over, a fraction of a second


def _state(seed: int, t: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, device="cuda", generator=g) * 0.02
    grad = torch.randn(N, device="cuda", generator=g) * 1e-3
    m = torch.randn(N, device="cuda", generator=g) * 1e-4
    v = torch.rand(N, device="cuda", generator=g) * 1e-7 * (1 - 0.95 ** (t - 1))
    # Subnormals (the moments of a gradient that stayed zero for many steps): torch's kernels
    # keep them; a replay that flushed them to zero (ftz) would differ here.
    v[::16] *= 1e-33
    m[::16] *= 1e-20
    grad[::16] = 0.0
    x[::32] *= 1e-37
    return x, grad, m, v


# Each case compiles its own kernel (about 2 s): the options each paired with each path, not crossed.
REPLAY_CASES = [
    (torch.optim.AdamW, {"weight_decay": 0.1}, True),
    (torch.optim.AdamW, {"weight_decay": 0.1, "maximize": True}, False),
    (torch.optim.AdamW, {"weight_decay": 0.1}, False),
    (torch.optim.AdamW, {"weight_decay": 0.0}, True),
    (torch.optim.Adam, {"weight_decay": 0.1}, True),
    (torch.optim.Adam, {"weight_decay": 0.1, "maximize": True}, False),
]


@pytest.mark.parametrize(("cls", "kwargs", "foreach"), REPLAY_CASES)
def test_the_kernels_replay_is_torchs_cuda_step_bit_for_bit(cls: type, kwargs: dict[str, Any], foreach: bool) -> None:
    # Several steps: the scalars (bias corrections, their reciprocals) round differently from step to
    # step; t = 1, 3 and 5 once showed a reciprocal rounded twice (foreach=False), t = 7 did not.
    for t in (1.0, 3.0, 5.0, 7.0):
        x, grad, m, v = _state(1, t)
        p = torch.nn.Parameter(x.clone())
        p.grad = grad.clone()
        opt = cls([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, foreach=foreach, **kwargs)
        opt.state[p] = {"step": torch.tensor(t - 1), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        opt.step()
        h = opt.param_groups[0]
        xs, ms, vs = x.clone(), m.clone(), v.clone()
        flavour = triton_adam.CUDA_FOREACH if foreach else triton_adam.CUDA_SINGLE
        triton_adam_replay.adam_forward(xs, grad, ms, vs, h, t, flavour=flavour)
        diffs = {
            "exp_avg": int((ms != opt.state[p]["exp_avg"]).sum()),
            "exp_avg_sq": int((vs != opt.state[p]["exp_avg_sq"]).sum()),
            "param": int((xs != p.detach()).sum()),
        }
        kind = "foreach" if foreach else "single"
        print(f"replay vs torch CUDA {cls.__name__} {kind} {kwargs} step {t:g}: {diffs} of {N} differ")
        assert diffs == {"exp_avg": 0, "exp_avg_sq": 0, "param": 0}, t


@pytest.mark.parametrize("foreach", [None, False], ids=["default_foreach", "single"])
def test_fused_undo_on_cuda_is_exact_where_the_fast_path_is_and_never_syncs(foreach: bool | None) -> None:
    results: dict[str, list[torch.Tensor]] = {}
    before: list[torch.Tensor] = []
    post: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    h: dict[str, Any] = {}
    for path in ("fast", "fused"):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g) * 0.02) for n in (N, 4097, 33, 1)]
        inner = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=foreach)
        opt = InvertibleOptimizer(inner, undo_path=path)  # type: ignore[arg-type]
        for it in range(3):
            for q in params:
                q.grad = torch.randn(q.shape, device="cuda", generator=g) * 1e-3
            if it == 2:
                before = _flat(inner, params)
                grads = [q.grad.clone() for q in params if q.grad is not None]
            opt.step()
        post = _flat(inner, params)
        h = dict(inner.param_groups[0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.undo()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[path] = _flat(inner, params)
    # The kernel's model of the step that ran (the refinement's premise): its replay of step 3 from the
    # state before it is torch's step 3, bit for bit, in every tensor.
    flavour = triton_adam.CUDA_SINGLE if foreach is False else triton_adam.CUDA_FOREACH
    k = len(grads)
    for i in range(k):
        x, m, v = before[i].clone(), before[k + i].clone(), before[2 * k + i].clone()
        triton_adam_replay.adam_forward(x, grads[i], m, v, h, 3.0, flavour=flavour)
        diffs = [int((a != b).sum()) for a, b in ((x, post[i]), (m, post[k + i]), (v, post[2 * k + i]))]
        print(f"replay of step 3, tensor {i}: p/m/v elements differing from torch's step {diffs}")
        assert diffs == [0, 0, 0], (i, diffs)
    for path, restored in results.items():
        for i, (r, b, q) in enumerate(zip(restored, before, post, strict=True)):
            err, exact = ulp_error(r, b, q), float((r == b).double().mean())
            print(f"{path} undo, tensor {i} ({r.numel()} elements): {err:.2f} ulp, {100 * exact:.3f}% bitwise")
            assert err <= 2.0, (path, i, err)
    # A share of the elements cannot be restored bit for bit by anyone (the step merged pre-images).
    # The fused path replays the step as it ran; the fast path's replay divides as a single tensor op
    # does, so under foreach it fails to refine where the two differ. Where several pre-images exist
    # the two may pick different ones (their float64 estimates differ in the last bits): a slack of
    # three standard deviations of that coin flip over the elements neither restores for sure.
    for i, (f, s, b) in enumerate(zip(results["fused"], results["fast"], before, strict=True)):
        fused_exact, fast_exact, n = int((f == b).sum()), int((s == b).sum()), f.numel()
        q = 1 - max(fused_exact, fast_exact) / n
        slack = 1 + int(3 * math.sqrt(n * q * (1 - q)))
        print(f"tensor {i}: bit for bit fused {fused_exact}, fast {fast_exact} of {n} (slack {slack})")
        assert fused_exact >= fast_exact - slack, i


def _flat(inner: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    out += [inner.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq") for p in params]
    return out


class _StandInFusedAdam(torch.optim.Optimizer):
    """FusedAdam's bookkeeping and arithmetic in float32 torch ops (as tests/unit/test_undo_fused_adam's
    stand-in): what ran the step does not matter here, only that the rule and the kernel undo it alike."""

    def __init__(self, params: Any, adam_w_mode: bool) -> None:
        super().__init__(params, dict(lr=3e-4, bias_correction=True, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
        self.adam_w_mode = 1 if adam_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            state: dict[str, Any] = {}
            todo = []
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                todo.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"]))
            state["step"] += 1
            t = state["step"]
            for p, g, m, v in todo:
                g = g + wd * p if self.adam_w_mode == 0 else g
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
                p.sub_(lr * (update + wd * p if self.adam_w_mode == 1 else update))


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_deepspeed_fused_adam_kernel_on_cuda_equals_its_rule(
    monkeypatch: pytest.MonkeyPatch, adam_w_mode: bool
) -> None:
    import sys
    import types

    mod = types.ModuleType("deepspeed.ops.adam.fused_adam")
    mod.FusedAdam = _StandInFusedAdam  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam.fused_adam", mod)
    results = {}
    for path in ("fast", "fused"):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g) * 0.02) for n in (N, 4097, 33)]
        inner = _StandInFusedAdam(params, adam_w_mode)
        opt = InvertibleOptimizer(inner, undo_path=path)  # type: ignore[arg-type]
        assert opt.rule.name == "FusedAdam"
        for _ in range(3):
            for q in params:
                q.grad = torch.randn(q.shape, device="cuda", generator=g) * 1e-3
            opt.step()
        opt.undo()
        results[path] = _flat(inner, params)
    # The same float64 formula; torch's CUDA division by a host scalar multiplies by its reciprocal
    # (the kernel divides), a float64 ulp apart, which moves the float32 result in ~2^-29 of cases.
    for i, (f, s) in enumerate(zip(results["fused"], results["fast"], strict=True)):
        differ = int((f != s).sum())
        print(f"FusedAdam fused vs fast undo, tensor {i}: {differ} of {f.numel()} differ")
        assert differ <= max(1, f.numel() // 1_000_000), (i, differ)
