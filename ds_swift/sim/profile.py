"""Bench profiles: measured per-strategy costs for ``ds-swift simulate FILE --profile BENCH.json``.

The profile is the contract between ``ds-swift bench --json`` (which writes it) and the
simulator (which reads it): the YAML file gives the workload and its failure process, the
profile replaces the hand-set per-strategy costs with measured ones. One JSON object::

    {
      "version": 1,
      "iteration_time_s": 0.5,       # bench job, no fault tolerance: seconds per iteration
      "checkpoint_interval": 50,     # bench job: iterations between global checkpoints (null: none)
      "checkpoint_cost_s": 2.0,      # bench job: training stall per global checkpoint
      "strategies": [
        {"name": "global_checkpoint", "throughput_ratio": 0.926, "init_s": 20.0,
         "recovery_s": 15.5, "iterations_lost": 25, "bytes_per_iteration": 8.0e6,
         "host_memory_per_rank": 0, "exact": true, "max_ulp": 0},
        {"name": "checkfreq", "checkpoint_interval": null, "snapshot_interval": 5,
         "snapshot_cost_s": 0.1, ...},
        ...
      ]
    }

Other top-level keys (the bench's job description, command line, loss curves) are ignored:
every key the simulator reads there is required, so a misspelt one cannot pass unnoticed.
Row keys are checked strictly (see :class:`BenchRow` for each field). All rows describe one
failure injected into one failure-free run of the same job and seed.

How a row becomes a :class:`~ds_swift.sim.model.StrategySpec` (:func:`strategy_from_row`).
Write ``t_b`` for the bench's ``iteration_time_s`` and ``o`` for the strategy's per-iteration
slowdown:

- ``kind`` from the row, or from its name (:func:`ds_swift.sim.profile_rows.default_kind`: the
  registered strategy's services' ``sim_kind``);
- ``iteration_overhead`` ``o = 1 / throughput_ratio - 1 - C / (c t_b) - S / (s t_b)``: the
  bench's failure-free run includes its checkpoint (``C`` every ``c``) and snapshot (``S``
  every ``s``) stalls, which the simulator adds back at the simulated job's own intervals;
- ``restart_s = init_s``;
- checkpoint / snapshot: ``load_s = restore_s``, or, without one, ``recovery_s -
  iterations_lost x t_b (1 + o)`` (the model replays at full speed; clamped at 0);
- replication: the whole ``recovery_s`` is a per-failure constant (``broadcast_s``): nothing is
  replayed, so ``iterations_lost`` must be 0;
- elastic (lossy forward without a spare): the whole ``recovery_s`` is a per-failure constant
  (``broadcast_s``: the resharding), and ``shrunk_throughput`` as measured; ``repair_s`` and
  ``grow_s`` (when the machine comes back) are policy, from the YAML's strategy of the same name;
- logging (SWIFT, TranLogs): ``load_s = restore_s`` (0 without one) and ``replay_fraction =
  (recovery_s - restore_s) / (iterations_lost x t_b (1 + o))``, with parallel recovery off
  (the measured pace already has whatever speed-up the bench's recovery had);
- ``checkpoint_cost_s`` and ``snapshot_cost_s`` as measured.

Scaling to the simulated job: fractions of an iteration (``o``, the replay fraction) are
multiplied by the YAML's iteration time, seconds (``init_s``, restore, checkpoint and snapshot
stalls) are carried over as they are. A profile measured on the job you simulate (same model,
same machines) therefore carries over exactly; one measured on a smaller job understates the
absolute costs of a bigger one. Intervals are policy, not costs: they come from the YAML's
strategy of the same name; a strategy only in the profile takes the YAML's
``global_checkpoint`` interval (the job's checkpoint policy; the bench's when the YAML has
none) when it took global checkpoints in the bench, and its bench snapshot interval. ``bytes_per_iteration``,
``host_memory_per_rank``, ``exact``, ``max_ulp`` and ``final_loss_delta`` are read and checked
but do not enter the time model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ds_swift.config import ConfigError
from ds_swift.recovery.registry import GLOBAL_CHECKPOINT
from ds_swift.sim.model import LoggingSpec, StrategySpec
from ds_swift.sim.profile_rows import BenchProfile, BenchRow, _integer, _number
from ds_swift.sim.schema import SimConfig, WorkloadConfig

__all__ = ["BenchProfile", "BenchRow", "apply_profile", "load_profile", "parse_profile", "strategy_from_row"]

_TOP_REQUIRED = ("iteration_time_s", "checkpoint_interval", "checkpoint_cost_s", "strategies")
_ROW_FIELDS = frozenset(f.name for f in fields(BenchRow))
_ROW_REQUIRED = (
    "name",
    "throughput_ratio",
    "init_s",
    "recovery_s",
    "iterations_lost",
    "bytes_per_iteration",
    "host_memory_per_rank",
    "exact",
)


def load_profile(path: str | Path) -> BenchProfile:
    """Read and validate a bench profile JSON file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"bench profile {str(p)!r} cannot be read: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"bench profile {str(p)!r} is not valid JSON: {exc}") from exc
    return parse_profile(data, source=p.name)


