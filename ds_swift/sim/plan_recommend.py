"""The planner's recommendation: for a topology plan (``ds-swift plan --json``), which strategy
and checkpoint interval to run with and what each alternative is expected to cost.

A failure takes a stage's recovery path (replication, logging replay, global checkpoint) with the
share of the plan's stages on that path; the interval search is ds_swift.sim.recommend's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ds_swift.config import ConfigError
from ds_swift.recovery.registry import GLOBAL_CHECKPOINT
from ds_swift.sim.failures import FailureModel
from ds_swift.sim.model import LoggingSpec, StrategySpec, Workload, expected_failure_cost_s, failure_free_s
from ds_swift.sim.plan_shape import PATHS, group_sizes, log_download_s, plan_workload, stage_strategies
from ds_swift.sim.recommend import minimise_interval, optimal_interval, young_daly_intervals
from ds_swift.sim.runner import geometric_grid

__all__ = ["print_recommendation", "recommend_for_plan"]

_HOUR = 3600.0


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
    mtbf = _checked_mtbf(mtbf_hours)
    stage_kinds = stage_strategies(plan_json)
    sizes = group_sizes(plan_json)
    workload = plan_workload(plan_json, stage_kinds, sizes, total_iterations, iteration_time_s, micro_batches)
    failures = FailureModel("exponential", mtbf_hours=mtbf)
    n_fail = failures.expected_count(workload.compute_s / _HOUR)
    weights = {k: stage_kinds.count(k) / len(stage_kinds) for k in PATHS}
    assumptions = list(_ASSUMPTIONS)
    gc = _global_checkpoint(total_iterations, checkpoint_cost_s, restart_cost_s, load_s)
    gc_interval, gc_row = _global_checkpoint_row(workload, gc, failures, n_fail, grid_points)
    case = _SwiftCase(
        plan_json,
        workload,
        failures,
        {k: w for k, w in weights.items() if w > 0},
        sizes,
        gc,
        undo_s,
        broadcast_s,
        replay_fraction,
        parallel_speedup,
        log_download_s(plan_json, sizes, storage_gbps, assumptions),
        logging_overhead,
        checkpoint_interval or gc_interval or total_iterations,
        grid_points,
        assumptions,
    )
    return _result(mtbf, workload, n_fail, [gc_row, *case.alternatives()], assumptions)


#: what every recommendation assumes (recommend_for_plan adds what it assumed for this plan)
_ASSUMPTIONS = (
    "failures: Poisson on the compute clock, expected count = compute hours / MTBF; recovery not exposed",
    "a failure takes a stage's recovery path with the share of stages planned for that path",
)


def _global_checkpoint(
    total_iterations: int, checkpoint_cost_s: float, restart_cost_s: float, load_s: float
) -> StrategySpec:
    """The global checkpoint at its stall, restart and load costs (its interval: the whole job, until chosen)."""
    return StrategySpec(
        GLOBAL_CHECKPOINT,
        "checkpoint",
        checkpoint_interval=total_iterations,
        checkpoint_cost_s=checkpoint_cost_s,
        restart_s=restart_cost_s,
        load_s=load_s,
    )


def _result(
    mtbf: float, workload: Workload, n_fail: float, rows: list[dict[str, Any]], assumptions: list[str]
) -> dict[str, Any]:
    """``recommend_for_plan``'s answer: the alternatives fastest first, the first recommended."""
    alternatives = sorted(rows, key=lambda a: a["expected_hours"])
    return {
        "mtbf_hours": mtbf,
        "failure_free_hours": round(workload.compute_s / _HOUR, 4),
        "expected_failures": round(n_fail, 3),
        "recommended": alternatives[0]["name"],
        "alternatives": alternatives,
        "assumptions": assumptions,
    }


