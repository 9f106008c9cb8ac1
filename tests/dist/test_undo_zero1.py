"""Update-undo on a 2-rank gloo DeepSpeedEngine (data parallel 2).

Variants, each trained 4 iterations of 2 micro-batches, once plain and once with
``attach_to_engine``: the wrapped run must be bit-identical, and undoing iteration 3 must
bring parameters, fp32 master partitions, optimizer state, engine counters and the LR
scheduler back to their state after iteration 2.

* zero1_adamw: ZeRO-1 fp32, AdamW, WarmupLR, gradient clipping (the clip coefficient is
  recorded; the clipped flat fp32 gradient partition is kept past DeepSpeed's step);
* zero1_bf16_sgd: ZeRO-1 bf16 (fp32 master partitions refreshed into bf16 by an all-gather),
  SGD with momentum and weight decay, undone with refresh=False then refresh_params();
* zero0_adagrad: ZeRO-0 fp32 (the engine's optimizer is torch's; DeepSpeed's zero_grad after
  the step is deferred to the next backward);
* zero0_detach: the recovery runtime's path, ``handle.detach()`` then
  ``InvertibleOptimizer.undo()`` with the engine gone;
* ZeRO-2 is refused at attach time, with the strategy to use instead;
* zero1_fp16: ZeRO-1 fp16 with dynamic loss scaling, Adam: a normal step undone, and an
  overflowing step (DeepSpeed skips it; the loss scaler reacts) undone: only the loss scaler
  and the counters change back. DeepSpeed's CPU accelerator claims no fp16 on CPUs without
  AVX512-FP16; torch computes fp16 on the CPU regardless, so the worker says it is supported.

Each of the 2 ranks runs this file as a script (``python test_undo_zero1.py OUT_DIR``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import torch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

WORLD = 2
GAS = 2
MICRO = 4


def worker(out: Path) -> None:
    from deepspeed.accelerator import get_accelerator
    from test_undo_common import write

    from ds_swift.testing.ranks import gloo_rank

    type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
    with gloo_rank() as rank:
        write(out, rank, run_variants(rank))


def _model() -> torch.nn.Module:
    import torch

    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _config(zero: int, bf16: bool = False, clip: float = 0.0, optimizer: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _run_iteration(rank: int, dtype: torch.dtype) -> Any:
    """One training iteration (GAS micro-batches of this rank's data) in ``dtype``; ``overflow``
    makes every loss infinite (the fp16 overflow variant)."""
    import torch

    def run(engine: Any, it: int, overflow: bool = False) -> None:
        for mb in range(GAS):
            g = torch.Generator().manual_seed(1000 * it + 10 * mb + rank)
            x = torch.randn(MICRO, 16, generator=g).to(dtype)
            y = torch.sin(x[:, :4])
            loss = torch.nn.functional.mse_loss(engine(x), y)
            if overflow:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()

    return run


def _partial_backward(engine: Any, it: int) -> None:
    import torch

    x = torch.randn(MICRO, 16, generator=torch.Generator().manual_seed(it))
    x = x.to(next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())


# The variants' engines: each builds its model afresh (the same seed) and a DeepSpeed engine on it.
def _adamw_zero1() -> Any:
    import deepspeed

    m = _model()
    cfg = _config(
        1,
        clip=0.05,
        optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
    )
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
    }
    return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]


def _bf16_sgd() -> Any:
    import deepspeed
    import torch

    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return deepspeed.initialize(model=m, optimizer=opt, config=_config(1, bf16=True))[0]


def _adagrad() -> Any:
    import deepspeed
    import torch

    m = _model()
    opt = torch.optim.Adagrad(m.parameters(), lr=0.05)
    return deepspeed.initialize(model=m, optimizer=opt, config=_config(0))[0]


def _adamw_zero0() -> Any:
    import deepspeed

    m = _model()
    cfg = _config(0, optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
    }
    return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]


def _fp16_adam() -> Any:
    import deepspeed

    m = _model()
    cfg = _config(1, optimizer={"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}})
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]


def _zero2_refusal() -> dict[str, Any]:
    """ZeRO-2: attach_to_engine must refuse it (with a message naming the strategy to use) and leave it as it was."""
    import deepspeed

    from ds_swift.undo import NotInvertibleError, attach_to_engine

    m = _model()
    zero2 = deepspeed.initialize(
        model=m,
        model_parameters=m.parameters(),
        config=_config(2, optimizer={"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}),
    )[0]
    try:
        attach_to_engine(zero2)
        refused = ""
    except NotInvertibleError as e:
        refused = str(e)
    return {"zero2_refused": refused, "zero2_untouched": "_take_model_step" not in vars(zero2)}


def run_variants(rank: int) -> dict[str, Any]:
    import torch
    from test_undo_common import exercise, exercise_detach, exercise_overflow

    fp32, bf16, fp16 = (_run_iteration(rank, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16))
    results: dict[str, Any] = {}
    results["zero1_adamw"] = exercise(_adamw_zero1, fp32, partial_backward=_partial_backward)
    results["zero1_bf16_sgd"] = exercise(_bf16_sgd, bf16, refresh=False)
    results["zero0_adagrad"] = exercise(_adagrad, fp32, partial_backward=_partial_backward)
    results["zero0_detach"] = exercise_detach(_adamw_zero0, fp32)
    results["zero1_fp16"] = exercise(_fp16_adam, fp16)
    results.update(_zero2_refusal())
    results["zero1_fp16_overflow"] = exercise_overflow(_fp16_adam, fp16)
    return results


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from test_undo_common import run_workers

    return run_workers(__file__, tmp_path_factory.mktemp("undo_zero1"), WORLD)


@pytest.mark.parametrize("variant", ["zero1_adamw", "zero1_bf16_sgd", "zero0_adagrad", "zero1_fp16"])
def test_step_undo_restores_pre_step_state(zero_run: dict[int, dict[str, Any]], variant: str) -> None:
    from test_undo_common import check

    for rank in range(WORLD):
        check(zero_run[rank], variant)


def test_fp16_overflow_step_undo_restores_loss_scaler(zero_run: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        r = zero_run[rank]["zero1_fp16_overflow"]
        assert r["skipped"] and r["iteration"] == 2 and r["loss_scale"] == 256.0, r
        assert r["scaler_changed_by_overflow"] and r["skipped_steps_post"] == 1, r
        assert r["scaler_restored"] and r["counters_ok"] and r["last_stepped_after"] == 1, r
        assert r["params_untouched"] and r["masters_untouched"], r


def test_undo_refused_once_next_backward_began(zero_run: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        for variant in ("zero1_adamw", "zero0_adagrad"):
            assert "released" in zero_run[rank][variant]["released_error"], variant


def test_detach_then_undo_without_engine(zero_run: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        r = zero_run[rank]["zero0_detach"]
        assert r["engine_restored"] and r["iteration"] == 1 and r["ulp"] <= 2.0 and r["sched_ok"], r


def test_zero2_refused_with_strategy_hint(zero_run: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        msg = zero_run[rank]["zero2_refused"]
        assert "ZeRO stage 2" in msg and "checkpoint" in msg, msg
        assert zero_run[rank]["zero2_untouched"]


def test_clip_coefficient_recorded(zero_run: dict[int, dict[str, Any]]) -> None:
    for rank in range(WORLD):
        coef = zero_run[rank]["zero1_adamw"]["record"]["clip_coef"]
        assert coef is not None and 0 < coef < 1, coef  # clipping was active at max norm 0.05
        assert zero_run[rank]["zero0_adagrad"]["record"]["clip_coef"] is None


if __name__ == "__main__":
    worker(Path(sys.argv[1]))  # one rank (run_workers starts them)
