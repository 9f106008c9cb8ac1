"""Recommendations: the checkpoint/snapshot interval that minimises the expected end-to-end
time (numerically, compared with Young's and Daly's approximations). For a topology plan,
ds_swift.sim.plan_recommend builds on these.

Expected times are exact closed forms for ``uniform`` and ``exponential`` failures (positions
are i.i.d. uniform given the count, see :func:`ds_swift.sim.model.expected_failure_cost_s`);
``weibull`` uses the Monte Carlo mean over fixed draws (common random numbers, so the curve
over intervals is not jagged by resampling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ds_swift.sim.failures import FailureModel
from ds_swift.sim.model import (
    StrategySpec,
    Workload,
    expected_failure_cost_s,
    failure_free_s,
    interval_field,
    recovery_paths,
)
from ds_swift.sim.runner import geometric_grid, simulate_samples, with_interval

__all__ = [
    "IntervalRecommendation",
    "daly_interval_s",
    "expected_hours",
    "minimise_interval",
    "optimal_interval",
    "recommend",
    "young_daly_intervals",
    "young_interval_s",
]

_HOUR = 3600.0


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), higher order: sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C, or M if C >= 2M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def _evaluator(workload: Workload, failures: FailureModel, repeats: int, seed: int) -> Callable[[StrategySpec], float]:
    """Expected end-to-end seconds of a strategy."""
    if failures.uniform_positions:
        n = failures.expected_count(workload.compute_s / _HOUR)
        return lambda s: failure_free_s(workload, s) + n * expected_failure_cost_s(workload, s)
    samples = failures.sample(workload.compute_s, repeats, seed)
    return lambda s: float(np.mean(simulate_samples(workload, s, samples)))


def expected_hours(
    workload: Workload, strategy: StrategySpec, failures: FailureModel, *, repeats: int = 10, seed: int = 0
) -> float:
    """Expected end-to-end hours of one strategy."""
    return _evaluator(workload, failures, repeats, seed)(strategy) / _HOUR


@dataclass(frozen=True)
class IntervalRecommendation:
    """The tuned interval of one strategy."""

    strategy: str
    field: str | None
    """``checkpoint_interval``/``snapshot_interval``; ``None`` when recovery ignores it."""
    configured: int | None
    configured_hours: float
    optimal: int | None
    optimal_hours: float
    young: float | None
    """Young's interval, iterations (``None`` without a stall cost or without failures)."""
    daly: float | None
    grid: tuple[int, ...] = ()
    grid_hours: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {
            "field": self.field,
            "configured": self.configured,
            "configured_hours": r(self.configured_hours),
            "optimal": self.optimal,
            "optimal_hours": r(self.optimal_hours),
            "young": r(self.young),
            "daly": r(self.daly),
        }


def young_daly_intervals(
    workload: Workload, strategy: StrategySpec, failures: FailureModel
) -> tuple[float | None, float | None]:
    """Young's and Daly's intervals of ``strategy``, in iterations; None without a stall cost or failures."""
    cost = strategy.snapshot_cost_s if strategy.kind == "snapshot" else strategy.checkpoint_cost_s
    n = failures.expected_count(workload.compute_s / _HOUR)
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    pace = sum(p.weight * p.replay_s_per_iteration for p in recovery_paths(workload, strategy))
    if cost <= 0.0 or n <= 0.0 or pace <= 0.0:
        return None, None
    # Rework costs `pace` per lost iteration instead of t: the same trade-off as a full
    # rollback with failures t/pace times rarer.
    mtbf = workload.compute_s / n * (t / pace)
    return young_interval_s(cost, mtbf) / t, daly_interval_s(cost, mtbf) / t


def minimise_interval(f: Callable[[int], float], grid: Sequence[int]) -> tuple[int, float, list[float]]:
    """Grid search, then refinement inside the bracket of the best grid point's neighbours."""
    hours = [f(g) for g in grid]
    i = int(np.argmin(hours))
    best, best_h = grid[i], hours[i]
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    # The cost has small saw-teeth (whole checkpoints fit or not), so a local search can stop
    # early; shrinking brackets of 33 points then an exhaustive scan is robust and cheap.
    while hi - lo > 256:
        cands = sorted({int(v) for v in np.round(np.geomspace(lo, hi, 33))} | {best})
        vals = [f(c) for c in cands]
        j = int(np.argmin(vals))
        if vals[j] < best_h:
            best, best_h = cands[j], vals[j]
        j = cands.index(best)
        new_lo, new_hi = cands[max(j - 1, 0)], cands[min(j + 1, len(cands) - 1)]
        if (new_lo, new_hi) == (lo, hi):
            break
        lo, hi = new_lo, new_hi
    if hi - lo <= 256:
        for c in range(lo, hi + 1):
            v = f(c)
            if v < best_h:
                best, best_h = c, v
    return best, best_h, hours


def optimal_interval(
    workload: Workload,
    strategy: StrategySpec,
    failures: FailureModel,
    *,
    grid: Sequence[int] | None = None,
    grid_points: int = 49,
    repeats: int = 10,
    seed: int = 0,
) -> IntervalRecommendation:
    """The interval minimising the expected end-to-end time of ``strategy``.

    Evaluates a geometric grid over [1, total_iterations] (or ``grid``), then refines between
    the best grid point's neighbours, so the result is never worse than the grid minimum and
    lies within one grid step of it.
    """
    evaluate = _evaluator(workload, failures, repeats, seed)
    name = interval_field(strategy)
    configured = getattr(strategy, name) if name is not None else strategy.checkpoint_interval
    configured_h = evaluate(strategy) / _HOUR
    if name is None:
        return IntervalRecommendation(strategy.name, None, configured, configured_h, None, configured_h, None, None)
    points = list(grid) if grid is not None else geometric_grid(1, workload.total_iterations, grid_points)
    best, best_s, grid_s = minimise_interval(lambda k: evaluate(with_interval(strategy, k)), points)
    young, daly = young_daly_intervals(workload, strategy, failures)
    return IntervalRecommendation(
        strategy=strategy.name,
        field=name,
        configured=configured,
        configured_hours=configured_h,
        optimal=best,
        optimal_hours=best_s / _HOUR,
        young=young,
        daly=daly,
        grid=tuple(points),
        grid_hours=tuple(v / _HOUR for v in grid_s),
    )


def recommend(
    workload: Workload,
    strategies: Sequence[StrategySpec],
    failures: FailureModel,
    *,
    grid_points: int = 49,
    repeats: int = 10,
    seed: int = 0,
) -> list[IntervalRecommendation]:
    """Optimal interval of every strategy of a workload."""
    return [
        optimal_interval(workload, s, failures, grid_points=grid_points, repeats=repeats, seed=seed) for s in strategies
    ]
