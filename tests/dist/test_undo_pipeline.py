"""Update-undo on a 4-rank gloo DeepSpeed pipeline (PipelineEngine).

One launch of 4 ranks builds, one after the other, two pipelines, each trained 4 iterations
of 4 micro-batches, once plain and once with ``attach_to_engine``; the wrapped run must be
bit-identical and undoing iteration 3 must restore every stage's parameters, fp32 masters,
optimizer state, counters and LR scheduler to their state after iteration 2:

* pp2_dp2_zero1: pipeline 2 x data parallel 2, ZeRO-1 fp32, Adam (torch), WarmupLR;
* pp4_bf16_lamb: pipeline 4, bf16 (DeepSpeed's BF16_Optimizer: the fp32 gradient buffer's
  clearing after the step is deferred to the next backward), ds_swift.undo.Lamb.

The pipeline's backward starts through the BackwardPass instruction (hooked through the
shared instruction seam), so this also covers deferring the gradient zeroing there.
This file is also the worker: ``python test_undo_pipeline.py OUT_DIR`` per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

WORLD = 4
GAS = 4
MICRO = 2
HIDDEN = 16
VARIANTS = {"pp2_dp2_zero1": (2, 1, False), "pp4_bf16_lamb": (4, 0, True)}


def worker(out: Path) -> None:
    from test_undo_common import write

    from ds_swift.testing.ranks import gloo_rank

    with gloo_rank() as rank:
        write(out, rank, {variant: run_variant(variant) for variant in VARIANTS})


def run_variant(variant: str) -> dict[str, Any]:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from test_undo_common import exercise

    from ds_swift.undo import Lamb

    pp, zero, bf16 = VARIANTS[variant]
    dtype = torch.bfloat16 if bf16 else torch.float32

    def make_engine() -> Any:
        torch.manual_seed(11)
        layers = [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(2 * pp - 1)]
        layers.append(LayerSpec(torch.nn.Linear, HIDDEN, 2))
        model = PipelineModule(layers=layers, num_stages=pp, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        dp = WORLD // pp
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "train_batch_size": MICRO * GAS * dp,
            "zero_optimization": {"stage": zero},
            "steps_per_print": 10**9,
        }
        if bf16:
            cfg["bf16"] = {"enabled": True}
            opt = Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
            return deepspeed.initialize(model=model, optimizer=opt, config=cfg)[0]
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
        }
        return deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]

    def run_iteration(engine: Any, it: int) -> None:
        dp_id = engine.grid.get_data_parallel_id()
        batches = []
        for mb in range(GAS):
            g = torch.Generator().manual_seed(1000 * it + 10 * mb + dp_id)
            x = torch.randn(MICRO, HIDDEN, generator=g)
            batches.append((x.to(dtype), torch.cos(x[:, :2]).to(dtype)))
        engine.train_batch(data_iter=iter(batches))

    return exercise(make_engine, run_iteration)


@pytest.fixture(scope="module")
def pipe_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    from test_undo_common import run_workers

    return run_workers(__file__, tmp_path_factory.mktemp("undo_pipeline"), WORLD)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pipeline_step_undo_restores_every_stage(pipe_run: dict[int, Any], variant: str) -> None:
    from test_undo_common import check

    for rank in range(WORLD):
        check(pipe_run[rank], variant)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))  # one rank (run_workers starts them)
