"""A bench profile's rows, validated field by field (the format: :mod:`ds_swift.sim.profile`).

:class:`BenchRow` is one strategy's measurements in the bench, :class:`BenchProfile` the whole
file; :func:`ds_swift.sim.profile.parse_profile` builds them and
:func:`ds_swift.sim.profile.strategy_from_row` turns a row into the simulator's cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.recovery.registry import declared_by
from ds_swift.sim.model import RecoveryKind

__all__ = ["OTHER_SYSTEMS", "BenchProfile", "BenchRow", "default_kind"]


#: the simulator's recovery model of systems it knows by name that are no ds-swift strategy
OTHER_SYSTEMS: dict[str, RecoveryKind] = {"elastic_horovod": "snapshot"}


def default_kind(name: str) -> RecoveryKind | None:
    """The simulator's recovery model of a row named after a registered strategy or a bench variant one
    declares (the strategy's services' ``sim_kind``), or after one of :data:`OTHER_SYSTEMS`; None: the
    row must give its ``kind``. Loads the registered strategies (and with them torch) the first time a
    row without ``kind`` names one: ``ds-swift bench`` writes ``kind`` on every row."""
    if name in OTHER_SYSTEMS:
        return OTHER_SYSTEMS[name]
    strategy = declared_by(name)
    return strategy.services(SwiftConfig()).sim_kind if strategy is not None else None


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
    """The simulator's recovery model; ``None``: from the name (:func:`default_kind`)."""

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
            kind = default_kind(self.name)
            if kind is None:
                raise _fail(
                    "kind", None, f"needed for strategy {self.name!r}: one of {', '.join(get_args(RecoveryKind))}"
                )
            object.__setattr__(self, "kind", kind)
        elif self.kind not in get_args(RecoveryKind):
            raise _fail("kind", self.kind, f"one of {', '.join(get_args(RecoveryKind))}")
        _number(
            "throughput_ratio",
            self.throughput_ratio,
            "a positive number (strategy / no fault tolerance)",
            positive=True,
        )
        if self.throughput_ratio > 1.1:
            raise _fail(
                "throughput_ratio",
                self.throughput_ratio,
                "the strategy's throughput over no fault tolerance's, <= 1 up to noise (inverted?)",
            )
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
        if delta is not None and (
            isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta)
        ):
            raise _fail("final_loss_delta", delta, "a number or null")
        if self.restore_s is not None:
            _number("restore_s", self.restore_s)
            if self.restore_s > self.recovery_s:
                raise _fail("restore_s", self.restore_s, f"at most recovery_s={self.recovery_s} (it is part of it)")
        _integer(
            "checkpoint_interval",
            self.checkpoint_interval,
            1,
            "a positive integer or null (no checkpoints)",
            allow_none=True,
        )
        self._check_kind()

    def _check_kind(self) -> None:
        if self.kind == "snapshot":
            _integer(
                "snapshot_interval",
                self.snapshot_interval,
                1,
                f"required for kind snapshot ({self.name}): iterations between snapshots in the bench",
            )
        elif self.snapshot_interval is not None or self.snapshot_cost_s:
            raise ConfigError(f"snapshot_interval/snapshot_cost_s are only read by kind snapshot, not {self.kind}")
        if self.kind == "elastic":
            _number(
                "shrunk_throughput",
                self.shrunk_throughput,
                "a fraction in (0, 1) (required for kind elastic)",
                positive=True,
            )
            if self.shrunk_throughput is not None and self.shrunk_throughput >= 1:
                raise _fail("shrunk_throughput", self.shrunk_throughput, "a fraction in (0, 1): the shrunk job's speed")
        elif self.shrunk_throughput is not None:
            raise ConfigError(f"shrunk_throughput is only read by kind elastic, not {self.kind}")
        if self.kind == "replication" and self.iterations_lost:
            raise _fail(
                "iterations_lost",
                self.iterations_lost,
                "0 for kind replication (it replays nothing); give kind checkpoint, snapshot or logging",
            )
        if self.kind == "logging" and self.iterations_lost == 0:
            raise _fail(
                "iterations_lost",
                0,
                "> 0 for kind logging: inject the failure past a checkpoint so that the replay pace is measured",
            )


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
