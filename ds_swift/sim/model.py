"""Cost model of one training job under failures: pure functions on plain data.

A job runs ``total_iterations`` iterations of ``iteration_time_s`` each. A failure hits at a
position ``x`` (in iterations, a float in ``[0, N)``) and a machine; the strategy decides what
the failure costs:

``fixed_s + t * (x - floor(x)) + replay_s_per_iteration * (floor(x) - restore(floor(x)))``

- ``fixed_s``: per-failure constant (``restart_s`` + whatever the strategy restores with:
  ``load_s``, ``undo_s``, ``broadcast_s``, ``logging.upload_s``);
- the in-flight iteration is always redone at full speed by everyone (survivors undo it);
- the completed iterations since the last restore point are replayed at the strategy's pace:
  the full iteration time for ``checkpoint`` and ``snapshot`` (everyone rolls back), nothing
  for ``replication`` (a replica holds them), and the failed machine group's share for
  ``logging`` (a failure replays its whole selective-logging group, optionally spread over
  the survivors by parallel recovery; log download overlaps the replay, so the slower of the
  two sets the pace; a group logging its updates re-applies them instead, and a group where
  logging did not pay rolls everyone back: ``LoggingSpec.kinds``).

``elastic`` (lossy forward with an elastic shrink: no spare, the job goes on without the failed
machine until it comes back) replays nothing, but runs at ``f`` = ``shrunk_throughput`` of its
speed meanwhile: with ``W`` seconds of compute left at the failure and the machine back after
``repair_s``, the failure costs ``(1 - f) * repair_s + grow_s`` (the work not done while shrunk is
done later at full speed, plus the pause to grow back) if the job is still running then
(``f * repair_s < W``), else ``W * (1/f - 1)`` (the rest of the job shrunk). ``f`` defaults to
``(machines - 1) / machines``: the failed machine's data-parallel replicas are gone. The result is
approximate (lossy forward), which the time model does not price.

Restore points are multiples of ``checkpoint_interval`` (and ``snapshot_interval`` for
``snapshot``), and iteration 0. The failure-free time is the compute time plus one stall per
checkpoint and per snapshot; failures add their costs. The time spent recovering is not itself
exposed to failures: a first-order model, as in SWIFT section 7.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from ds_swift.config import ConfigError

__all__ = [
    "RecoveryKind",
    "LoggingSpec",
    "RecoveryPath",
    "StrategySpec",
    "Workload",
    "expected_failure_cost_s",
    "expected_replay_iterations",
    "failure_costs_s",
    "failure_free_s",
    "interval_field",
    "recovery_paths",
    "restore_intervals",
    "shrunk_throughput",
]

RecoveryKind = Literal["checkpoint", "snapshot", "replication", "logging", "elastic"]


def _err(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid: {allowed}")


def _check_number(name: str, value: Any, *, positive: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    allowed = ("a positive number" if positive else "a number >= 0") + (" or null" if allow_none else "")
    # bool is an int subclass: `restart_s: true` must not pass as 1 second.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _err(name, value, allowed)
    if value < 0 or (positive and value == 0):
        raise _err(name, value, allowed)


def _check_int(name: str, value: Any, *, allow_none: bool = False, what: str = "") -> None:
    if value is None and allow_none:
        return
    allowed = "a positive integer" + (f" ({what})" if what else "") + (" or null" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _err(name, value, allowed)


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
            raise _err("name", self.name, "a non-empty string")
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
                raise _err("logging.kinds", self.kinds, "a list of messages, updates or none, one per group")
            if self.replay_fraction is not None:
                raise ConfigError("logging.kinds needs the groups (one kind per group), not a measured replay_fraction")
        _check_number("logging.apply_fraction", self.apply_fraction, positive=True)
        if self.groups is not None:
            if not isinstance(self.groups, tuple) or not self.groups:
                raise _err("logging.groups", self.groups, "a positive integer or a list of group sizes")
            for size in self.groups:
                _check_int("logging.groups", size, what="machines per group")
        _check_number("logging.replay_fraction", self.replay_fraction, positive=True, allow_none=True)
        if self.groups is not None and self.replay_fraction is not None:
            raise ConfigError(
                "logging.groups and logging.replay_fraction are both set: give replay_fraction (measured) "
                "or groups (replay derived from the workload's pipeline), not both"
            )
        if not isinstance(self.parallel_recovery, bool):
            raise _err("logging.parallel_recovery", self.parallel_recovery, "true or false")
        _check_number("logging.parallel_speedup", self.parallel_speedup, positive=True, allow_none=True)
        if self.parallel_speedup is not None and self.parallel_speedup < 1:
            raise _err("logging.parallel_speedup", self.parallel_speedup, "a number >= 1")
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
COMMON_FIELDS = frozenset({"kind", "checkpoint_interval", "checkpoint_cost_s", "restart_s", "iteration_overhead"})


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _err("name", self.name, "a non-empty string")
        if self.kind not in get_args(RecoveryKind):
            raise _err("kind", self.kind, f"one of {', '.join(get_args(RecoveryKind))}")
        _check_int("checkpoint_interval", self.checkpoint_interval, allow_none=True, what="iterations")
        for name in ("checkpoint_cost_s", "snapshot_cost_s", "restart_s", "load_s", "undo_s", "broadcast_s",
                     "iteration_overhead"):
            _check_number(name, getattr(self, name))
        if self.kind == "snapshot":
            if self.snapshot_interval is None:
                raise _err("snapshot_interval", None, "required for kind snapshot: iterations between snapshots")
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
                raise _err("shrunk_throughput", self.shrunk_throughput, "a fraction in (0, 1): the shrunk job's speed")
        elif self.repair_s is not None or self.grow_s or self.shrunk_throughput is not None:
            raise ConfigError(f"repair_s/grow_s/shrunk_throughput are only read by kind elastic, not {self.kind}")

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


def interval_field(strategy: StrategySpec) -> str | None:
    """The interval that trades failure-free stalls against rework, or ``None`` (replication:
    recovery does not depend on it, so fewer checkpoints are always cheaper)."""
    if strategy.kind == "snapshot":
        return "snapshot_interval"
    if strategy.kind in ("checkpoint", "logging"):
        return "checkpoint_interval"
    return None


def restore_intervals(strategy: StrategySpec) -> tuple[int, ...]:
    """Intervals whose multiples are restore points (iteration 0 always is one)."""
    out: list[int] = []
    if strategy.checkpoint_interval is not None:
        out.append(strategy.checkpoint_interval)
    if strategy.kind == "snapshot" and strategy.snapshot_interval is not None:
        out.append(strategy.snapshot_interval)
    return tuple(out)


def failure_free_s(workload: Workload, strategy: StrategySpec) -> float:
    """Compute time (with the strategy's slowdown) plus every checkpoint and snapshot stall."""
    n = workload.total_iterations
    total = n * workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    if strategy.checkpoint_interval is not None:
        total += (n // strategy.checkpoint_interval) * strategy.checkpoint_cost_s
    if strategy.kind == "snapshot" and strategy.snapshot_interval is not None:
        total += (n // strategy.snapshot_interval) * strategy.snapshot_cost_s
    return total


@dataclass(frozen=True)
class RecoveryPath:
    """What a failure costs when it hits a given share of the machines."""

    weight: float
    """Probability that a failure takes this path (machines in the group / all machines)."""

    replay_s_per_iteration: float
    """Cost of one completed-but-lost iteration."""


def recovery_paths(workload: Workload, strategy: StrategySpec) -> tuple[RecoveryPath, ...]:
    """Per-failure replay pace, per machine group the failure can hit."""
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    if strategy.kind in ("checkpoint", "snapshot"):
        return (RecoveryPath(1.0, t),)
    if strategy.kind in ("replication", "elastic"):
        return (RecoveryPath(1.0, 0.0),)
    spec = strategy.logging
    assert spec is not None  # __post_init__ fills it for kind logging
    m, p, machines = workload.micro_batches, workload.pipeline_stages, workload.machines
    # Parallel recovery adds the copies' gradient swap to every replayed iteration.
    exchange = spec.parallel_exchange_s_per_iteration if spec.parallel_recovery else 0.0
    if spec.replay_fraction is not None:
        speed = (spec.parallel_speedup or 1.0) if spec.parallel_recovery else 1.0
        # A measured fraction describes the configured group; the group sizes do not matter.
        return (RecoveryPath(1.0, max(t * spec.replay_fraction / speed + exchange, spec.download_s_per_iteration)),)
    sizes = spec.groups if spec.groups is not None else (1,) * machines
    if sum(sizes) != machines:
        raise _err("logging.groups", list(sizes), f"group sizes must add up to the workload's {machines} machines")
    kinds = spec.kinds if spec.kinds is not None else ("messages",) * len(sizes)
    if len(kinds) != len(sizes):
        raise _err("logging.kinds", list(kinds), f"one kind per group: {len(sizes)} group(s)")
    paths = []
    for size, kind in zip(sizes, kinds, strict=True):
        if kind == "updates":  # the lost ranks re-apply their logged updates: no recompute
            paths.append(RecoveryPath(size / machines, max(t * spec.apply_fraction, spec.download_s_per_iteration)))
            continue
        if kind == "none":  # logging did not pay there: everyone rolls back to the checkpoint
            paths.append(RecoveryPath(size / machines, t))
            continue
        # Stages sit evenly on machines; a group of `size` machines holds this many of them.
        k = max(1.0, p * size / machines)
        fraction = (m + k - 1.0) / (m + p - 1.0)
        speed = 1.0
        if spec.parallel_recovery:
            speed = spec.parallel_speedup if spec.parallel_speedup is not None else float(max(1, machines // size))
        paths.append(RecoveryPath(size / machines, max(t * fraction / speed + exchange, spec.download_s_per_iteration)))
    return tuple(paths)


def shrunk_throughput(workload: Workload, strategy: StrategySpec) -> float:
    """``elastic``: the shrunk job's throughput fraction (given, or ``(machines - 1) / machines``)."""
    if strategy.shrunk_throughput is not None:
        return strategy.shrunk_throughput
    if workload.machines < 2:
        raise _err("machines", workload.machines, "at least 2 for kind elastic (one machine cannot shrink)")
    return (workload.machines - 1) / workload.machines


def _shrunk_cost_s(workload: Workload, strategy: StrategySpec, remaining_s: np.ndarray) -> np.ndarray:
    """``elastic``: what running without the failed machine costs, per failure with ``remaining_s``
    of compute left (see the module docstring)."""
    f = shrunk_throughput(workload, strategy)
    rest_shrunk = remaining_s * (1.0 / f - 1.0)
    if strategy.repair_s is None:
        return rest_shrunk
    return np.where(f * strategy.repair_s < remaining_s, (1.0 - f) * strategy.repair_s + strategy.grow_s, rest_shrunk)


def _restore_points(total_iterations: int, intervals: tuple[int, ...]) -> np.ndarray:
    points = [np.zeros(1, dtype=np.int64)]
    for step in intervals:
        points.append(np.arange(step, total_iterations, step, dtype=np.int64))
    return np.unique(np.concatenate(points))


def expected_replay_iterations(total_iterations: int, intervals: tuple[int, ...]) -> float:
    """E[floor(x) - restore(floor(x))] for x uniform in [0, N): completed iterations lost.

    With restore points r_0 = 0 < r_1 < ... splitting [0, N) into segments of length L_i, an
    iteration uniform in {0..N-1} lands in segment i with probability L_i / N and is then
    uniform in {0..L_i-1} past its start: E = sum L_i (L_i - 1) / 2 / N. Exact, O(#points).
    """
    n = total_iterations
    if not intervals or min(intervals) >= n:
        return (n - 1) / 2.0
    if len(intervals) == 1:
        # q full segments of length tau and a last one of length r: the closed form of the sum.
        tau = intervals[0]
        q, r = divmod(n, tau)
        return (q * tau * (tau - 1) + r * (r - 1)) / 2.0 / n
    points = _restore_points(total_iterations, intervals)
    lengths = np.diff(np.append(points, total_iterations)).astype(np.float64)
    return float(np.sum(lengths * (lengths - 1.0)) / 2.0 / total_iterations)


def expected_failure_cost_s(workload: Workload, strategy: StrategySpec) -> float:
    """Expected cost of one failure at a uniformly random position and machine."""
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    paths = recovery_paths(workload, strategy)
    pace = sum(p.weight * p.replay_s_per_iteration for p in paths)
    replay = 0.0
    if pace > 0.0:
        replay = pace * expected_replay_iterations(workload.total_iterations, restore_intervals(strategy))
    if strategy.kind == "elastic":
        replay += _expected_shrunk_cost_s(workload, strategy, workload.total_iterations * t)
    return strategy.fixed_s + 0.5 * t + replay


def _expected_shrunk_cost_s(workload: Workload, strategy: StrategySpec, total_s: float) -> float:
    """E[_shrunk_cost_s] for compute left uniform in (0, total_s] (a failure at a uniform position)."""
    f = shrunk_throughput(workload, strategy)
    if strategy.repair_s is None or f * strategy.repair_s >= total_s:
        return 0.5 * total_s * (1.0 / f - 1.0)
    edge = f * strategy.repair_s  # below: the rest of the job shrunk; above: shrunk for repair_s, then grown
    short = 0.5 * edge * edge * (1.0 / f - 1.0)
    return (short + (total_s - edge) * ((1.0 - f) * strategy.repair_s + strategy.grow_s)) / total_s


def failure_costs_s(
    workload: Workload, strategy: StrategySpec, positions: np.ndarray, machine_u: np.ndarray
) -> np.ndarray:
    """Cost of each failure, seconds.

    Args:
        positions: failure positions as fractions of the job, in [0, 1).
        machine_u: one uniform in [0, 1) per failure, choosing the machine (group) it hits.
    """
    n = workload.total_iterations
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    x = np.minimum(np.asarray(positions, dtype=np.float64) * n, np.nextafter(float(n), 0.0))
    done = np.floor(x)
    inflight = x - done
    intervals = restore_intervals(strategy)
    restore = np.zeros_like(done)
    for step in intervals:
        restore = np.maximum(restore, np.floor(done / step) * step)
    paths = recovery_paths(workload, strategy)
    if len(paths) == 1:
        pace = np.full_like(done, paths[0].replay_s_per_iteration)
    else:
        edges = np.cumsum([p.weight for p in paths])
        index = np.minimum(np.searchsorted(edges, np.asarray(machine_u, dtype=np.float64), side="right"),
                           len(paths) - 1)
        pace = np.array([p.replay_s_per_iteration for p in paths])[index]
    cost = strategy.fixed_s + t * inflight + pace * (done - restore)
    if strategy.kind == "elastic":
        cost = cost + _shrunk_cost_s(workload, strategy, (n - x) * t)
    return cost
