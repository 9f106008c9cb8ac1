"""Cost model of one training job under failures: pure functions on plain data.

A job runs ``total_iterations`` iterations of ``iteration_time_s`` each. A failure hits at a
position ``x`` (in iterations, a float in ``[0, N)``) and a machine; the strategy decides what
the failure costs:

``fixed_s + t * (x - floor(x)) + replay_s_per_iteration * (floor(x) - restore(floor(x)))``

- ``fixed_s``: per-failure constant (``restart_s`` + whatever the strategy restores with:
  ``load_s``, ``undo_s``, ``broadcast_s``, ``logging.upload_s``);
- the in-flight iteration is redone at full speed by everyone (survivors undo it), as far as it got,
  except where PipeChurn's partial recomputation applies (``partial_recompute_window``: only the
  passes the failure lost, at any point of the iteration; :func:`inflight_redo_s`);
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

from dataclasses import dataclass

import numpy as np

from ds_swift.sim.inflight import passes_share
from ds_swift.sim.specs import COMMON_FIELDS, KIND_FIELDS, LoggingSpec, RecoveryKind, StrategySpec, Workload, spec_error

# The specs live in ds_swift.sim.specs; they stay importable from here, as do KIND_FIELDS and COMMON_FIELDS.
__all__ = [
    "COMMON_FIELDS",
    "KIND_FIELDS",
    "RecoveryKind",
    "LoggingSpec",
    "RecoveryPath",
    "StrategySpec",
    "expected_inflight_redo_s",
    "inflight_redo_s",
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
        raise spec_error(
            "logging.groups", list(sizes), f"group sizes must add up to the workload's {machines} machines"
        )
    kinds = spec.kinds if spec.kinds is not None else ("messages",) * len(sizes)
    if len(kinds) != len(sizes):
        raise spec_error("logging.kinds", list(kinds), f"one kind per group: {len(sizes)} group(s)")
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
        raise spec_error("machines", workload.machines, "at least 2 for kind elastic (one machine cannot shrink)")
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


def inflight_redo_s(workload: Workload, strategy: StrategySpec, fraction: np.ndarray) -> np.ndarray:
    """Seconds to get the in-flight iteration done again after a failure ``fraction`` of the way
    through it: ``t * fraction``. With PipeChurn's partial recomputation (``partial_recompute_window``
    set) only the passes the failure lost run again, back to back (their inputs are kept): the lost
    ranks' passes that had run, ``t * M / (M + p - 1)`` once every pass ran (the last ``window`` of
    the iteration is its reductions and step), in proportion before (ds_swift.sim.inflight)."""
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    lost = t * np.asarray(fraction, dtype=np.float64)
    window = strategy.partial_recompute_window
    if window is None:
        return lost
    passes_end = 1.0 - window  # every pass has run from here on
    ran = np.minimum(1.0, np.asarray(fraction, dtype=np.float64) / passes_end) if passes_end > 0 else 1.0
    return np.minimum(lost, t * passes_share(workload) * ran)


def expected_inflight_redo_s(workload: Workload, strategy: StrategySpec) -> float:
    """E[:func:`inflight_redo_s`] for a failure at a uniform point of the iteration (closed form)."""
    t = workload.iteration_time_s * (1.0 + strategy.iteration_overhead)
    window = strategy.partial_recompute_window
    if window is None:
        return 0.5 * t
    e = 1.0 - window  # the passes end here; the redo is x * min(1, r / e) before, min(x, r) after
    r = passes_share(workload)
    tail = 0.5 * (1.0 - e * e) if r >= 1.0 else (r * window if r <= e else 0.5 * (r * r - e * e) + r * (1.0 - r))
    return t * (0.5 * e * e * min(1.0, r / e) + tail)


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
    return strategy.fixed_s + expected_inflight_redo_s(workload, strategy) + replay


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
        index = np.minimum(
            np.searchsorted(edges, np.asarray(machine_u, dtype=np.float64), side="right"), len(paths) - 1
        )
        pace = np.array([p.replay_s_per_iteration for p in paths])[index]
    cost = strategy.fixed_s + inflight_redo_s(workload, strategy, inflight) + pace * (done - restore)
    if strategy.kind == "elastic":
        cost = cost + _shrunk_cost_s(workload, strategy, (n - x) * t)
    return cost
