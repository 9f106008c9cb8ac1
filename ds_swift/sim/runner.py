"""Monte Carlo runs of the cost model: repeats, means, 95% confidence intervals, sweeps."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ds_swift.sim.failures import FailureModel, FailureSample
from ds_swift.sim.model import StrategySpec, Workload, failure_costs_s, failure_free_s, interval_field

__all__ = [
    "StrategyResult",
    "SweepPoint",
    "geometric_grid",
    "interval_sweep",
    "mean_ci",
    "mtbf_sweep",
    "simulate",
    "simulate_samples",
    "with_interval",
]

_HOUR = 3600.0

# Two-sided 95% Student t quantiles for 1..30 degrees of freedom; beyond, the normal 1.96.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def mean_ci(values: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% confidence interval (Student t); the interval is NaN for one value."""
    arr = np.asarray(values, dtype=np.float64)
    mean = float(arr.mean())
    if arr.shape[0] < 2:
        return mean, math.nan, math.nan
    dof = arr.shape[0] - 1
    quantile = _T975[dof - 1] if dof <= len(_T975) else 1.96
    half = quantile * float(arr.std(ddof=1)) / math.sqrt(arr.shape[0])
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class StrategyResult:
    """Simulated end-to-end time of one strategy on one workload."""

    strategy: str
    kind: str
    mean_hours: float
    ci_low_hours: float
    ci_high_hours: float
    failure_free_hours: float
    """Compute plus checkpoint/snapshot stalls, no failures."""
    mean_failures: float
    samples_hours: tuple[float, ...]

    def to_dict(self) -> dict[str, object]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else round(x, 4)

        return {
            "kind": self.kind,
            "mean_hours": num(self.mean_hours),
            "ci95_hours": [num(self.ci_low_hours), num(self.ci_high_hours)],
            "failure_free_hours": num(self.failure_free_hours),
            "mean_failures": self.mean_failures,
        }


def simulate_samples(workload: Workload, strategy: StrategySpec, samples: Sequence[FailureSample]) -> np.ndarray:
    """End-to-end seconds of each repeat."""
    base = failure_free_s(workload, strategy)
    out = np.empty(len(samples))
    for i, sample in enumerate(samples):
        # fsum is exactly rounded: the total does not depend on the draw order, and one more
        # failure (a cost >= 0) can never round the total down.
        costs = failure_costs_s(workload, strategy, sample.positions, sample.machine_u)
        out[i] = math.fsum([base, *costs.tolist()])
    return out


def simulate(
    workload: Workload,
    strategies: Sequence[StrategySpec],
    failures: FailureModel,
    *,
    repeats: int = 10,
    seed: int = 0,
) -> dict[str, StrategyResult]:
    """Simulate every strategy on the same failure draws (common random numbers)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    samples = failures.sample(workload.compute_s, repeats, seed)
    mean_failures = float(np.mean([len(s) for s in samples]))
    results: dict[str, StrategyResult] = {}
    for strategy in strategies:
        seconds = simulate_samples(workload, strategy, samples)
        mean, lo, hi = mean_ci(seconds / _HOUR)
        results[strategy.name] = StrategyResult(
            strategy=strategy.name,
            kind=strategy.kind,
            mean_hours=mean,
            ci_low_hours=lo,
            ci_high_hours=hi,
            failure_free_hours=failure_free_s(workload, strategy) / _HOUR,
            mean_failures=mean_failures,
            samples_hours=tuple(float(s) for s in seconds / _HOUR),
        )
    return results


def with_interval(strategy: StrategySpec, interval: int) -> StrategySpec:
    """The strategy with its tunable interval (see ``interval_field``) set to ``interval``."""
    name = interval_field(strategy)
    if name is None:
        return strategy
    if name == "snapshot_interval":
        return replace(strategy, snapshot_interval=int(interval))
    return replace(strategy, checkpoint_interval=int(interval))


def geometric_grid(low: int, high: int, points: int) -> list[int]:
    """Distinct integers spaced evenly in log scale from ``low`` to ``high`` inclusive."""
    low, high = max(1, int(low)), max(1, int(high))
    if high < low:
        low, high = high, low
    values = np.unique(np.round(np.geomspace(low, high, max(2, points))).astype(np.int64))
    return [int(v) for v in values]


@dataclass(frozen=True)
class SweepPoint:
    x: float
    mean_hours: float
    ci_low_hours: float
    ci_high_hours: float


def interval_sweep(
    workload: Workload,
    strategies: Sequence[StrategySpec],
    failures: FailureModel,
    grid: Sequence[int],
    *,
    repeats: int = 10,
    seed: int = 0,
) -> dict[str, list[SweepPoint]]:
    """End-to-end time vs checkpoint/snapshot interval (SWIFT Figure 13). Strategies whose
    recovery does not depend on an interval (replication) stay at their configured value."""
    samples = failures.sample(workload.compute_s, repeats, seed)
    out: dict[str, list[SweepPoint]] = {}
    for strategy in strategies:
        points: list[SweepPoint] = []
        for interval in grid:
            seconds = simulate_samples(workload, with_interval(strategy, interval), samples)
            mean, lo, hi = mean_ci(seconds / _HOUR)
            points.append(SweepPoint(float(interval), mean, lo, hi))
        out[strategy.name] = points
    return out


def mtbf_sweep(
    workload: Workload,
    strategies: Sequence[StrategySpec],
    failures: FailureModel,
    mtbf_hours: Sequence[float],
    *,
    intervals: Mapping[str, int] | None = None,
    repeats: int = 10,
    seed: int = 0,
) -> dict[str, list[SweepPoint]]:
    """End-to-end time vs mean time between failures (SWIFT Figure 14), each strategy at the
    interval given in ``intervals`` (its optimum, as in the paper) or its configured one."""
    intervals = intervals or {}
    tuned = [with_interval(s, intervals[s.name]) if s.name in intervals else s for s in strategies]
    out: dict[str, list[SweepPoint]] = {s.name: [] for s in tuned}
    for mtbf in mtbf_hours:
        results = simulate(workload, tuned, failures.with_mtbf(mtbf), repeats=repeats, seed=seed)
        for s in tuned:
            r = results[s.name]
            out[s.name].append(SweepPoint(float(mtbf), r.mean_hours, r.ci_low_hours, r.ci_high_hours))
    return out
