"""Update-undo on the GPU, as users run it: DeepSpeed's FusedAdam (its real multi_tensor_adam kernel,
JIT-built by DeepSpeed's op builder) inside a 1-rank DeepSpeed engine with bf16 + ZeRO-1
(BF16_Optimizer: fp32 gradient accumulation), gradient clipping and a warm-up LR schedule; the last
step undone must bring the fp32 masters and both moments back within 2 ulp of each tensor's largest
magnitude. Also on the GPU: the fast undo path of torch's AdamW with no host sync at all
(``torch.cuda.set_sync_debug_mode("error")``), and torch's AdamW(fused=True) refused, naming the flag.

Skipped without CUDA; the engine test also without DeepSpeed. Run by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ds_swift.undo import InvertibleOptimizer, NotInvertibleError
from ds_swift.undo.numerics import ulp_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    # DeepSpeed 0.19.8's op builder cannot parse an arch entry like "9.0a": name the device's own.
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        from deepspeed.utils import groups

        groups._WORLD_GROUP = None
        if saved is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = saved


def _engine() -> Any:
    import deepspeed

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 10**9,
    }
    eng, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    return eng


def _state(inner: Any) -> list[dict[str, torch.Tensor]]:
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p, {})
            out.append(
                {"masters": p.detach().clone(), **{k: st[k].clone() for k in ("exp_avg", "exp_avg_sq") if k in st}}
            )
    return out


def test_fused_adam_in_a_bf16_zero1_engine_undoes_within_2_ulp(world: None) -> None:
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from ds_swift.undo import attach_to_engine

    eng = _engine()
    assert isinstance(eng.optimizer, BF16_Optimizer), type(eng.optimizer)
    handle = attach_to_engine(eng)
    assert isinstance(handle.kind.inner, FusedAdam) and handle.optimizer.rule.name == "FusedAdam"
    g = torch.Generator(device="cuda").manual_seed(1)
    before: list[dict[str, torch.Tensor]] = []
    for it in range(6):
        if it == 5:
            before = _state(handle.kind.inner)
        x = torch.randn(8, 512, device="cuda", generator=g).to(torch.bfloat16)
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
    post = _state(handle.kind.inner)
    last = handle.last_stepped_iteration
    assert last is not None
    handle.undo_to(last - 1)
    undone = _state(handle.kind.inner)
    rows = []
    for b, p, u in zip(before, post, undone, strict=True):
        for k in b:
            rows.append((k, ulp_error(u[k], b[k], p[k]), float((u[k] == b[k]).double().mean())))
    for k, ulps, exact in rows:
        print(f"FusedAdam bf16+ZeRO-1 undo: {k:10s} max {ulps:.2f} ulp, {100 * exact:.2f}% bitwise")
    assert rows and all(ulps <= 2.0 for _, ulps, _ in rows), rows
    handle.remove()


def test_fast_undo_of_adamw_on_the_gpu_never_syncs_and_matches_the_reference() -> None:
    results = {}
    for path in ("reference", "fast"):
        g = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=g) * 0.02) for n in (1 << 20, 4097, 33, 1)]
        opt = InvertibleOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1), undo_path=path)  # type: ignore[arg-type]
        for it in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
            if it == 2:
                before = [p.detach().clone() for p in params]
            opt.step()
        post = [p.detach().clone() for p in params]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if path == "fast" else "default")
        try:
            opt.undo()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[path] = [p.detach().clone() for p in params]
        assert all(ulp_error(p, b, q) <= 2.0 for p, b, q in zip(results[path], before, post, strict=True))
    # CUDA kernels round every element alike, wherever a slice or pack puts it: equal bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(results["fast"], results["reference"], strict=True))


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_torch_fused_adam_on_cuda_is_refused_naming_the_flag(cls: type) -> None:
    p = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    with pytest.raises(NotInvertibleError, match=r"fused=True\) on cuda"):
        InvertibleOptimizer(cls([p], lr=1e-3, fused=True))
