"""What the cost model (:mod:`ds_swift.sim.model`) prices: a job (:class:`Workload`) and a strategy
(:class:`StrategySpec`, with :class:`LoggingSpec` for logging-based recovery), validated on
construction: each error names the field and what it accepts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ds_swift.config import ConfigError

__all__ = [
    "COMMON_FIELDS",
    "KIND_FIELDS",
    "LoggingSpec",
    "RecoveryKind",
    "StrategySpec",
    "Workload",
    "spec_error",
]

RecoveryKind = Literal["checkpoint", "snapshot", "replication", "logging", "elastic"]


def spec_error(name: str, value: Any, allowed: str) -> ConfigError:
    """The error for field ``name`` holding ``value``, saying what it accepts."""
    return ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check_number(name: str, value: Any, *, positive: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    allowed = ("a positive number" if positive else "a number >= 0") + (" or null" if allow_none else "")
    # bool is an int subclass: `restart_s: true` must not pass as 1 second.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise spec_error(name, value, allowed)
    if value < 0 or (positive and value == 0):
        raise spec_error(name, value, allowed)


def _check_int(name: str, value: Any, *, allow_none: bool = False, what: str = "") -> None:
    if value is None and allow_none:
        return
    allowed = "a positive integer" + (f" ({what})" if what else "") + (" or null" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise spec_error(name, value, allowed)


@dataclass(frozen=True)
class Workload:
    """One training job without failures."""

    name: str
    """Label used in tables, JSON and plots."""

    total_iterations: int
    """Iterations the job must complete."""

    iteration_time_s: float
    """Failure-free time of one iteration, seconds."""

    machines: int = 1
    """Machines in the job; selective-logging groups partition them."""

    pipeline_stages: int = 1
    """Pipeline stages, spread evenly over the machines (derives logging replay fractions)."""

    micro_batches: int = 1
    """Micro-batches per iteration (derives logging replay fractions)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise spec_error("name", self.name, "a non-empty string")
        _check_int("total_iterations", self.total_iterations)
        _check_number("iteration_time_s", self.iteration_time_s, positive=True)
        _check_int("machines", self.machines)
        _check_int("pipeline.stages", self.pipeline_stages)
        _check_int("pipeline.micro_batches", self.micro_batches)

    @property
    def compute_s(self) -> float:
        """Failure-free compute time (no checkpoint stalls), seconds."""
        return self.total_iterations * self.iteration_time_s


