"""Recommendations: the checkpoint/snapshot interval that minimises the expected end-to-end
time (numerically, compared with Young's and Daly's approximations), and, for a topology
plan, which strategy and interval to run with and what each alternative is expected to cost.

Expected times are exact closed forms for ``uniform`` and ``exponential`` failures (positions
are i.i.d. uniform given the count, see :func:`ds_swift.sim.model.expected_failure_cost_s`);
``weibull`` uses the Monte Carlo mean over fixed draws (common random numbers, so the curve
over intervals is not jagged by resampling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ds_swift.config import ConfigError
from ds_swift.sim.failures import FailureModel
from ds_swift.sim.model import (
    LoggingSpec,
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
    "optimal_interval",
    "print_recommendation",
    "recommend",
    "recommend_for_plan",
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


def _evaluator(
    workload: Workload, failures: FailureModel, repeats: int, seed: int
) -> Callable[[StrategySpec], float]:
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


def _approximations(
    workload: Workload, strategy: StrategySpec, failures: FailureModel
) -> tuple[float | None, float | None]:
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


def _minimise(f: Callable[[int], float], grid: Sequence[int]) -> tuple[int, float, list[float]]:
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
    best, best_s, grid_s = _minimise(lambda k: evaluate(with_interval(strategy, k)), points)
    young, daly = _approximations(workload, strategy, failures)
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
        optimal_interval(workload, s, failures, grid_points=grid_points, repeats=repeats, seed=seed)
        for s in strategies
    ]


# --------------------------------------------------------------------------- plans
def _stage_strategies(plan: Mapping[str, Any]) -> list[str]:
    stages = plan.get("stages")
    if isinstance(stages, Mapping):
        stages = [stages[k] for k in sorted(stages, key=lambda k: int(k))]
    if not isinstance(stages, list) or not stages:
        raise ConfigError("plan: 'stages' must be a non-empty list of per-stage strategies")
    out = []
    for i, st in enumerate(stages):
        if isinstance(st, Mapping):
            st = st.get("strategy", st.get("recovery", st.get("kind")))
        if st not in ("replication", "logging", "checkpoint"):
            raise ConfigError(f"plan: stages[{i}] strategy {st!r} is not replication, logging or checkpoint")
        out.append(str(st))
    return out


def _group_sizes(plan: Mapping[str, Any]) -> list[int]:
    groups = plan.get("groups") or []
    if not isinstance(groups, list):
        raise ConfigError("plan: 'groups' must be a list of lists of machine ids")
    return [len(g) if isinstance(g, list) else int(g) for g in groups if (len(g) if isinstance(g, list) else g)]


def _plan_int(plan: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = plan.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        model = plan.get("model")
        if isinstance(model, Mapping):
            value = model.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def recommend_for_plan(
    plan_json: Mapping[str, Any],
    mtbf_hours: float,
    iteration_time_s: float,
    total_iterations: int,
    checkpoint_cost_s: float,
    restart_cost_s: float,
    *,
    load_s: float = 0.0,
    undo_s: float = 0.0,
    broadcast_s: float = 0.0,
    micro_batches: int | None = None,
    replay_fraction: float | None = None,
    parallel_speedup: float | None = None,
    storage_gbps: float | None = None,
    logging_overhead: float = 0.0,
    checkpoint_interval: int | None = None,
    grid_points: int = 49,
) -> dict[str, Any]:
    """Strategy, groups and checkpoint interval for a topology plan, with the expected
    end-to-end time of each alternative.

    Args:
        plan_json: ``ds-swift plan --json`` output: ``stages`` (strategy per stage, strings or
            objects with ``strategy``), ``groups`` (lists of machine ids), and when present
            ``log_bytes_per_iteration``, ``pp``, ``micro_batches``, ``machines``.
        mtbf_hours: mean time between failures of the whole job (any machine), hours.
        iteration_time_s: failure-free iteration time.
        total_iterations: iterations of the job.
        checkpoint_cost_s: training stall per global checkpoint.
        restart_cost_s: per failure: detection, replacement and rendezvous.
        load_s: per failure: loading the checkpoint.
        undo_s, broadcast_s: per failure, replication (undo also for logging survivors).
        micro_batches: micro-batches per iteration (default: from the plan, else 1).
        replay_fraction: measured replay time of a failed group per iteration / iteration time
            (default: derived from the pipeline shape, optimistic).
        parallel_speedup: speed-up of parallel recovery (default: machines / group size).
        storage_gbps: global-store bandwidth; bounds the replay by the log download.
        logging_overhead: failure-free slowdown from logging, as a fraction.
        checkpoint_interval: for a pure-replication plan, the safety-net interval to keep
            (default: the global-checkpoint optimum).
        grid_points: points of the interval search grid.

    Returns:
        ``{"mtbf_hours", "failure_free_hours", "expected_failures", "recommended",
        "alternatives": [{"name", "strategy", "groups", "parallel_recovery",
        "checkpoint_interval", "young_interval", "daly_interval", "expected_hours",
        "per_failure_s"}, ...] (fastest first), "assumptions": [...]}``.
    """
    if isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float)) or not mtbf_hours > 0:
        raise ConfigError(f"--mtbf-hours={mtbf_hours!r} is invalid: a positive number of hours")
    stage_kinds = _stage_strategies(plan_json)
    p = _plan_int(plan_json, "pp", "pipeline_stages") or len(stage_kinds)
    m = micro_batches or _plan_int(plan_json, "micro_batches", "num_micro_batches") or 1
    sizes = _group_sizes(plan_json)
    machines = _plan_int(plan_json, "machines", "num_machines") or max(sum(sizes), 1)
    workload = Workload("plan", total_iterations, iteration_time_s, machines=machines, pipeline_stages=p,
                        micro_batches=m)
    failures = FailureModel("exponential", mtbf_hours=float(mtbf_hours))
    n_fail = failures.expected_count(workload.compute_s / _HOUR)
    weights = {k: stage_kinds.count(k) / len(stage_kinds) for k in ("replication", "logging", "checkpoint")}
    weights = {k: w for k, w in weights.items() if w > 0}
    assumptions = [
        "failures: Poisson on the compute clock, expected count = compute hours / MTBF; recovery not exposed",
        "a failure takes a stage's recovery path with the share of stages planned for that path",
    ]

    gc = StrategySpec("global_checkpoint", "checkpoint", checkpoint_interval=total_iterations,
                      checkpoint_cost_s=checkpoint_cost_s, restart_s=restart_cost_s, load_s=load_s)
    gc_rec = optimal_interval(workload, gc, failures, grid_points=grid_points)
    alternatives: list[dict[str, Any]] = [{
        "name": "global_checkpoint",
        "strategy": "checkpoint",
        "groups": None,
        "parallel_recovery": False,
        "checkpoint_interval": gc_rec.optimal,
        "young_interval": None if gc_rec.young is None else round(gc_rec.young, 1),
        "daly_interval": None if gc_rec.daly is None else round(gc_rec.daly, 1),
        "expected_hours": round(gc_rec.optimal_hours, 4),
        "per_failure_s": _per_failure(gc_rec.optimal_hours * _HOUR, workload, gc, gc_rec.optimal, n_fail),
    }]

    # The plan's groups partition the logged machines; replay is derived on those machines.
    logged = sum(sizes) if sizes else machines
    log_workload = replace(workload, machines=logged, pipeline_stages=max(1, round(p * logged / machines)))
    download = 0.0
    log_bytes = plan_json.get("log_bytes_per_iteration")
    if storage_gbps and isinstance(log_bytes, (int, float)) and len(sizes) > 1:
        # A middle group needs one direction of each of its two boundaries: one boundary's worth.
        download = log_bytes / (len(sizes) - 1) / (storage_gbps * 1e9 / 8.0)
        assumptions.append(f"log download {download:.3f} s per replayed iteration at {storage_gbps} Gb/s")
    overhead = logging_overhead if "logging" in weights else 0.0
    base = replace(gc, name="swift", iteration_overhead=overhead)
    label = "+".join(weights)
    for parallel in ([True, False] if "logging" in weights else [False]):
        log_spec = LoggingSpec(
            groups=None if replay_fraction is not None else (tuple(sizes) if sizes else None),
            replay_fraction=replay_fraction,
            parallel_recovery=parallel,
            parallel_speedup=parallel_speedup,
            download_s_per_iteration=download,
        )
        parts = {
            "replication": (workload, StrategySpec("replication", "replication", restart_s=restart_cost_s,
                                                   undo_s=undo_s, broadcast_s=broadcast_s)),
            "logging": (log_workload, StrategySpec("logging", "logging", restart_s=restart_cost_s, load_s=load_s,
                                                   undo_s=undo_s, iteration_overhead=overhead, logging=log_spec)),
            "checkpoint": (workload, replace(gc, iteration_overhead=overhead)),
        }

        def expected_s(interval: int, parts: dict[str, tuple[Workload, StrategySpec]] = parts) -> float:
            per_failure = sum(
                w * expected_failure_cost_s(parts[k][0], replace(parts[k][1], checkpoint_interval=interval))
                for k, w in weights.items()
            )
            return failure_free_s(workload, replace(base, checkpoint_interval=interval)) + n_fail * per_failure

        if "logging" in weights or "checkpoint" in weights:
            best, best_s, _ = _minimise(expected_s, geometric_grid(1, total_iterations, grid_points))
        else:
            # Pure replication: recovery ignores the interval; checkpoints stay as the safety net
            # for losing every replica, which this model does not count.
            best = checkpoint_interval or gc_rec.optimal or total_iterations
            assumptions.append(f"replication keeps global checkpoints every {best} iterations as the safety net "
                               "(pass checkpoint_interval to choose another)")
            best_s = expected_s(best)
        young = daly = None
        if set(weights) == {"logging"}:
            young, daly = _approximations(log_workload, replace(parts["logging"][1],
                                                                checkpoint_cost_s=checkpoint_cost_s), failures)
        alternatives.append({
            "name": "swift" if parallel or "logging" not in weights else "swift_no_parallel_recovery",
            "strategy": label,
            "groups": plan_json.get("groups") if "logging" in weights else None,
            "parallel_recovery": parallel,
            "checkpoint_interval": int(best),
            "young_interval": None if young is None else round(young, 1),
            "daly_interval": None if daly is None else round(daly, 1),
            "expected_hours": round(best_s / _HOUR, 4),
            "per_failure_s": _per_failure(best_s, workload, base, best, n_fail),
        })
    alternatives.sort(key=lambda a: a["expected_hours"])
    return {
        "mtbf_hours": float(mtbf_hours),
        "failure_free_hours": round(workload.compute_s / _HOUR, 4),
        "expected_failures": round(n_fail, 3),
        "recommended": alternatives[0]["name"],
        "alternatives": alternatives,
        "assumptions": assumptions,
    }


def _per_failure(total_s: float, workload: Workload, spec: StrategySpec, interval: int | None, n_fail: float) -> float:
    """Expected cost of one failure: the expected time above the failure-free time, per failure."""
    if n_fail <= 0 or interval is None:
        return 0.0
    return round((total_s - failure_free_s(workload, replace(spec, checkpoint_interval=interval))) / n_fail, 2)


def print_recommendation(rec: Mapping[str, Any], file: Any = None) -> None:
    """Print a ``recommend_for_plan`` result as a rich table (for ``ds-swift plan --recommend``)."""
    import sys

    from rich.console import Console
    from rich.table import Table

    out = file if file is not None else sys.stdout
    console = Console(file=out, width=None if getattr(out, "isatty", lambda: False)() else 130)
    table = Table(title=(f"Expected end-to-end time, MTBF {rec['mtbf_hours']:g} h "
                         f"({rec['expected_failures']:g} failures in {rec['failure_free_hours']:g} h of compute)"))
    for col in ("alternative", "recovery", "parallel recovery", "checkpoint interval", "Young", "expected h",
                "per failure s"):
        table.add_column(col, justify="left" if col in ("alternative", "recovery") else "right")
    for a in rec["alternatives"]:
        mark = " (recommended)" if a["name"] == rec["recommended"] else ""
        table.add_row(a["name"] + mark, a["strategy"], "yes" if a["parallel_recovery"] else "no",
                      str(a["checkpoint_interval"]), "-" if a["young_interval"] is None else f"{a['young_interval']:g}",
                      f"{a['expected_hours']:.2f}", f"{a['per_failure_s']:.1f}")
    console.print(table)
    for line in rec.get("assumptions", []):
        console.print(f"  assumption: {line}")
