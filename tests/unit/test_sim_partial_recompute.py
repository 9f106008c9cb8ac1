"""The simulator prices PipeChurn's partial recomputation (ds_swift.sim.model.inflight_redo_s): a
failure in the iteration's last `partial_recompute_window` redoes only the lost ranks' passes,
M / (M + p - 1) of an iteration; a failure in the middle of the iteration only the share of those
passes that had run; the closed-form expectation matches the per-failure costs."""

from __future__ import annotations

import numpy as np
import pytest

from ds_swift.config import ConfigError
from ds_swift.sim.model import (
    StrategySpec,
    Workload,
    expected_failure_cost_s,
    expected_inflight_redo_s,
    failure_costs_s,
    inflight_redo_s,
)

W = Workload(name="w", total_iterations=1000, iteration_time_s=2.0, machines=4, pipeline_stages=4, micro_batches=8)


def _spec(window: float | None) -> StrategySpec:
    return StrategySpec("pipechurn", "snapshot", snapshot_interval=1, restart_s=3.0, partial_recompute_window=window)


def test_a_failure_after_every_pass_redoes_only_the_lost_passes() -> None:
    passes = 2.0 * 8 / (8 + 4 - 1)
    got = inflight_redo_s(W, _spec(0.1), np.array([0.9, 0.95, 0.999]))
    assert np.allclose(got, [passes, passes, passes])
    assert np.allclose(inflight_redo_s(W, _spec(None), np.array([0.95])), [1.9])


def test_a_failure_in_the_middle_of_the_iteration_redoes_the_share_of_the_lost_passes_that_ran() -> None:
    """Before the passes end (at 1 - window = 0.9 of the iteration) the lost ranks had run x / 0.9 of
    their passes; only those run again, back to back: less than the full retrain's t * x."""
    passes = 2.0 * 8 / (8 + 4 - 1)
    got = inflight_redo_s(W, _spec(0.1), np.array([0.0, 0.45, 0.5, 0.89]))
    assert np.allclose(got, [0.0, passes * 0.5, passes * 0.5 / 0.9, passes * 0.89 / 0.9])
    assert np.all(got < 2.0 * np.array([1e-9, 0.45, 0.5, 0.89]))
    # A window as large as the lost passes' share never costs more than the full retrain's t * x.
    big = inflight_redo_s(W, _spec(0.5), np.array([0.25, 0.4]))
    assert np.allclose(big, [0.5, 0.8])


@pytest.mark.parametrize("window", [None, 0.0, 0.1, 0.5, 0.9])
def test_the_expectation_is_the_mean_of_the_per_failure_costs(window: float | None) -> None:
    spec = _spec(window)
    rng = np.random.default_rng(0)
    costs = failure_costs_s(W, spec, rng.random(400_000), rng.random(400_000))
    assert abs(costs.mean() - expected_failure_cost_s(W, spec)) < 0.01
    x = rng.random(400_000)
    assert abs(inflight_redo_s(W, spec, x).mean() - expected_inflight_redo_s(W, spec)) < 0.005


def test_partial_recomputation_costs_less_and_the_window_is_checked() -> None:
    assert expected_failure_cost_s(W, _spec(0.1)) < expected_failure_cost_s(W, _spec(None))
    # No window (a failure never finds the passes done): half of the lost ranks' passes, on average.
    assert expected_inflight_redo_s(W, _spec(0.0)) == pytest.approx(0.5 * 2.0 * 8 / 11)
    assert expected_inflight_redo_s(W, _spec(None)) == pytest.approx(1.0)  # no partial: half an iteration
    with pytest.raises(ConfigError, match="partial_recompute_window"):
        _spec(1.0)


def test_a_simulation_config_sets_the_window_per_strategy() -> None:
    from ds_swift.sim.schema import parse_sim_config

    strategies = {
        "pipechurn": {"kind": "snapshot", "snapshot_interval": 1},
        "pipechurn_partial": {"kind": "snapshot", "snapshot_interval": 1, "partial_recompute_window": 0.1},
    }
    cfg = parse_sim_config(
        {
            "failures": {"model": "exponential", "mtbf_hours": 12},
            "workloads": [
                {
                    "name": "w",
                    "total_iterations": 1000,
                    "iteration_time_s": 2.0,
                    "machines": 4,
                    "pipeline": {"stages": 4, "micro_batches": 8},
                    "strategies": strategies,
                }
            ],
        }
    )
    specs = {s.name: s for s in cfg.workloads[0].strategies}
    assert specs["pipechurn_partial"].partial_recompute_window == 0.1
    assert specs["pipechurn"].partial_recompute_window is None
    wl = cfg.workloads[0].workload
    assert expected_failure_cost_s(wl, specs["pipechurn_partial"]) < expected_failure_cost_s(wl, specs["pipechurn"])