def _checked_mtbf(mtbf_hours: float) -> float:
    """``mtbf_hours`` as a float, refused unless a positive number."""
    if isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float)) or not mtbf_hours > 0:
        raise ConfigError(f"--mtbf-hours={mtbf_hours!r} is invalid: a positive number of hours")
    return float(mtbf_hours)


def _global_checkpoint_row(
    workload: Workload, gc: StrategySpec, failures: FailureModel, n_fail: float, grid_points: int
) -> tuple[int | None, dict[str, Any]]:
    """The global-checkpoint baseline: its optimal interval and its row of ``alternatives``."""
    gc_rec = optimal_interval(workload, gc, failures, grid_points=grid_points)
    per_failure_s = _per_failure(gc_rec.optimal_hours * _HOUR, workload, gc, gc_rec.optimal, n_fail)
    row = _alternative(
        GLOBAL_CHECKPOINT,
        "checkpoint",
        None,
        False,
        gc_rec.optimal,
        gc_rec.young,
        gc_rec.daly,
        gc_rec.optimal_hours,
        per_failure_s,
    )
    return gc_rec.optimal, row


@dataclass(frozen=True)
class _SwiftCase:
    """A plan's job and costs, priced for the swift alternatives: each stage on its planned path."""

    plan_json: Mapping[str, Any]
    workload: Workload
    failures: FailureModel
    weights: dict[str, float]
    """Share of the stages on each recovery path (paths with no stage left out)."""
    sizes: list[int]
    gc: StrategySpec
    """The global checkpoint at its stall, restart and load costs."""
    undo_s: float
    broadcast_s: float
    replay_fraction: float | None
    parallel_speedup: float | None
    download_s: float
    logging_overhead: float
    fallback_interval: int
    """Checkpoint interval of a pure-replication plan (its recovery ignores the interval)."""
    grid_points: int
    assumptions: list[str]

    @property
    def n_fail(self) -> float:
        return self.failures.expected_count(self.workload.compute_s / _HOUR)

    @property
    def overhead(self) -> float:
        return self.logging_overhead if "logging" in self.weights else 0.0

    @property
    def base(self) -> StrategySpec:
        """The failure-free cost: global checkpoints at the interval, slowed by logging."""
        return replace(self.gc, name="swift", iteration_overhead=self.overhead)

    @property
    def log_workload(self) -> Workload:
        # The plan's groups partition the logged machines; replay is derived on those machines.
        w = self.workload
        logged = sum(self.sizes) if self.sizes else w.machines
        return replace(w, machines=logged, pipeline_stages=max(1, round(w.pipeline_stages * logged / w.machines)))

    def paths(self, parallel: bool) -> dict[str, tuple[Workload, StrategySpec]]:
        """The job and strategy each recovery path is priced with."""
        log_spec = LoggingSpec(
            groups=None if self.replay_fraction is not None else (tuple(self.sizes) if self.sizes else None),
            replay_fraction=self.replay_fraction,
            parallel_recovery=parallel,
            parallel_speedup=self.parallel_speedup,
            download_s_per_iteration=self.download_s,
        )
        gc = self.gc
        replication = StrategySpec(
            "replication", "replication", restart_s=gc.restart_s, undo_s=self.undo_s, broadcast_s=self.broadcast_s
        )
        logging = StrategySpec(
            "logging",
            "logging",
            restart_s=gc.restart_s,
            load_s=gc.load_s,
            undo_s=self.undo_s,
            iteration_overhead=self.overhead,
            logging=log_spec,
        )
        return {
            "replication": (self.workload, replication),
            "logging": (self.log_workload, logging),
            "checkpoint": (self.workload, replace(gc, iteration_overhead=self.overhead)),
        }

    def alternatives(self) -> list[dict[str, Any]]:
        """The swift alternatives: with and without parallel recovery where a stage replays a log."""
        return [self.alternative(parallel) for parallel in ([True, False] if "logging" in self.weights else [False])]

    def alternative(self, parallel: bool) -> dict[str, Any]:
        """The swift alternative, with or without parallel recovery, at its best interval."""
        paths = self.paths(parallel)
        workload, base, n_fail = self.workload, self.base, self.n_fail

        def expected_s(interval: int) -> float:
            per_failure = sum(
                w * expected_failure_cost_s(paths[k][0], replace(paths[k][1], checkpoint_interval=interval))
                for k, w in self.weights.items()
            )
            return failure_free_s(workload, replace(base, checkpoint_interval=interval)) + n_fail * per_failure

        best, best_s = _best_interval(
            expected_s,
            self.weights,
            workload.total_iterations,
            self.grid_points,
            self.fallback_interval,
            self.assumptions,
        )
        young = daly = None
        if set(self.weights) == {"logging"}:
            logging_spec = replace(paths["logging"][1], checkpoint_cost_s=self.gc.checkpoint_cost_s)
            young, daly = young_daly_intervals(paths["logging"][0], logging_spec, self.failures)
        name = "swift" if parallel or "logging" not in self.weights else "swift_no_parallel_recovery"
        groups = self.plan_json.get("groups") if "logging" in self.weights else None
        per_failure_s = _per_failure(best_s, workload, base, best, n_fail)
        hours = best_s / _HOUR
        return _alternative(
            name, "+".join(self.weights), groups, parallel, int(best), young, daly, hours, per_failure_s
        )