@dataclass(frozen=True)
class LoggingSpec:
    """Logging-based recovery (SWIFT section 5): how fast a failed group is replayed."""

    groups: tuple[int, ...] | None = None
    """Machines per selective-logging group (they partition the workload's machines). A
    failure of any machine in a group replays the whole group. ``None`` with no
    ``replay_fraction``: one group per machine."""

    replay_fraction: float | None = None
    """Measured time to replay one lost iteration of the failed group, as a fraction of the
    iteration time, without parallel recovery. ``None`` derives it from the pipeline shape:
    ``(m + k - 1) / (m + p - 1)`` for a group holding ``k`` of ``p`` stages with ``m``
    micro-batches (replay has no cross-group waits; optimistic, measure when you can)."""

    parallel_recovery: bool = False
    """Survivors share the replay (section 5.2)."""

    parallel_speedup: float | None = None
    """Replay speed-up of parallel recovery; ``None``: ``floor(machines / group size)``, the
    paper's ideal (section 5.3)."""

    parallel_setup_s: float = 0.0
    """Per failure, with parallel recovery: the helpers' copy engines built and the replacements'
    state sent to them before the replay starts (bench: the parallel row's recovery minus its
    replay and the sequential row's restore)."""

    parallel_exchange_s_per_iteration: float = 0.0
    """With parallel recovery: per replayed iteration, the two copies of a stage swap their
    micro-batches' gradients before the step (exact mode), on the replay's critical path."""

    upload_s: float = 0.0
    """Per failure: survivors flush and upload the log chunks the replacement needs."""

    download_s_per_iteration: float = 0.0
    """Time to fetch one iteration of the group's inbound logs; overlaps the replay."""

    kinds: tuple[str, ...] | None = None
    """What each group logs (TranLogs' per-stage mix and the worth-logging check, as the runtime
    decides them: ds_swift.plan.stage_logging): ``messages`` (replayed at the pace above),
    ``updates`` (its logged updates re-applied: ``apply_fraction`` of an iteration each, no
    recompute, no parallel speed-up) or ``none`` (logging did not pay there: a failure of it rolls
    everyone back to the checkpoint). One per group; ``None``: ``messages`` everywhere."""

    apply_fraction: float = 0.1
    """Time to re-apply one logged update (an optimizer step and reading the record), as a fraction
    of the iteration time (the figure the TranLogs strategy orders itself by; measure when you can)."""

    def __post_init__(self) -> None:
        if self.kinds is not None:
            if not isinstance(self.kinds, tuple) or any(k not in ("messages", "updates", "none") for k in self.kinds):
                raise spec_error("logging.kinds", self.kinds, "a list of messages, updates or none, one per group")
            if self.replay_fraction is not None:
                raise ConfigError("logging.kinds needs the groups (one kind per group), not a measured replay_fraction")
        _check_number("logging.apply_fraction", self.apply_fraction, positive=True)
        if self.groups is not None:
            if not isinstance(self.groups, tuple) or not self.groups:
                raise spec_error("logging.groups", self.groups, "a positive integer or a list of group sizes")
            for size in self.groups:
                _check_int("logging.groups", size, what="machines per group")
        _check_number("logging.replay_fraction", self.replay_fraction, positive=True, allow_none=True)
        if self.groups is not None and self.replay_fraction is not None:
            raise ConfigError(
                "logging.groups and logging.replay_fraction are both set: give replay_fraction (measured) "
                "or groups (replay derived from the workload's pipeline), not both"
            )
        if not isinstance(self.parallel_recovery, bool):
            raise spec_error("logging.parallel_recovery", self.parallel_recovery, "true or false")
        _check_number("logging.parallel_speedup", self.parallel_speedup, positive=True, allow_none=True)
        if self.parallel_speedup is not None and self.parallel_speedup < 1:
            raise spec_error("logging.parallel_speedup", self.parallel_speedup, "a number >= 1")
        _check_number("logging.upload_s", self.upload_s)
        _check_number("logging.parallel_setup_s", self.parallel_setup_s)
        _check_number("logging.parallel_exchange_s_per_iteration", self.parallel_exchange_s_per_iteration)
        _check_number("logging.download_s_per_iteration", self.download_s_per_iteration)


#: fields each kind reads (besides the common ones); others are rejected so typos show
KIND_FIELDS: dict[str, frozenset[str]] = {
    "checkpoint": frozenset({"load_s"}),
    "snapshot": frozenset({"snapshot_interval", "snapshot_cost_s", "load_s", "broadcast_s"}),
    "replication": frozenset({"undo_s", "broadcast_s"}),
    "logging": frozenset({"load_s", "undo_s", "logging"}),
    "elastic": frozenset({"undo_s", "broadcast_s", "repair_s", "grow_s", "shrunk_throughput"}),
}
COMMON_FIELDS = frozenset(
    {"kind", "checkpoint_interval", "checkpoint_cost_s", "restart_s", "iteration_overhead", "partial_recompute_window"}
)


