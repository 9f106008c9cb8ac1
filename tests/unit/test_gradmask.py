"""Lossy forward's gradient scaling (ds_swift.recovery.gradmask), the strategy's decision, and the
failure-simulation config, without processes."""

from __future__ import annotations

import pytest
import torch

from ds_swift.config import ConfigError
from ds_swift.recovery.consensus import RankReport
from ds_swift.recovery.gradmask import lossy_factor, scaled_gradients
from ds_swift.recovery.registry import plan_recovery
from ds_swift.testing.configs import swift_config


class Stage(torch.nn.Module):
    """Parameters named as DeepSpeed's PipelineModule names them: by global layer index."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"2": torch.nn.Linear(3, 3), "5": torch.nn.Linear(3, 1)})

    def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        yield from self.layers.named_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["5"](self.layers["2"](x))


def grads(module: Stage, x: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    module(x).sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}  # type: ignore[union-attr]


def test_the_factors_turn_the_world_average_into_the_survivors_average() -> None:
    dp, lost = 4, {1, 3}
    local = [torch.full((2,), float(r + 1)) for r in range(dp)]
    world_mean = sum(lossy_factor(r, lost, dp) * g for r, g in enumerate(local)) / dp
    assert torch.equal(world_mean, (local[0] + local[2]) / 2)
    with pytest.raises(ValueError, match="every one of the 2"):
        lossy_factor(0, {0, 1}, 2)


def test_scaled_gradients_cover_the_layers_asked_and_come_off_after() -> None:
    torch.manual_seed(0)
    stage, x = Stage(), torch.randn(4, 3)
    plain = grads(stage, x)
    with scaled_gradients(stage, 2.0) as n:
        doubled = grads(stage, x)
    assert n == 4 and all(torch.equal(doubled[k], 2 * v) for k, v in plain.items())
    with scaled_gradients(stage, 0.0, upto_layer=2) as n:
        partial = grads(stage, x)
    assert n == 2
    assert all(torch.equal(partial[k], torch.zeros_like(v) if k.startswith("2.") else v) for k, v in plain.items())
    assert all(torch.equal(g, plain[k]) for k, g in grads(stage, x).items())  # the hooks are gone


def reports(lost_machine: int) -> list[RankReport]:
    """pp 2 x dp 2 on 2 machines (replica d = machine d)."""
    return [
        RankReport(
            rank=r,
            survivor=r // 2 != lost_machine,
            stage=r % 2,
            dp=r // 2,
            tp=0,
            machine=r // 2,
            last_stepped=6 if r // 2 != lost_machine else -1,
            can_undo=True,
        )
        for r in range(4)
    ]


def test_lossy_forward_restores_like_replication_then_averages_the_survivors() -> None:
    plan = plan_recovery(reports(1), forced="lossy_forward")
    assert plan.strategy == "lossy_forward" and plan.donors == {2: 0, 3: 1} and plan.consensus == 6
    assert plan.reason.endswith(
        "iteration 7 averages the gradients of data-parallel replicas [0] only (replicas [1] lost a rank: "
        "lossy forward, approximate)"
    ), plan.reason
    assert plan_recovery(reports(1)).strategy == "replication"  # auto never picks an approximate one


def test_lossy_forward_with_no_surviving_replica_falls_back() -> None:
    pp4 = [
        RankReport(
            rank=r, survivor=r < 2, stage=r, dp=0, tp=0, machine=r // 2, last_stepped=6 if r < 2 else -1, can_undo=True
        )
        for r in range(4)
    ]
    plan = plan_recovery(pp4, forced="lossy_forward")
    assert plan.strategy == "checkpoint" and "every data-parallel replica (1) lost a rank" in plan.reason


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"iteration": -1}, "simulate_failure.iteration"),
        ({"iteration": 3, "strategy": "scar"}, "simulate_failure.strategy"),
        ({"iteration": 3, "casualties": [-1]}, "simulate_failure.casualties"),
        ({"iteration": 3, "stepped_stages": "1"}, "simulate_failure.stepped_stages"),
        ({"iteration": 3, "upto_layer": 1.5}, "simulate_failure.upto_layer"),
        ({"iteration": 3, "when": 1}, "simulate_failure.when"),
    ],
)
def test_bad_simulation_settings_name_the_field(section: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        swift_config({"simulate_failure": section})


def test_simulation_is_off_by_default_and_lists_become_tuples() -> None:
    assert swift_config({}).simulate_failure.iteration is None
    sim = swift_config({"simulate_failure": {"iteration": 3, "stepped_stages": [1]}}).simulate_failure
    assert sim.stepped_stages == (1,) and sim.casualties == ()