def _best_interval(
    expected_s: Callable[[int], float],
    weights: Mapping[str, float],
    total_iterations: int,
    grid_points: int,
    fallback: int,
    assumptions: list[str],
) -> tuple[int, float]:
    """The interval minimising ``expected_s``, and its expected seconds."""
    if "logging" in weights or "checkpoint" in weights:
        best, best_s, _ = minimise_interval(expected_s, geometric_grid(1, total_iterations, grid_points))
        return best, best_s
    # Pure replication: recovery ignores the interval; checkpoints stay as the safety net
    # for losing every replica, which this model does not count.
    assumptions.append(
        f"replication keeps global checkpoints every {fallback} iterations as the safety net "
        "(pass checkpoint_interval to choose another)"
    )
    return fallback, expected_s(fallback)


def _alternative(
    name: str,
    strategy: str,
    groups: Any,
    parallel: bool,
    interval: int | None,
    young: float | None,
    daly: float | None,
    hours: float,
    per_failure_s: float,
) -> dict[str, Any]:
    """One row of ``recommend_for_plan``'s ``alternatives``."""
    return {
        "name": name,
        "strategy": strategy,
        "groups": groups,
        "parallel_recovery": parallel,
        "checkpoint_interval": interval,
        "young_interval": None if young is None else round(young, 1),
        "daly_interval": None if daly is None else round(daly, 1),
        "expected_hours": round(hours, 4),
        "per_failure_s": per_failure_s,
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
    table = Table(
        title=(
            f"Expected end-to-end time, MTBF {rec['mtbf_hours']:g} h "
            f"({rec['expected_failures']:g} failures in {rec['failure_free_hours']:g} h of compute)"
        )
    )
    for col in (
        "alternative",
        "recovery",
        "parallel recovery",
        "checkpoint interval",
        "Young",
        "expected h",
        "per failure s",
    ):
        table.add_column(col, justify="left" if col in ("alternative", "recovery") else "right")
    for a in rec["alternatives"]:
        mark = " (recommended)" if a["name"] == rec["recommended"] else ""
        table.add_row(
            a["name"] + mark,
            a["strategy"],
            "yes" if a["parallel_recovery"] else "no",
            str(a["checkpoint_interval"]),
            "-" if a["young_interval"] is None else f"{a['young_interval']:g}",
            f"{a['expected_hours']:.2f}",
            f"{a['per_failure_s']:.1f}",
        )
    console.print(table)
    for line in rec.get("assumptions", []):
        console.print(f"  assumption: {line}")
