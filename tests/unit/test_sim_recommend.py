"""Optimal intervals (numerical vs Young/Daly) and the planner-facing recommend_for_plan."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.config import ConfigError
from ds_swift.sim.failures import FailureModel
from ds_swift.sim.model import LoggingSpec, StrategySpec, Workload
from ds_swift.sim.plan_recommend import recommend_for_plan
from ds_swift.sim.recommend import (
    daly_interval_s,
    expected_hours,
    optimal_interval,
    recommend,
    young_interval_s,
)
from ds_swift.sim.runner import geometric_grid, interval_sweep, with_interval


@st.composite
def tunable_jobs(draw: st.DrawFn) -> tuple[Workload, StrategySpec, FailureModel]:
    wl = Workload("w", total_iterations=draw(st.integers(10, 20000)), iteration_time_s=draw(st.floats(0.1, 10.0)))
    kind: Any = draw(st.sampled_from(["checkpoint", "snapshot", "logging"]))
    cost = draw(st.floats(0.0, 300.0))
    common: dict[str, Any] = dict(restart_s=draw(st.floats(0.0, 200.0)), checkpoint_interval=draw(st.integers(1, 5000)))
    if kind == "checkpoint":
        s = StrategySpec("s", kind, checkpoint_cost_s=cost, load_s=5.0, **common)
    elif kind == "snapshot":
        s = StrategySpec(
            "s",
            kind,
            snapshot_interval=draw(st.integers(1, 500)),
            snapshot_cost_s=cost,
            checkpoint_cost_s=draw(st.floats(0.0, 50.0)),
            **common,
        )
    else:
        s = StrategySpec(
            "s", kind, checkpoint_cost_s=cost, logging=LoggingSpec(replay_fraction=draw(st.floats(0.05, 1.0))), **common
        )
    failures = draw(
        st.sampled_from(
            [
                FailureModel(count=draw(st.integers(0, 60))),
                FailureModel("exponential", mtbf_hours=draw(st.floats(0.5, 100.0))),
            ]
        )
    )
    return wl, s, failures


@settings(max_examples=60, deadline=None)
@given(tunable_jobs(), st.integers(5, 40))
def test_optimum_is_within_one_grid_step_of_the_sweep_minimum(
    job: tuple[Workload, StrategySpec, FailureModel], points: int
) -> None:
    wl, s, failures = job
    grid = geometric_grid(1, wl.total_iterations, points)
    rec = optimal_interval(wl, s, failures, grid=grid)
    sweep = [expected_hours(wl, with_interval(s, g), failures) for g in grid]
    i = int(np.argmin(sweep))
    assert rec.optimal is not None
    assert grid[max(i - 1, 0)] <= rec.optimal <= grid[min(i + 1, len(grid) - 1)]
    assert rec.optimal_hours <= min(sweep) + 1e-9
    assert rec.optimal_hours == pytest.approx(expected_hours(wl, with_interval(s, rec.optimal), failures))
    assert list(rec.grid_hours) == pytest.approx(sweep)


def test_optimum_agrees_with_the_monte_carlo_sweep() -> None:
    # The Figure-13 sweep (simulated, common random numbers) bottoms out next to the optimum.
    wl = Workload("w", total_iterations=50000, iteration_time_s=3.0)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=5000, checkpoint_cost_s=20.0, restart_s=100.0)
    failures = FailureModel(count=20)
    grid = geometric_grid(20, 5000, 25)
    sweep = interval_sweep(wl, [gc], failures, grid, repeats=200, seed=0)["gc"]
    i = int(np.argmin([p.mean_hours for p in sweep]))
    rec = optimal_interval(wl, gc, failures)
    assert rec.optimal is not None and grid[i - 2] <= rec.optimal <= grid[i + 2]


def test_young_and_daly_agree_with_the_numerical_optimum_when_checkpoints_are_cheap() -> None:
    wl = Workload("w", total_iterations=450360, iteration_time_s=3.83)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=5004, checkpoint_cost_s=20.0, restart_s=98.8)
    rec = optimal_interval(wl, gc, FailureModel(count=28))
    assert rec.young is not None and rec.daly is not None and rec.optimal is not None
    assert abs(rec.optimal - rec.young) / rec.young < 0.03
    assert abs(rec.optimal - rec.daly) / rec.daly < 0.03


def test_young_daly_formulas() -> None:
    assert young_interval_s(20.0, 3600.0) == pytest.approx(math.sqrt(2 * 20 * 3600))
    assert daly_interval_s(20.0, 3600.0) < young_interval_s(20.0, 3600.0)
    assert daly_interval_s(10_000.0, 3600.0) == 3600.0


def test_replication_interval_is_fixed() -> None:
    wl = Workload("w", total_iterations=1000, iteration_time_s=1.0)
    rep = StrategySpec("r", "replication", checkpoint_interval=100, checkpoint_cost_s=1.0, restart_s=10)
    (rec,) = recommend(wl, [rep], FailureModel(count=5))
    assert rec.field is None and rec.optimal is None
    assert rec.optimal_hours == rec.configured_hours == pytest.approx((1000 + 10 * 1 + 5 * (10 + 0.5)) / 3600)


def test_weibull_uses_the_monte_carlo_mean() -> None:
    wl = Workload("w", total_iterations=20000, iteration_time_s=3.0)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=2000, checkpoint_cost_s=10.0, restart_s=60.0)
    rec = optimal_interval(wl, gc, FailureModel("weibull", mtbf_hours=2.0, shape=0.8), repeats=20, grid_points=20)
    assert rec.optimal is not None and 1 < rec.optimal < 2000
    assert rec.optimal_hours < rec.configured_hours


# --------------------------------------------------------------------------- plans
BERT_PLAN = {
    "stages": ["logging"] * 128,
    "groups": [[i] for i in range(16)],
    "pp": 128,
    "log_bytes_per_iteration": 8_050_000_000,
}


def test_recommend_for_a_logging_plan() -> None:
    out = recommend_for_plan(BERT_PLAN, 17.0, 3.32, 500000, 0.93, 98.8, load_s=5.0, micro_batches=4)
    names = [a["name"] for a in out["alternatives"]]
    assert set(names) == {"global_checkpoint", "swift", "swift_no_parallel_recovery"}
    hours = [a["expected_hours"] for a in out["alternatives"]]
    assert hours == sorted(hours) and out["recommended"] == names[0] == "swift"
    by = {a["name"]: a for a in out["alternatives"]}
    assert by["swift"]["expected_hours"] < by["swift_no_parallel_recovery"]["expected_hours"]
    assert by["swift"]["groups"] == BERT_PLAN["groups"] and by["swift"]["parallel_recovery"] is True
    # Global checkpointing at its own optimum, consistent with optimal_interval.
    wl = Workload("plan", 500000, 3.32, machines=16, pipeline_stages=128, micro_batches=4)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=1, checkpoint_cost_s=0.93, restart_s=98.8, load_s=5.0)
    rec = optimal_interval(wl, gc, FailureModel("exponential", mtbf_hours=17.0))
    assert by["global_checkpoint"]["checkpoint_interval"] == rec.optimal
    assert by["global_checkpoint"]["expected_hours"] == pytest.approx(rec.optimal_hours, abs=1e-3)
    assert out["expected_failures"] == pytest.approx(500000 * 3.32 / 3600 / 17, abs=1e-3)
    # A slow store bounds the replay by the log download.
    slow = recommend_for_plan(BERT_PLAN, 17.0, 3.32, 500000, 0.93, 98.8, micro_batches=4, storage_gbps=1.0)
    fast = recommend_for_plan(BERT_PLAN, 17.0, 3.32, 500000, 0.93, 98.8, micro_batches=4)
    swift_h = {
        o: {a["name"]: a["expected_hours"] for a in d["alternatives"]}["swift"]
        for o, d in (("slow", slow), ("fast", fast))
    }
    assert swift_h["slow"] > swift_h["fast"]


def test_recommend_for_a_replication_plan() -> None:
    plan = {"stages": [{"strategy": "replication"}] * 4, "groups": [], "machines": 2}
    out = recommend_for_plan(
        plan, 17.0, 3.83, 450360, 20.0, 98.8, load_s=5.0, undo_s=0.86, broadcast_s=1.3, checkpoint_interval=5004
    )
    by = {a["name"]: a for a in out["alternatives"]}
    assert out["recommended"] == "swift" and by["swift"]["strategy"] == "replication"
    assert by["swift"]["checkpoint_interval"] == 5004
    assert by["swift"]["per_failure_s"] == pytest.approx(98.8 + 0.86 + 1.3 + 3.83 / 2, abs=0.01)


def test_recommend_for_a_mixed_plan_lies_between_its_parts() -> None:
    args = (17.0, 3.83, 450360, 20.0, 98.8)
    kw: dict[str, Any] = dict(load_s=5.0, undo_s=0.86, broadcast_s=1.3)
    mixed = recommend_for_plan({"stages": ["replication", "checkpoint"], "machines": 4}, *args, **kw)
    rep = recommend_for_plan({"stages": ["replication"] * 2, "machines": 4}, *args, **kw)
    h = {a["name"]: a["expected_hours"] for a in mixed["alternatives"]}
    rep_h = {a["name"]: a["expected_hours"] for a in rep["alternatives"]}["swift"]
    assert rep_h < h["swift"] < h["global_checkpoint"]
    assert {a["name"]: a for a in mixed["alternatives"]}["swift"]["strategy"] == "replication+checkpoint"


@pytest.mark.parametrize(
    ("plan", "mtbf", "match"),
    [
        (BERT_PLAN, 0.0, "mtbf"),
        (BERT_PLAN, -3, "mtbf"),
        ({"stages": []}, 17.0, "stages"),
        ({"stages": ["mirroring"]}, 17.0, "stages\\[0\\]"),
    ],
)
def test_recommend_for_plan_errors(plan: dict[str, object], mtbf: float, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        recommend_for_plan(plan, mtbf, 1.0, 100, 1.0, 1.0)
