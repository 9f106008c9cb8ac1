"""A whole simulation file: every workload's strategies, recommendations, sweeps and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_swift.config import ConfigError
from ds_swift.recovery.registry import GLOBAL_CHECKPOINT
from ds_swift.sim.model import interval_field
from ds_swift.sim.recommend import IntervalRecommendation, recommend
from ds_swift.sim.runner import StrategyResult, SweepPoint, geometric_grid, interval_sweep, mtbf_sweep, simulate
from ds_swift.sim.schema import SimConfig, WorkloadConfig

__all__ = ["WorkloadReport", "full_json", "run_study", "summary_json", "sweep_grid", "write_plots"]

#: the strategy speed-ups are measured against
BASELINE = GLOBAL_CHECKPOINT


@dataclass
class WorkloadReport:
    """Results of one workload."""

    config: WorkloadConfig
    results: dict[str, StrategyResult]
    recommendations: list[IntervalRecommendation] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.config.workload.name

    def speedup(self, strategy: str) -> float | None:
        """Mean time of the baseline over the strategy's (``None`` without a baseline)."""
        base = self.results.get(BASELINE)
        if base is None:
            return None
        return base.mean_hours / self.results[strategy].mean_hours


def _select(cfg: SimConfig, names: Sequence[str] | None) -> list[WorkloadConfig]:
    if not names:
        return list(cfg.workloads)
    known = {w.workload.name: w for w in cfg.workloads}
    missing = [n for n in names if n not in known]
    if missing:
        raise ConfigError(f"--workload {missing[0]!r} is not in the file; it has: {', '.join(known)}")
    return [known[n] for n in names]


def run_study(
    cfg: SimConfig,
    *,
    repeats: int | None = None,
    seed: int | None = None,
    workloads: Sequence[str] | None = None,
    with_recommendations: bool = False,
) -> list[WorkloadReport]:
    """Simulate every selected workload (same failure draws for all its strategies)."""
    reps = cfg.repeats if repeats is None else repeats
    sd = cfg.seed if seed is None else seed
    reports = []
    for wl in _select(cfg, workloads):
        results = simulate(wl.workload, wl.strategies, wl.failures, repeats=reps, seed=sd)
        report = WorkloadReport(wl, results)
        if with_recommendations:
            report.recommendations = recommend(wl.workload, wl.strategies, wl.failures, repeats=reps, seed=sd)
        reports.append(report)
    return reports


def summary_json(reports: Sequence[WorkloadReport]) -> dict[str, dict[str, float]]:
    """workload name -> strategy name -> mean hours."""
    return {r.name: {s: round(res.mean_hours, 4) for s, res in r.results.items()} for r in reports}


def full_json(reports: Sequence[WorkloadReport]) -> dict[str, Any]:
    """Means, confidence intervals, failure-free times, speed-ups and recommendations."""
    out: dict[str, Any] = {}
    for r in reports:
        entry: dict[str, Any] = {}
        for name, res in r.results.items():
            d = res.to_dict()
            sp = r.speedup(name)
            d[f"speedup_vs_{BASELINE}"] = None if sp is None else round(sp, 4)
            entry[name] = d
        for rec in r.recommendations:
            entry[rec.strategy]["recommendation"] = rec.to_dict()
        out[r.name] = entry
    return out


def sweep_grid(cfg: SimConfig, report: WorkloadReport) -> list[int]:
    """The interval grid of Figure 13 for a workload: the file's, or a geometric grid around
    the configured and optimal intervals of its tunable strategies."""
    if cfg.sweeps.intervals is not None:
        return sorted(cfg.sweeps.intervals)
    anchors: list[int] = []
    for s in report.config.strategies:
        name = interval_field(s)
        if name is not None and getattr(s, name) is not None:
            anchors.append(int(getattr(s, name)))
    anchors += [rec.optimal for rec in report.recommendations if rec.optimal is not None]
    n = report.config.workload.total_iterations
    if not anchors:
        return geometric_grid(1, n, cfg.sweeps.interval_points)
    return geometric_grid(max(1, min(anchors) // 8), min(n, max(anchors) * 4), cfg.sweeps.interval_points)


def write_plots(
    cfg: SimConfig, reports: Sequence[WorkloadReport], outdir: str | Path, *, repeats: int, seed: int
) -> list[Path]:
    """Write ``interval_sweep.png`` (Figure 13) and ``mtbf_sweep.png`` (Figure 14)."""
    from ds_swift.sim.plots import plot_interval_sweep, plot_mtbf_sweep

    outdir = Path(outdir)
    by_interval: dict[str, dict[str, list[SweepPoint]]] = {}
    by_mtbf: dict[str, dict[str, list[SweepPoint]]] = {}
    optima: dict[str, dict[str, int | None]] = {}
    for r in reports:
        if not r.recommendations:
            wl = r.config
            r.recommendations = recommend(wl.workload, wl.strategies, wl.failures, repeats=repeats, seed=seed)
        wl = r.config
        grid = sweep_grid(cfg, r)
        by_interval[r.name] = interval_sweep(wl.workload, wl.strategies, wl.failures, grid, repeats=repeats, seed=seed)
        optima[r.name] = {rec.strategy: rec.optimal for rec in r.recommendations}
        # Figure 14 fixes every strategy at its optimal interval (SWIFT section 7.3).
        tuned = {rec.strategy: rec.optimal for rec in r.recommendations if rec.optimal is not None}
        by_mtbf[r.name] = mtbf_sweep(
            wl.workload, wl.strategies, wl.failures, cfg.sweeps.mtbf_hours, intervals=tuned, repeats=repeats, seed=seed
        )
    return [
        plot_interval_sweep(by_interval, optima, outdir / "interval_sweep.png"),
        plot_mtbf_sweep(by_mtbf, outdir / "mtbf_sweep.png"),
    ]
