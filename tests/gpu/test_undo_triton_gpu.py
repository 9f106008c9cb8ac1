"""The fused Triton undo kernel (ds_swift.undo.triton_adam) against torch's real CUDA AdamW step.

The one risk a CPU cannot check: the kernel's refinement replays the forward step and keeps a
candidate only where the replay reproduces the stepped value bit for bit, so the replay must round as
torch's CUDA kernels do (which multiply-adds nvcc contracted to an fma, true division or a multiplied
reciprocal). Here each flavour's replay (``adam_forward``) is compared bit for bit with torch's step
(foreach, the CUDA default, and foreach=False), and the undo through ``undo_path="fused"`` must be
within 2 ulp, exact for almost every element, at least as exact as the fast path, and free of host
syncs. Skipped without CUDA or Triton.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer
from ds_swift.undo.numerics import ulp_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton_adam = pytest.importorskip("ds_swift.undo.triton_adam", reason="needs Triton")

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


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
@pytest.mark.parametrize(
    "kwargs",
    [{"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True}, {"weight_decay": 0.0}],
    ids=["wd", "wd_maximize", "no_wd"],
)
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_the_kernels_replay_is_torchs_cuda_step_bit_for_bit(cls: type, kwargs: dict[str, Any], foreach: bool) -> None:
    t = 7.0
    x, grad, m, v = _state(1, t)
    p = torch.nn.Parameter(x.clone())
    p.grad = grad.clone()
    opt = cls([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, foreach=foreach, **kwargs)
    opt.state[p] = {"step": torch.tensor(t - 1), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    h = opt.param_groups[0]
    xs, ms, vs = x.clone(), m.clone(), v.clone()
    flavour = triton_adam.CUDA_FOREACH if foreach else triton_adam.CUDA_SINGLE
    triton_adam.adam_forward(xs, grad, ms, vs, h, t, flavour=flavour)
    diffs = {
        "exp_avg": int((ms != opt.state[p]["exp_avg"]).sum()),
        "exp_avg_sq": int((vs != opt.state[p]["exp_avg_sq"]).sum()),
        "param": int((xs != p.detach()).sum()),
    }
    print(f"replay vs torch CUDA {cls.__name__} {'foreach' if foreach else 'single'} {kwargs}: {diffs} of {N} differ")
    assert diffs == {"exp_avg": 0, "exp_avg_sq": 0, "param": 0}


@pytest.mark.parametrize("foreach", [None, False], ids=["default_foreach", "single"])
def test_fused_undo_on_cuda_is_exact_where_the_fast_path_is_and_never_syncs(foreach: bool | None) -> None:
    results: dict[str, list[torch.Tensor]] = {}
    before: list[torch.Tensor] = []
    post: list[torch.Tensor] = []
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
            opt.step()
        post = _flat(inner, params)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.undo()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[path] = _flat(inner, params)
    for path, restored in results.items():
        for i, (r, b, q) in enumerate(zip(restored, before, post, strict=True)):
            err, exact = ulp_error(r, b, q), float((r == b).double().mean())
            print(f"{path} undo, tensor {i} ({r.numel()} elements): {err:.2f} ulp, {100 * exact:.3f}% bitwise")
            assert err <= 2.0, (path, i, err)
    for i, (f, s, b) in enumerate(zip(results["fused"], results["fast"], before, strict=True)):
        assert int((f == b).sum()) >= int((s == b).sum()), i
        if f.numel() >= N:
            assert float((f == b).double().mean()) > 0.99, i


def _flat(inner: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    out += [inner.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq") for p in params]
    return out
