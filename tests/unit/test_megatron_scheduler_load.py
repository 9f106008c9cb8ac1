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
