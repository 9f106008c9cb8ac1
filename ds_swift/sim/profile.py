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

- ``kind`` from the row, or from its name (:data:`DEFAULT_KINDS`);
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
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, get_args

from ds_swift.config import ConfigError
from ds_swift.sim.model import LoggingSpec, RecoveryKind, StrategySpec
from ds_swift.sim.schema import SimConfig, WorkloadConfig

__all__ = ["DEFAULT_KINDS", "BenchProfile", "BenchRow", "apply_profile", "load_profile", "parse_profile",
           "strategy_from_row"]

#: the simulator's recovery model of each strategy name the bench knows; other names need "kind"
DEFAULT_KINDS: dict[str, RecoveryKind] = {
    "global_checkpoint": "checkpoint",
    "checkfreq": "snapshot",
    "elastic_horovod": "snapshot",
    # Everyone returns to the last erasure-coded in-memory checkpoint: no storage load.
    "pipechurn": "snapshot",
    "replication": "replication",
    "logging": "logging",
    # Only the failed stage re-applies logged updates, at a fraction of an iteration each.
    "tranlogs": "logging",
    # TranLogs' per-stage mix (ds-swift bench's logging_mix): each lost stage replays or re-applies.
    "logging_mix": "logging",
}


def _fail(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _number(name: str, value: Any, allowed: str = "a number >= 0 (seconds)", *, positive: bool = False) -> None:
    # bool is an int subclass, and json.loads accepts NaN: neither may pass as a cost.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, value, allowed)
    if value < 0 or (positive and value == 0):
        raise _fail(name, value, allowed)


def _integer(name: str, value: Any, minimum: int, allowed: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(name, value, allowed)


@dataclass(frozen=True)
class BenchRow:
    """One strategy's measurements in the bench."""

    name: str
    """Strategy name (``global_checkpoint``, ``checkfreq``, ``replication``, ``logging``,
    ``tranlogs``, ``pipechurn``, ...); the simulator's strategy of that name takes its costs."""

    throughput_ratio: float
    """Failure-free throughput over that of no fault tolerance, over the whole run (checkpoint
    and snapshot stalls included); <= 1 up to measurement noise."""

    init_s: float
    """Kill -> every rank ready to restore: detection, replacement start, rendezvous."""

    recovery_s: float
    """Ready to restore -> back at the iteration that was in flight at the kill (restore plus
    replay of the lost iterations; redoing the in-flight iteration itself is not included)."""

    iterations_lost: int
    """Completed iterations redone: from the restore point to the iteration in flight."""

    bytes_per_iteration: float
    """Bytes written to storage per iteration (checkpoints, snapshots, logs), averaged."""

    host_memory_per_rank: float
    """Host memory the strategy holds per rank, bytes."""

    exact: bool
    """The run with the failure ends bitwise equal to the failure-free run."""

    max_ulp: int | None = None
    """Largest parameter difference in units in the last place when not exact (0 or null when
    exact)."""

    final_loss_delta: float | None = None
    """Final loss minus the failure-free run's."""

    kind: RecoveryKind | None = None
    """The simulator's recovery model; ``None``: from the name (:data:`DEFAULT_KINDS`)."""

    restore_s: float | None = None
    """Part of ``recovery_s`` before the replay starts (load, undo, broadcast, log upload)."""

    checkpoint_interval: int | None = None
    """Iterations between global checkpoints in the bench run; ``None``: it took none. The
    loader fills it from the top level when the row does not set it."""

    checkpoint_cost_s: float = 0.0
    """Training stall per global checkpoint (the loader fills the top level's by default)."""

    snapshot_interval: int | None = None
    """Snapshot kinds only: iterations between snapshots in the bench run."""

    snapshot_cost_s: float = 0.0
    """Snapshot kinds only: training stall per snapshot."""

    shrunk_throughput: float | None = None
    """Kind elastic only: the shrunk job's throughput over the full job's (median steps after and
    before the failure)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _fail("name", self.name, "a non-empty strategy name such as global_checkpoint")
        if self.kind is None:
            if self.name not in DEFAULT_KINDS:
                raise _fail("kind", None, f"needed for strategy {self.name!r}: one of {', '.join(get_args(RecoveryKind))}")
            object.__setattr__(self, "kind", DEFAULT_KINDS[self.name])
        elif self.kind not in get_args(RecoveryKind):
            raise _fail("kind", self.kind, f"one of {', '.join(get_args(RecoveryKind))}")
        _number("throughput_ratio", self.throughput_ratio, "a positive number (strategy / no fault tolerance)",
                positive=True)
        if self.throughput_ratio > 1.1:
            raise _fail("throughput_ratio", self.throughput_ratio,
                        "the strategy's throughput over no fault tolerance's, <= 1 up to noise (inverted?)")
        for name in ("init_s", "recovery_s", "checkpoint_cost_s", "snapshot_cost_s"):
            _number(name, getattr(self, name))
        _integer("iterations_lost", self.iterations_lost, 0, "an integer >= 0 (completed iterations redone)")
        _number("bytes_per_iteration", self.bytes_per_iteration, "a number of bytes >= 0")
        _number("host_memory_per_rank", self.host_memory_per_rank, "a number of bytes >= 0")
        if not isinstance(self.exact, bool):
            raise _fail("exact", self.exact, "true or false (bitwise equal to the failure-free run)")
        _integer("max_ulp", self.max_ulp, 0, "an integer >= 0 or null", allow_none=True)
        if self.exact and self.max_ulp:
            raise _fail("max_ulp", self.max_ulp, "0 or null when exact is true")
        delta = self.final_loss_delta
        if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float))
                                  or not math.isfinite(delta)):
            raise _fail("final_loss_delta", delta, "a number or null")
        if self.restore_s is not None:
            _number("restore_s", self.restore_s)
            if self.restore_s > self.recovery_s:
                raise _fail("restore_s", self.restore_s, f"at most recovery_s={self.recovery_s} (it is part of it)")
        _integer("checkpoint_interval", self.checkpoint_interval, 1, "a positive integer or null (no checkpoints)",
                 allow_none=True)
        self._check_kind()

    def _check_kind(self) -> None:
        if self.kind == "snapshot":
            _integer("snapshot_interval", self.snapshot_interval, 1,
                     f"required for kind snapshot ({self.name}): iterations between snapshots in the bench")
        elif self.snapshot_interval is not None or self.snapshot_cost_s:
            raise ConfigError(f"snapshot_interval/snapshot_cost_s are only read by kind snapshot, not {self.kind}")
        if self.kind == "elastic":
            _number("shrunk_throughput", self.shrunk_throughput, "a fraction in (0, 1) (required for kind elastic)",
                    positive=True)
            if self.shrunk_throughput is not None and self.shrunk_throughput >= 1:
                raise _fail("shrunk_throughput", self.shrunk_throughput, "a fraction in (0, 1): the shrunk job's speed")
        elif self.shrunk_throughput is not None:
            raise ConfigError(f"shrunk_throughput is only read by kind elastic, not {self.kind}")
        if self.kind == "replication" and self.iterations_lost:
            raise _fail("iterations_lost", self.iterations_lost,
                        "0 for kind replication (it replays nothing); give kind checkpoint, snapshot or logging")
        if self.kind == "logging" and self.iterations_lost == 0:
            raise _fail("iterations_lost", 0, "> 0 for kind logging: inject the failure past a checkpoint so that "
                        "the replay pace is measured")


@dataclass(frozen=True)
class BenchProfile:
    """A whole bench profile."""

    iteration_time_s: float
    """Failure-free seconds per iteration of the bench job without fault tolerance."""

    checkpoint_interval: int | None
    """Iterations between global checkpoints in the bench run (rows may override)."""

    checkpoint_cost_s: float
    """Training stall per global checkpoint in the bench run (rows may override)."""

    strategies: tuple[BenchRow, ...]
    """One row per strategy, names unique."""

    source: str = "bench profile"
    """Where it was read from (starts every error message)."""

    def row(self, name: str) -> BenchRow | None:
        return next((r for r in self.strategies if r.name == name), None)


_TOP_REQUIRED = ("iteration_time_s", "checkpoint_interval", "checkpoint_cost_s", "strategies")
_ROW_FIELDS = frozenset(f.name for f in fields(BenchRow))
_ROW_REQUIRED = ("name", "throughput_ratio", "init_s", "recovery_s", "iterations_lost", "bytes_per_iteration",
                 "host_memory_per_rank", "exact")


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
        _integer("checkpoint_interval", data["checkpoint_interval"], 1, "a positive integer or null (no checkpoints)",
                 allow_none=True)
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
    return BenchProfile(float(data["iteration_time_s"]), data["checkpoint_interval"], float(data["checkpoint_cost_s"]),
                        tuple(rows), source)


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
    row: BenchRow, profile: BenchProfile, *, base: StrategySpec | None = None, job_checkpoint_interval: int | None = None
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
        raise ConfigError(f"{profile.source}: strategy {row.name!r} is kind {kind} in the profile but {base.kind} "
                          "in the YAML: rename one or give the row the YAML's kind")
    overhead = iteration_overhead(row, profile)
    replay_iteration_s = profile.iteration_time_s * (1.0 + overhead)
    if base is not None:
        checkpoint_interval = base.checkpoint_interval
        snapshot_interval = base.snapshot_interval
    else:
        checkpoint_interval = None if row.checkpoint_interval is None else (
            job_checkpoint_interval or row.checkpoint_interval)
        snapshot_interval = row.snapshot_interval
    costs: dict[str, Any] = {"restart_s": row.init_s, "checkpoint_cost_s": row.checkpoint_cost_s,
                             "iteration_overhead": overhead}
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
    gc = next((s for s in wl.strategies if s.name == "global_checkpoint"), None)
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
