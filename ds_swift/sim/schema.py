"""The YAML input of ``ds-swift simulate``: schema, defaults and errors that name the field.

Schema (times in seconds unless the name says hours, intervals in iterations)::

    description: free text                      # optional, ignored
    simulation:  {repeats: 10, seed: 0}         # optional
    failures:                                    # default for every workload
      model: uniform        # uniform | exponential | weibull
      count: 28             # uniform: exact count ...
      mtbf_hours: 17        # ... or mean time between failures (uniform: count = round(T / mtbf))
      median_hours: 12      # exponential | weibull: instead of mtbf_hours
      shape: 0.7            # weibull only
    defaults: {restart_s: 99}                    # strategy fields shared by all workloads
    scale_model: scale_model.json               # optional: restart_s from a fitted model at each
                                                # workload's ranks (benchmarks/scale.py --model-out)
    sweeps:                                      # optional, for --plot and --recommend
      interval_points: 25   # points of the checkpoint-interval sweep (Figure 13)
      intervals: [50, 100]  # explicit sweep grid instead (iterations)
      mtbf_hours: [4, 8, 17, 34, 68]             # failure-frequency sweep (Figure 14)
    workloads:
      - name: BERT-128
        total_iterations: 500000
        failure_free_hours: 461.1   # or iteration_time_s: 3.32
        machines: 16                # optional (selective-logging groups)
        ranks: 1024                 # required with scale_model
        pipeline: {stages: 128, micro_batches: 4}   # optional (derived replay fractions)
        failures: {...}             # optional override of the top-level failures
        defaults: {...}             # optional strategy fields for this workload
        strategies:
          global_checkpoint: {kind: checkpoint, checkpoint_interval: 5000, checkpoint_cost_s: 0.93, load_s: 5}
          swift:
            kind: logging
            checkpoint_interval: 5000
            logging: {replay_fraction: 0.40, parallel_recovery: true, parallel_speedup: 1.86}

Strategy fields (see :class:`ds_swift.sim.model.StrategySpec`): ``kind`` (checkpoint |
snapshot | replication | logging | elastic), ``checkpoint_interval``, ``checkpoint_cost_s``,
``restart_s``, ``iteration_overhead`` for every kind; ``load_s`` (checkpoint, snapshot,
logging), ``snapshot_interval`` and ``snapshot_cost_s`` (snapshot), ``undo_s`` (replication,
logging, elastic), ``broadcast_s`` (replication, snapshot, elastic), ``repair_s``, ``grow_s`` and
``shrunk_throughput`` (elastic), ``logging`` (logging: ``groups`` as a count
of balanced groups or a list of machines per group, ``replay_fraction``,
``parallel_recovery``, ``parallel_speedup``, ``parallel_setup_s``,
``parallel_exchange_s_per_iteration``, ``upload_s``, ``download_s_per_iteration``).
A field in ``defaults`` that a kind does not read is skipped for that strategy; the same field
written in the strategy itself is an error (it would silently do nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ds_swift.config import ConfigError
from ds_swift.sim.failures import FailureModel
from ds_swift.sim.model import (
    COMMON_FIELDS,
    KIND_FIELDS,
    LoggingSpec,
    StrategySpec,
    Workload,
    recovery_paths,
    shrunk_throughput,
)
from ds_swift.sim.scale_model import ScaleModel, load_scale_model

__all__ = ["SimConfig", "SweepSpec", "WorkloadConfig", "load_sim_config", "parse_sim_config"]

_ALL_STRATEGY_FIELDS = COMMON_FIELDS.union(*KIND_FIELDS.values())
_LOGGING_FIELDS = frozenset(
    {
        "groups",
        "replay_fraction",
        "parallel_recovery",
        "parallel_speedup",
        "parallel_setup_s",
        "parallel_exchange_s_per_iteration",
        "upload_s",
        "download_s_per_iteration",
        "kinds",
        "apply_fraction",
    }
)
_FAILURE_FIELDS = frozenset({"model", "count", "mtbf_hours", "median_hours", "shape"})


@dataclass(frozen=True)
class SweepSpec:
    """Grids of the checkpoint-interval and failure-frequency sweeps."""

    interval_points: int = 25
    """Points of the interval sweep when ``intervals`` is not given."""

    intervals: tuple[int, ...] | None = None
    """Explicit interval grid, iterations."""

    mtbf_hours: tuple[float, ...] = (4.0, 8.0, 12.0, 17.0, 24.0, 34.0, 48.0, 68.0)
    """Mean times between failures of the failure-frequency sweep."""


@dataclass(frozen=True)
class WorkloadConfig:
    """One workload, its strategies and its failure process."""

    workload: Workload
    strategies: tuple[StrategySpec, ...]
    failures: FailureModel

    def strategy(self, name: str) -> StrategySpec:
        for s in self.strategies:
            if s.name == name:
                return s
        raise KeyError(name)


@dataclass(frozen=True)
class SimConfig:
    """A parsed simulation file."""

    workloads: tuple[WorkloadConfig, ...]
    repeats: int = 10
    seed: int = 0
    sweeps: SweepSpec = SweepSpec()
    description: str = ""


class _Ctx:
    """Builds errors that start with the file and the dotted path of the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, path: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}")

    def mapping(self, value: Any, path: str, allowed: frozenset[str] | None = None) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(path, f"must be a mapping, got {value!r}")
        if allowed is not None:
            unknown = sorted(str(k) for k in value if k not in allowed)
            if unknown:
                raise self.error(path, f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")
        return value

    def integer(self, value: Any, path: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(path, f"{value!r} is invalid: an integer >= {minimum}")
        return value

    def number(self, value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(path, f"{value!r} is invalid: a positive number")
        return float(value)


def load_sim_config(path: str | Path) -> SimConfig:
    """Read and validate a simulation YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"simulation config {str(p)!r} cannot be read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"simulation config {str(p)!r} is not valid YAML: {exc}") from exc
    return parse_sim_config(data, source=p.name, base=p.parent)


def parse_sim_config(data: Any, source: str = "simulation config", base: Path | None = None) -> SimConfig:
    """Validate an already-parsed YAML document (``base``: where a relative ``scale_model`` path starts)."""
    ctx = _Ctx(source)
    top = ctx.mapping(
        data, "", frozenset({"description", "simulation", "failures", "defaults", "sweeps", "workloads", "scale_model"})
    )
    sim = ctx.mapping(top.get("simulation", {}), "simulation", frozenset({"repeats", "seed"}))
    repeats = ctx.integer(sim.get("repeats", 10), "simulation.repeats", 1)
    seed = ctx.integer(sim.get("seed", 0), "simulation.seed", 0)
    defaults = _defaults(ctx, top.get("defaults", {}), "defaults")
    failures_default = top.get("failures")
    sweeps = _sweeps(ctx, top.get("sweeps", {}))
    scale = _scale_model(ctx, top.get("scale_model"), base)
    workloads_raw = top.get("workloads")
    if not isinstance(workloads_raw, list) or not workloads_raw:
        raise ctx.error("workloads", "must be a non-empty list of workloads")
    workloads = []
    names: set[str] = set()
    for i, raw in enumerate(workloads_raw):
        wl = _workload(ctx, raw, f"workloads[{i}]", defaults, failures_default, scale)
        if wl.workload.name in names:
            raise ctx.error(f"workloads[{i}].name", f"{wl.workload.name!r} is used twice")
        names.add(wl.workload.name)
        workloads.append(wl)
    description = top.get("description", "")
    if not isinstance(description, str):
        raise ctx.error("description", "must be a string")
    return SimConfig(tuple(workloads), repeats=repeats, seed=seed, sweeps=sweeps, description=description)


def _defaults(ctx: _Ctx, raw: Any, path: str) -> dict[str, Any]:
    section = ctx.mapping(raw, path, _ALL_STRATEGY_FIELDS - {"kind"})
    return dict(section)


def _sweeps(ctx: _Ctx, raw: Any) -> SweepSpec:
    section = ctx.mapping(raw, "sweeps", frozenset({"interval_points", "intervals", "mtbf_hours"}))
    points = ctx.integer(section.get("interval_points", SweepSpec.interval_points), "sweeps.interval_points", 2)
    intervals = None
    if "intervals" in section:
        if not isinstance(section["intervals"], list) or not section["intervals"]:
            raise ctx.error("sweeps.intervals", "must be a non-empty list of positive integers")
        intervals = tuple(ctx.integer(v, f"sweeps.intervals[{j}]", 1) for j, v in enumerate(section["intervals"]))
    mtbf = SweepSpec.mtbf_hours
    if "mtbf_hours" in section:
        if not isinstance(section["mtbf_hours"], list) or not section["mtbf_hours"]:
            raise ctx.error("sweeps.mtbf_hours", "must be a non-empty list of positive numbers")
        mtbf = tuple(ctx.number(v, f"sweeps.mtbf_hours[{j}]") for j, v in enumerate(section["mtbf_hours"]))
    return SweepSpec(interval_points=points, intervals=intervals, mtbf_hours=mtbf)


def _failures(ctx: _Ctx, raw: Any, path: str) -> FailureModel:
    section = ctx.mapping(raw, path, _FAILURE_FIELDS)
    try:
        return FailureModel(**section)
    except ConfigError as exc:
        raise ctx.error(path, str(exc)) from None


def _scale_model(ctx: _Ctx, raw: Any, base: Path | None) -> ScaleModel | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw:
        raise ctx.error("scale_model", f"{raw!r} is invalid: the path of a model benchmarks/scale.py --model-out wrote")
    path = Path(raw) if base is None or Path(raw).is_absolute() else base / raw
    try:
        return load_scale_model(path)
    except ConfigError as exc:
        raise ctx.error("scale_model", str(exc)) from None


def _workload(
    ctx: _Ctx,
    raw: Any,
    path: str,
    top_defaults: Mapping[str, Any],
    failures_default: Any,
    scale: ScaleModel | None = None,
) -> WorkloadConfig:
    allowed = frozenset(
        {
            "name",
            "ranks",
            "description",
            "total_iterations",
            "iteration_time_s",
            "failure_free_hours",
            "machines",
            "pipeline",
            "failures",
            "defaults",
            "strategies",
        }
    )
    section = ctx.mapping(raw, path, allowed)
    name = section.get("name")
    if not isinstance(name, str) or not name:
        raise ctx.error(f"{path}.name", f"{name!r} is invalid: a non-empty string")
    path = f"{path} ({name})"
    if "total_iterations" not in section:
        raise ctx.error(f"{path}.total_iterations", "is required")
    iterations = ctx.integer(section["total_iterations"], f"{path}.total_iterations", 1)
    has_time, has_hours = "iteration_time_s" in section, "failure_free_hours" in section
    if has_time == has_hours:
        raise ctx.error(path, "give exactly one of iteration_time_s and failure_free_hours")
    if has_time:
        iteration_time = ctx.number(section["iteration_time_s"], f"{path}.iteration_time_s")
    else:
        # Table-4 style: the failure-free time is iterations x iteration time, stalls excluded.
        iteration_time = ctx.number(section["failure_free_hours"], f"{path}.failure_free_hours") * 3600.0 / iterations
    machines = ctx.integer(section.get("machines", 1), f"{path}.machines", 1)
    pipeline = ctx.mapping(section.get("pipeline", {}), f"{path}.pipeline", frozenset({"stages", "micro_batches"}))
    workload = Workload(
        name=name,
        total_iterations=iterations,
        iteration_time_s=iteration_time,
        machines=machines,
        pipeline_stages=ctx.integer(pipeline.get("stages", 1), f"{path}.pipeline.stages", 1),
        micro_batches=ctx.integer(pipeline.get("micro_batches", 1), f"{path}.pipeline.micro_batches", 1),
    )
    failures_raw = section.get("failures", failures_default)
    if failures_raw is None:
        raise ctx.error(f"{path}.failures", "is required (here or at the top level)")
    failures = _failures(ctx, failures_raw, f"{path}.failures" if "failures" in section else "failures")
    defaults = {**top_defaults, **_defaults(ctx, section.get("defaults", {}), f"{path}.defaults")}
    if scale is not None:
        if "ranks" not in section:
            raise ctx.error(f"{path}.ranks", "is required with scale_model (the model's recovery costs depend on it)")
        # The model's initialization at this size replaces a constant restart_s (a strategy's own still wins).
        defaults["restart_s"] = scale.initialization_s(ctx.integer(section["ranks"], f"{path}.ranks", 1))
    strategies_raw = ctx.mapping(section.get("strategies"), f"{path}.strategies")
    if not strategies_raw:
        raise ctx.error(f"{path}.strategies", "must name at least one strategy")
    strategies = tuple(
        _strategy(ctx, str(sname), sraw, f"{path}.strategies.{sname}", defaults, workload)
        for sname, sraw in strategies_raw.items()
    )
    return WorkloadConfig(workload, strategies, failures)


def _strategy(
    ctx: _Ctx, name: str, raw: Any, path: str, defaults: Mapping[str, Any], workload: Workload
) -> StrategySpec:
    section = ctx.mapping(raw, path, _ALL_STRATEGY_FIELDS)
    kind = section.get("kind")
    if kind not in KIND_FIELDS:
        raise ctx.error(f"{path}.kind", f"{kind!r} is invalid: one of {', '.join(KIND_FIELDS)}")
    reads = COMMON_FIELDS | KIND_FIELDS[kind]
    ignored = sorted(k for k in section if k not in reads)
    if ignored:
        raise ctx.error(f"{path}.{ignored[0]}", f"is not read by kind {kind} (it reads {', '.join(sorted(reads))})")
    fields: dict[str, Any] = {k: v for k, v in defaults.items() if k in reads}
    fields.update(section)
    if "logging" in fields:
        fields["logging"] = _logging(ctx, fields["logging"], f"{path}.logging", workload)
    try:
        spec = StrategySpec(name=name, **fields)
        if spec.kind == "logging":
            recovery_paths(workload, spec)  # group sizes vs machines, checked now, not mid-run
        if spec.kind == "elastic":
            shrunk_throughput(workload, spec)  # a one-machine job cannot shrink: said now
    except ConfigError as exc:
        raise ctx.error(path, str(exc)) from None
    except TypeError as exc:  # a wrong-typed value that the dataclass could not even hold
        raise ctx.error(path, str(exc)) from None
    return spec


def _logging(ctx: _Ctx, raw: Any, path: str, workload: Workload) -> LoggingSpec:
    section = dict(ctx.mapping(raw, path, _LOGGING_FIELDS))
    groups = section.get("groups")
    if groups is not None:
        if isinstance(groups, int) and not isinstance(groups, bool):
            if not 1 <= groups <= workload.machines:
                raise ctx.error(f"{path}.groups", f"{groups!r} is invalid: 1..{workload.machines} (the machines)")
            base, extra = divmod(workload.machines, groups)
            section["groups"] = tuple(base + (1 if i < extra else 0) for i in range(groups))
        elif isinstance(groups, list):
            section["groups"] = tuple(groups)
        else:
            raise ctx.error(f"{path}.groups", f"{groups!r} is invalid: a number of groups or a list of group sizes")
    if isinstance(section.get("kinds"), list):
        section["kinds"] = tuple(section["kinds"])
    try:
        return LoggingSpec(**section)
    except ConfigError as exc:
        raise ctx.error(path, str(exc)) from None
