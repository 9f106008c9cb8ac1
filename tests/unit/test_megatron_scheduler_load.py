"""A Megatron OptimizerParamScheduler loads a state by setting its step count (ds_swift.megatron).

Megatron's ``load_state_dict`` adds the saved ``num_steps`` to its own (megatron-core's here, with
the same ``self.step(increment=num_steps)`` as the pinned Megatron-DeepSpeed commit's): loaded into
a scheduler that has stepped, as ds-swift's checkpoint fallback, undo and kept state do, the
schedule ran on and the learning rate was wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ds_swift.megatron import scheduler_loads_by_setting

scheduler_module = pytest.importorskip("megatron.core.optimizer_param_scheduler")


def make_scheduler() -> tuple[object, torch.optim.Optimizer]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = scheduler_module.OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=8,
        lr_decay_steps=32,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=32,
        wd_incr_style="constant",
    )
    return sched, opt


def run_to(sched: object, steps: int) -> None:
    for _ in range(steps):
        sched.step(increment=4)  # type: ignore[attr-defined]


def test_megatron_scheduler_adds_on_load_unprepared() -> None:
    sched, _ = make_scheduler()
    run_to(sched, 4)
    saved = sched.state_dict()  # type: ignore[attr-defined]
    run_to(sched, 2)
    sched.load_state_dict(saved)  # type: ignore[attr-defined]
    assert sched.num_steps == 16 + 24  # type: ignore[attr-defined]  # what this module fixes


def test_prepared_scheduler_load_sets_steps_and_learning_rate() -> None:
    sched, opt = make_scheduler()
    scheduler_loads_by_setting(sched)
    scheduler_loads_by_setting(sched)  # idempotent: a survivor's kept scheduler is prepared again
    run_to(sched, 4)
    saved, lr_at_4 = sched.state_dict(), opt.param_groups[0]["lr"]  # type: ignore[attr-defined]
    run_to(sched, 3)
    assert opt.param_groups[0]["lr"] != lr_at_4
    sched.load_state_dict(saved)  # type: ignore[attr-defined]
    assert sched.num_steps == 16 and opt.param_groups[0]["lr"] == lr_at_4  # type: ignore[attr-defined]

    twin = copy.deepcopy(sched)  # a deep copy loads into itself, not into the original
    run_to(twin, 2)
    twin.load_state_dict(saved)  # type: ignore[attr-defined]
    assert twin.num_steps == 16 and sched.num_steps == 16  # type: ignore[attr-defined]
    run_to(sched, 1)
    twin.load_state_dict(saved)  # type: ignore[attr-defined]
    assert sched.num_steps == 20  # type: ignore[attr-defined]


def test_other_schedulers_are_left_alone() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    load = sched.load_state_dict
    scheduler_loads_by_setting(sched)
    scheduler_loads_by_setting(None)
    assert sched.load_state_dict == load


class OptimizerParamScheduler:
    """Megatron-DeepSpeed's scheduler as far as its token count goes (megatron/optimizer_param_scheduler.py
    at the pinned commit): ``step`` reads the tokens consumed from Megatron's args when not given them."""

    def __init__(self, args: object) -> None:
        self.args, self.num_steps, self.num_tokens = args, 0, 0

    def step(self, increment: int, token_num: int | None = None) -> None:
        if token_num is None:
            token_num = self.args.consumed_train_tokens  # type: ignore[attr-defined]
        self.num_tokens = token_num
        self.num_steps += increment


def test_the_token_count_comes_from_the_schedulers_own_steps() -> None:
    """In an iteration ds-swift trains again inside train_batch after a recovery that went back,
    Megatron's args still count the tokens from before the failure: a token-based schedule took
    another learning rate. The scheduler's own sample count (restored by the recovery) says it."""
    from types import SimpleNamespace

    from ds_swift.megatron import scheduler_tokens_from_steps

    args = SimpleNamespace(consumed_train_tokens=0)
    ref, sched = OptimizerParamScheduler(args), OptimizerParamScheduler(args)
    scheduler_tokens_from_steps(sched, seq_length=32)
    scheduler_tokens_from_steps(sched, seq_length=32)  # idempotent
    for it in range(3):  # the failure-free loop: args follow after each step
        args.consumed_train_tokens = it * 4 * 32
        ref.step(4)
        sched.step(4)
        assert sched.num_tokens == ref.num_tokens == it * 4 * 32
    sched.num_steps = 4  # a reload of the checkpoint after iteration 1; args still say 3 iterations
    sched.step(4)
    assert sched.num_tokens == 4 * 32 and sched.num_steps == 8
    twin = copy.deepcopy(sched)  # a survivor's kept scheduler
    twin.step(4)
    assert twin.num_tokens == 8 * 32 and sched.num_steps == 8
    core, _ = make_scheduler()  # megatron-core's counts no tokens: left alone
    step = core.step  # type: ignore[attr-defined]
    scheduler_tokens_from_steps(core, seq_length=32)
    assert core.step == step  # type: ignore[attr-defined]


def test_megatrons_loop_counters_follow_the_engine_after_a_recovery_that_went_back() -> None:
    from types import SimpleNamespace

    from ds_swift.megatron import MegatronDeepSpeed
    from ds_swift.megatron.data import SamplerPosition

    swift = MegatronDeepSpeed(lambda n: (None, None, None), SimpleNamespace(load=None))
    swift.samples.position = SamplerPosition(micro_batch_size=1, data_parallel_size=2, gas=2)
    args = SimpleNamespace(iteration=3, consumed_train_samples=12, consumed_train_tokens=384, seq_length=32)
    args.consumed_train_samples += 4  # the loop's own count after the step retrained after a reload to 0
    swift.follow(args, 1)
    assert (args.iteration, args.consumed_train_samples, args.consumed_train_tokens) == (1, 4, 128)