def parse_profile(data: Any, source: str = "bench profile") -> BenchProfile:
    """Validate an already-parsed profile; errors start with ``source`` and the field's path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: must hold a JSON object with a 'strategies' list, got {type(data).__name__}")
    missing = [k for k in _TOP_REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{source}: {missing[0]} is required (see ds_swift/sim/profile.py for the format)")
    if data.get("version", 1) != 1:
        raise ConfigError(f"{source}: version={data['version']!r} is invalid: this ds-swift reads version 1")
    try:
        _number("iteration_time_s", data["iteration_time_s"], "a positive number (seconds)", positive=True)
        _integer(
            "checkpoint_interval",
            data["checkpoint_interval"],
            1,
            "a positive integer or null (no checkpoints)",
            allow_none=True,
        )
        _number("checkpoint_cost_s", data["checkpoint_cost_s"])
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    raw_rows = data["strategies"]
    if not isinstance(raw_rows, list) or not raw_rows:
        raise ConfigError(f"{source}: strategies must be a non-empty list of rows, one per strategy")
    rows: list[BenchRow] = []
    for i, raw in enumerate(raw_rows):
        row = _row(raw, f"{source}: strategies[{i}]", data)
        if any(r.name == row.name for r in rows):
            raise ConfigError(f"{source}: strategies[{i}].name={row.name!r} is used twice: one row per strategy")
        rows.append(row)
    return BenchProfile(
        float(data["iteration_time_s"]),
        data["checkpoint_interval"],
        float(data["checkpoint_cost_s"]),
        tuple(rows),
        source,
    )


def _row(raw: Any, where: str, top: Mapping[str, Any]) -> BenchRow:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a JSON object, got {raw!r}")
    if isinstance(raw.get("name"), str):
        where = f"{where} ({raw['name']})"
    unknown = sorted(str(k) for k in raw if k not in _ROW_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_ROW_FIELDS))}")
    missing = [k for k in _ROW_REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: {missing[0]} is required")
    values = {k: v for k, v in raw.items() if v is not None or k == "checkpoint_interval"}
    values.setdefault("checkpoint_interval", top["checkpoint_interval"])
    values.setdefault("checkpoint_cost_s", top["checkpoint_cost_s"])
    try:
        return BenchRow(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def iteration_overhead(row: BenchRow, profile: BenchProfile) -> float:
    """Per-iteration slowdown without the checkpoint and snapshot stalls of the bench run."""
    t_b = profile.iteration_time_s
    stalls = 0.0
    if row.checkpoint_interval is not None:
        stalls += row.checkpoint_cost_s / (row.checkpoint_interval * t_b)
    if row.snapshot_interval is not None:
        stalls += row.snapshot_cost_s / (row.snapshot_interval * t_b)
    # Noise can put the ratio a little above what the stalls alone allow; the model has no speed-ups.
    return max(0.0, 1.0 / row.throughput_ratio - 1.0 - stalls)


def strategy_from_row(
    row: BenchRow,
    profile: BenchProfile,
    *,
    base: StrategySpec | None = None,
    job_checkpoint_interval: int | None = None,
) -> StrategySpec:
    """The simulator's strategy for ``row`` (see the module docstring for each figure).

    Args:
        base: the YAML's strategy of the same name: its intervals are kept.
        job_checkpoint_interval: the YAML's global checkpoint interval, for a strategy only in
            the profile that took global checkpoints in the bench.
    """
    kind = row.kind
    assert kind is not None  # BenchRow fills it
    if base is not None and base.kind != kind:
        raise ConfigError(
            f"{profile.source}: strategy {row.name!r} is kind {kind} in the profile but {base.kind} "
            "in the YAML: rename one or give the row the YAML's kind"
        )
    overhead = iteration_overhead(row, profile)
    replay_iteration_s = profile.iteration_time_s * (1.0 + overhead)
    if base is not None:
        checkpoint_interval = base.checkpoint_interval
        snapshot_interval = base.snapshot_interval
    else:
        checkpoint_interval = (
            None if row.checkpoint_interval is None else (job_checkpoint_interval or row.checkpoint_interval)
        )
        snapshot_interval = row.snapshot_interval
    costs: dict[str, Any] = {
        "restart_s": row.init_s,
        "checkpoint_cost_s": row.checkpoint_cost_s,
        "iteration_overhead": overhead,
    }
    if kind in ("checkpoint", "snapshot"):
        derived = row.recovery_s - row.iterations_lost * replay_iteration_s
        costs["load_s"] = row.restore_s if row.restore_s is not None else max(0.0, derived)
    if kind == "snapshot":
        costs.update(snapshot_interval=snapshot_interval, snapshot_cost_s=row.snapshot_cost_s)
    elif kind == "replication":
        costs["broadcast_s"] = row.recovery_s
    elif kind == "elastic":
        costs.update(broadcast_s=row.recovery_s, shrunk_throughput=row.shrunk_throughput)
        if base is not None:
            costs.update(repair_s=base.repair_s, grow_s=base.grow_s)
    elif kind == "logging":
        restore = row.restore_s or 0.0
        costs["load_s"] = restore
        fraction = (row.recovery_s - restore) / (row.iterations_lost * replay_iteration_s)
        # A zero replay fraction is invalid in the model (and not physical): floor it at a tiny pace.
        costs["logging"] = LoggingSpec(replay_fraction=max(fraction, 1e-6))
    try:
        return StrategySpec(name=row.name, kind=kind, checkpoint_interval=checkpoint_interval, **costs)
    except ConfigError as exc:
        raise ConfigError(f"{profile.source}: strategies ({row.name}): {exc}") from None


def _apply_to_workload(wl: WorkloadConfig, profile: BenchProfile) -> WorkloadConfig:
    yaml_names = {s.name for s in wl.strategies}
    gc = next((s for s in wl.strategies if s.name == GLOBAL_CHECKPOINT), None)
    job_interval = gc.checkpoint_interval if gc is not None else None
    strategies: list[StrategySpec] = []
    for spec in wl.strategies:
        row = profile.row(spec.name)
        strategies.append(spec if row is None else strategy_from_row(row, profile, base=spec))
    for row in profile.strategies:
        if row.name not in yaml_names:
            strategies.append(strategy_from_row(row, profile, job_checkpoint_interval=job_interval))
    return replace(wl, strategies=tuple(strategies))


def apply_profile(cfg: SimConfig, profile: BenchProfile) -> SimConfig:
    """Every workload of ``cfg`` with the profile's strategies: a YAML strategy named in the
    profile takes its measured costs (keeping its intervals), the profile's other strategies
    are added after the YAML's, and YAML strategies the profile does not name stay as they are."""
    return replace(cfg, workloads=tuple(_apply_to_workload(wl, profile) for wl in cfg.workloads))
