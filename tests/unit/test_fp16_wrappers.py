"""fp16 with dynamic loss scaling where bf16 has nothing alike. One-rank gloo world, real DeepSpeed
ZeRO-1 fp16 engines (tests/unit/test_kept_wrappers.py).

- SCAR's partial recovery: the replacement takes the survivors' loss scale, not the checkpoint's (it
  took their counters and LR schedule but kept the checkpoint's scaler, and then unscaled every later
  gradient by another factor than its peers).
- fp16 with fp32 gradient accumulation under ZeRO-1 sums in ``param.grad_accum``: refused where
  ds-swift reads or writes the sum (parallel recovery, partial recomputation), not read wrongly."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_kept_wrappers import engine, world  # noqa: F401 - world is the fixture

from ds_swift.patches.deepspeed_grad_accum import accumulator
from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper
from ds_swift.recovery.strategies.scar import ScarStrategy, _loss_scale, _schedule


def test_a_replacement_takes_the_survivors_loss_scale(world: None) -> None:  # noqa: F811
    survivor, replacement = engine("zero_stage1", steps=3), engine("zero_stage1", steps=0)
    scaler = survivor.optimizer.loss_scaler
    scaler.cur_scale, scaler.last_overflow_iter, scaler.cur_hysteresis = 64.0, 2, 1  # after an overflow
    answers: dict[int, dict[str, Any]] = {
        0: {"skipped_steps": 1, "schedule": _schedule(survivor), "loss_scale": _loss_scale(survivor)}
    }
    ctx = SimpleNamespace(engine=replacement, rank=1, log=lambda msg: None)
    ScarStrategy._catch_up(ctx, SimpleNamespace(consensus=2), answers)  # type: ignore[arg-type]
    got = replacement.optimizer.loss_scaler
    assert (got.cur_scale, got.cur_iter, got.last_overflow_iter, got.cur_hysteresis) == (64.0, 3, 2, 1)
    assert got.dtype == scaler.dtype  # what JSON cannot carry stays the replacement's own
    assert replacement.global_steps == 3 and replacement.skipped_steps == 1
    assert _loss_scale(engine("bf16_optimizer", steps=0)) == []  # bf16: no loss scale to agree on


def test_fp16_with_fp32_accumulation_under_zero1_is_refused_where_the_sum_is_read(world: None) -> None:  # noqa: F811
    import deepspeed

    model = torch.nn.Linear(8, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    eng, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    assert eng.optimizer.use_grad_accum_attribute
    with pytest.raises(UnsupportedWrapper, match="grad_accum_dtype torch.float32"):
        accumulator(eng.optimizer)
    assert accumulator(engine("zero_stage1", steps=0).optimizer).where == "param"  # fp16 alone: param.grad


def test_the_rollback_simulation_puts_a_stepped_stages_loss_scaler_back(world: None) -> None:  # noqa: F811
    """The simulated failure of immediate rollback trains the iteration twice: a stage that kept its
    update must not have its loss scaler moved twice (cur_iter one ahead, growth one step early)."""
    from ds_swift.config import SimulateConfig
    from ds_swift.recovery.strategies.rollback import RollbackSimulation

    eng = engine("zero_stage1", steps=2)
    eng.stage_id = 0  # a one-stage "pipeline": its stage kept its update
    sim = RollbackSimulation(SimulateConfig(iteration=2, strategy="immediate_rollback", stepped_stages=(0,)))
    before = dict(vars(eng.optimizer.loss_scaler))
    sim.before(eng)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(7)).half()
    eng.backward(eng(x).float().pow(2).mean())
    eng.step()
    assert eng.optimizer.loss_scaler.cur_iter == before["cur_iter"] + 1
    assert sim.roll_back(eng)
    assert vars(eng.optimizer.loss_scaler) == before and eng.global_steps == 2


def test_immediate_rollback_sends_a_lagging_copy_with_the_jobs_loss_scale(world: None) -> None:  # noqa: F811
    """A buddy copy of an older iteration carries that iteration's loss scaler: the lost rank gets
    the sender's, at the consensus, with the copy's weights (the announced approximation)."""
    from ds_swift.recovery.strategies.rollback import ImmediateRollbackStrategy

    sender = engine("zero_stage1", steps=3)
    sender.optimizer.loss_scaler.cur_scale = 64.0
    copy = {"module": {}, "optimizer": {"masters": [], "scalers": [{"cur_scale": 256.0, "cur_iter": 1}]}}
    holdings = SimpleNamespace(state_of=lambda lost, version: copy)
    ctx = SimpleNamespace(rank=0, engine=sender, kept=SimpleNamespace(buddy=holdings))
    sent = ImmediateRollbackStrategy._source_state(ctx, 1, 1, True, 3)  # type: ignore[arg-type]
    assert (sent["optimizer"]["scalers"][0]["cur_scale"], sent["optimizer"]["scalers"][0]["cur_iter"]) == (64.0, 3)
    copy["optimizer"]["scalers"] = [{"cur_scale": 256.0, "cur_iter": 3}]
    same = ImmediateRollbackStrategy._source_state(ctx, 1, 3, True, 3)  # type: ignore[arg-type]
    assert same["optimizer"]["scalers"][0]["cur_scale"] == 256.0  # a copy of the consensus: as it is


def test_undoing_a_step_that_grew_the_loss_scale_puts_the_scale_back(world: None) -> None:  # noqa: F811
    """The other scaler event next to an overflow: a clean step at the end of the scale window
    doubles the scale; its undo must halve it back (and the window count with it)."""
    import deepspeed

    from ds_swift.undo import attach_to_engine

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 1},
        "zero_optimization": {"stage": 1},
    }
    eng, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    handle = attach_to_engine(eng)

    def step(i: int) -> None:
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i)).half()
        eng.backward(eng(x).float().pow(2).mean())
        eng.step()

    step(0)
    before = dict(vars(eng.optimizer.loss_scaler))
    step(1)
    assert eng.optimizer.loss_scaler.cur_scale == 2 * before["cur_scale"]  # the window of 1 passed: grown
    handle.undo_to(0)  # iteration 0's step is the last applied one again
    assert vars(eng.optimizer.loss_scaler) == before and eng.global_steps == 1
