"""The FusedAdam undo rule against DeepSpeed's real CUDA kernel (csrc/adam/multi_tensor_adam.cu).

The unit test (tests/unit/test_undo_fused_adam.py) checks the rule against a torch stand-in of the
kernel. Here the kernel itself is built from DeepSpeed's sources with DeepSpeed's own flags
(``-O3 --use_fast_math``: approximate division and square root) and steps fp32 masters of realistic
magnitudes, the way ZeRO-1 + bf16 steps them; the rule must undo the step within 2 ulp (measured as
``ulp_error`` defines it: at the larger scale of a tensor before and after the step). Skipped
without CUDA or without DeepSpeed's sources (``deepspeed`` installed, or ``DS_SWIFT_DEEPSPEED_CSRC``
naming its ``ops/csrc`` folder).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer
from ds_swift.undo.numerics import ulp_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MACROS = ["-DVERSION_GE_1_1", "-DVERSION_GE_1_3", "-DVERSION_GE_1_5"]


def _csrc() -> Path | None:
    env = os.environ.get("DS_SWIFT_DEEPSPEED_CSRC")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "csrc"
    return path if (path / "adam" / "multi_tensor_adam.cu").exists() else None


@pytest.fixture(scope="module", params=[True, False], ids=["fast_math", "ieee"])
def kernel(request: pytest.FixtureRequest) -> Any:
    csrc = _csrc()
    if csrc is None:
        pytest.skip("DeepSpeed's csrc not found (install deepspeed or set DS_SWIFT_DEEPSPEED_CSRC)")
    from torch.utils.cpp_extension import load

    fast = ["--use_fast_math"] if request.param else []
    return load(
        name="swift_test_fused_adam" + ("_fast" if request.param else "_ieee"),
        sources=[str(csrc / "adam" / "fused_adam_frontend.cpp"), str(csrc / "adam" / "multi_tensor_adam.cu")],
        extra_include_paths=[str(csrc / "includes"), str(csrc / "adam")],
        extra_cflags=["-O3", *MACROS],
        extra_cuda_cflags=["-O3", "-lineinfo", *fast, *MACROS],
    ).multi_tensor_adam


class KernelFusedAdam(torch.optim.Optimizer):
    """deepspeed.ops.adam.FusedAdam.step for fp32 parameters, calling the real kernel (the step
    bookkeeping as in ops/adam/fused_adam.py: one count per dtype list, on its last parameter)."""

    kernel: Any = None

    def __init__(self, params: Any, lr: float, weight_decay: float, adam_w_mode: bool = True) -> None:
        super().__init__(
            params, dict(lr=lr, bias_correction=True, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
        )
        self.adam_w_mode = 1 if adam_w_mode else 0
        self._noop = torch.zeros(1, dtype=torch.int32, device="cuda")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            lists: list[list[torch.Tensor]] = [[], [], [], []]
            state: dict[str, Any] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = group.get("step", 0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                for lst, t in zip(lists, (p.grad, p.data, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            if lists[0]:
                state["step"] += 1
                b1, b2 = group["betas"]
                self.kernel(
                    2048 * 32,
                    self._noop,
                    lists,
                    group["lr"],
                    b1,
                    b2,
                    group["eps"],
                    state["step"],
                    self.adam_w_mode,
                    1,
                    group["weight_decay"],
                )


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "l2"])
def test_the_rule_undoes_the_real_kernel_within_2_ulp(
    kernel: Any, adam_w_mode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = types.ModuleType("deepspeed.ops.adam.fused_adam")
    mod.FusedAdam = KernelFusedAdam  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam.fused_adam", mod)
    monkeypatch.setattr(KernelFusedAdam, "kernel", staticmethod(kernel))
    g = torch.Generator(device="cuda").manual_seed(0)
    # GPT-like masters: weights ~N(0, 0.02), layer-norm gains near 1, biases near 0.
    params = [
        torch.nn.Parameter(torch.randn(1024, 1024, device="cuda", generator=g) * 0.02),
        torch.nn.Parameter(1 + torch.randn(1024, device="cuda", generator=g) * 0.01),
        torch.nn.Parameter(torch.randn(4096, device="cuda", generator=g) * 1e-3),
    ]
    inner = KernelFusedAdam(params, lr=3e-4, weight_decay=0.1, adam_w_mode=adam_w_mode)
    opt = InvertibleOptimizer(inner)
    assert opt.rule.name == "FusedAdam"
    for it in range(8):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
        if it == 7:
            before = [p.detach().clone() for p in params]
            moments = [{k: inner.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in params]
        opt.step()
    after = [p.detach().clone() for p in params]
    after_moments = [{k: inner.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")} for p in params]
    opt.undo()
    errors = []
    for i, p in enumerate(params):
        errors.append(
            ("param", i, ulp_error(p.detach(), before[i], after[i]), (p.detach() != before[i]).float().mean().item())
        )
        for k in ("exp_avg", "exp_avg_sq"):
            errors.append(
                (
                    k,
                    i,
                    ulp_error(inner.state[p][k], moments[i][k], after_moments[i][k]),
                    (inner.state[p][k] != moments[i][k]).float().mean().item(),
                )
            )
    for name, i, ulp, frac in errors:
        print(f"{name:10s} tensor {i}: max {ulp:.2f} ulp, {100 * frac:.3f}% of elements not bitwise")
    assert all(ulp <= 2.0 for _, _, ulp, _ in errors), errors