@dataclass(frozen=True)
class StrategySpec:
    """A fault-tolerance strategy and its costs. Times in seconds, intervals in iterations."""

    name: str
    """Label (``global_checkpoint``, ``checkfreq``, ``elastic_horovod``, ``swift``, ...)."""

    kind: RecoveryKind
    """``checkpoint``: everyone reloads the last global checkpoint and recomputes;
    ``snapshot``: everyone restores the last snapshot (CheckFreq: from disk; Elastic Horovod: a
    survivor broadcasts its in-memory copy) and recomputes; ``replication``: survivors undo the
    in-flight update and a replica broadcasts the lost state; ``logging``: the failed group
    replays from the last checkpoint and the logs; ``elastic``: the job shrinks to the surviving
    machines and grows back when the failed one returns (see the module docstring)."""

    checkpoint_interval: int | None = None
    """Iterations between global checkpoints; ``None``: never."""

    checkpoint_cost_s: float = 0.0
    """Training stall per global checkpoint."""

    snapshot_interval: int | None = None
    """``snapshot`` only: iterations between snapshots."""

    snapshot_cost_s: float = 0.0
    """``snapshot`` only: training stall (and slowdown) per snapshot."""

    restart_s: float = 0.0
    """Per failure: detection, replacement start and rendezvous (the paper's initialization)."""

    load_s: float = 0.0
    """Per failure: loading the checkpoint or snapshot."""

    undo_s: float = 0.0
    """Per failure: survivors undo the in-flight update (update-undo, section 4)."""

    broadcast_s: float = 0.0
    """Per failure: broadcasting state from a replica (or an in-memory snapshot)."""

    iteration_overhead: float = 0.0
    """Failure-free slowdown of every iteration, as a fraction (e.g. 0.02 for logging)."""

    logging: LoggingSpec | None = None
    """``logging`` only: replay model."""

    repair_s: float | None = None
    """``elastic`` only: failure -> the machine is back and the job grows back; ``None``: it does
    not come back (the rest of the job runs shrunk)."""

    grow_s: float = 0.0
    """``elastic`` only: the pause to grow back (rendezvous, rebuild, resharding), per failure."""

    shrunk_throughput: float | None = None
    """``elastic`` only: throughput while shrunk, as a fraction of the full job's; ``None``:
    ``(machines - 1) / machines``."""

    partial_recompute_window: float | None = None
    """PipeChurn's partial recomputation (ds_swift.sim.inflight): the share of an iteration after its
    last backward pass (gradient reductions and the step). A failure anywhere in the iteration redoes
    only the passes it lost, back to back (their inputs are kept): after the last pass the lost
    ranks' passes, ``M / (M + p - 1)`` of an iteration; before it, the share of those that had run.
    ``None``: the in-flight iteration is redone as far as it got."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise spec_error("name", self.name, "a non-empty string")
        if self.kind not in get_args(RecoveryKind):
            raise spec_error("kind", self.kind, f"one of {', '.join(get_args(RecoveryKind))}")
        _check_int("checkpoint_interval", self.checkpoint_interval, allow_none=True, what="iterations")
        for name in (
            "checkpoint_cost_s",
            "snapshot_cost_s",
            "restart_s",
            "load_s",
            "undo_s",
            "broadcast_s",
            "iteration_overhead",
        ):
            _check_number(name, getattr(self, name))
        if self.kind == "snapshot":
            if self.snapshot_interval is None:
                raise spec_error("snapshot_interval", None, "required for kind snapshot: iterations between snapshots")
            _check_int("snapshot_interval", self.snapshot_interval, what="iterations")
        elif self.snapshot_interval is not None or self.snapshot_cost_s:
            raise ConfigError(f"snapshot_interval/snapshot_cost_s are only read by kind snapshot, not {self.kind}")
        if self.kind == "logging":
            if self.logging is None:
                object.__setattr__(self, "logging", LoggingSpec())
        elif self.logging is not None:
            raise ConfigError(f"logging is only read by kind logging, not {self.kind}")
        if self.kind == "elastic":
            _check_number("repair_s", self.repair_s, allow_none=True)
            _check_number("grow_s", self.grow_s)
            _check_number("shrunk_throughput", self.shrunk_throughput, positive=True, allow_none=True)
            if self.shrunk_throughput is not None and self.shrunk_throughput >= 1:
                raise spec_error(
                    "shrunk_throughput", self.shrunk_throughput, "a fraction in (0, 1): the shrunk job's speed"
                )
        elif self.repair_s is not None or self.grow_s or self.shrunk_throughput is not None:
            raise ConfigError(f"repair_s/grow_s/shrunk_throughput are only read by kind elastic, not {self.kind}")
        _check_number("partial_recompute_window", self.partial_recompute_window, allow_none=True)
        if self.partial_recompute_window is not None and self.partial_recompute_window >= 1:
            raise spec_error(
                "partial_recompute_window",
                self.partial_recompute_window,
                "a fraction in [0, 1) of an iteration (its reductions and step)",
            )

    @property
    def fixed_s(self) -> float:
        """Per-failure constant cost."""
        reads = KIND_FIELDS[self.kind]
        total = self.restart_s
        # Only what the kind reads: a stray load_s on a replication spec must not count.
        for name in ("load_s", "undo_s", "broadcast_s"):
            if name in reads:
                total += getattr(self, name)
        if self.logging is not None:
            total += self.logging.upload_s
            if self.logging.parallel_recovery:
                total += self.logging.parallel_setup_s
        return total
