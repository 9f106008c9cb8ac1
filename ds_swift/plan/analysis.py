"""Topology analysis: what ds-swift does for a 3D-parallel plan, decided before the job starts.

Pure functions on data (no process group): given a :class:`~ds_swift.plan.layout.ParallelLayout`
and optionally the model shape (:class:`~ds_swift.plan.sizes.ModelShape`) or the sizes a running
engine measured (:class:`~ds_swift.plan.sizes.MeasuredSizes`), :func:`analyze` returns a
:class:`Plan`:

- the machine of every rank, and per pipeline stage a strategy (SWIFT section 3): a stage
  whose every rank has a data-parallel replica on another machine recovers by *replication*;
  else, with pipeline parallelism, by *logging* (if worth it, section 5.4); else from the
  global *checkpoint* only;
- the machine groups of selective logging (section 5.3) and the pipeline sends that cross a
  group boundary, which are logged by their sender, with their bytes per iteration;
- the "worth logging" verdict of section 5.4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.buddy_cost import copies_stand_in
from ds_swift.plan.grouping import Grouping
from ds_swift.plan.layout import ParallelLayout, positive_float, positive_int
from ds_swift.plan.machine_groups import UnitChain, choose_groups
from ds_swift.plan.sizes import (
    GB,
    Edge,
    MeasuredSizes,
    ModelShape,
    Sizing,
    bubble_ratio,
    pipeline_edges,
    sender_bytes,
    stage_times,
    worth_logging,
)
from ds_swift.recovery.registry import services_of, strategy_names

__all__ = ["STAGE_MODES", "Plan", "StageStrategy", "analyze", "analyze_config", "stage_mode"]

StageStrategy = Literal["replication", "logging", "checkpoint"]
#: What the analyzer plans per stage: ``auto`` picks each stage's recovery, the others force one
#: everywhere (a strategy's services give its mode: :func:`stage_mode`).
STAGE_MODES = ("auto", "replication", "logging", "checkpoint")


@dataclass(frozen=True)
class Plan:
    """What ds-swift does for one layout. Build it with :func:`analyze`."""

    layout: ParallelLayout
    shape: ModelShape | None
    strategy: str
    """The registered strategy the plan is for (ds_swift.recovery.registry's name: ``auto``,
    ``buddy``, ``scar``...)."""
    mode: str
    """What its services let the analyzer plan per stage (one of :data:`STAGE_MODES`)."""
    stage_strategy: dict[int, StageStrategy]
    groups: list[list[int]]
    """Machine ids of each selective-logging group, in pipeline order."""
    logged_edges: list[Edge]
    worth_logging: tuple[bool, str]
    bubble_ratio: float | None
    grouping_method: str
    """``every-machine`` (no grouping), ``balanced`` (``groups=K``) or ``exact`` (budget)."""
    expected_recovery: float
    """The grouping objective of section 5.3, in ``recovery_units``."""
    recovery_units: str
    """``s`` when stage compute times were given or derived, else ``stage-iterations``."""
    candidate_log_bytes_per_iteration: int
    """What the grouping would log, before an ``auto`` "not worth it" verdict drops it."""
    greedy: Grouping | None = None
    exact: Grouping | None = None
    notes: tuple[str, ...] = ()
    measured: MeasuredSizes | None = None
    """The sizes a running engine measured (instead of ``shape``)."""
    min_budget_gb: float | None = None
    """Set when ``storage_budget_gb`` cannot be met (no grouping that logs fits it): the
    smallest budget that logs something, in GB."""
    stage_log_kind: dict[int, str] = field(default_factory=dict)
    """What each stage recovered by logging logs, once a running engine has decided
    (ds_swift.plan.stage_logging): ``messages`` or ``updates``; empty: messages everywhere."""
    _logged_pairs: frozenset[tuple[int, int]] = field(init=False, repr=False, compare=False)
    _group_of: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_logged_pairs", frozenset((e.src_rank, e.dst_rank) for e in self.logged_edges))
        object.__setattr__(self, "_group_of", {m: i for i, g in enumerate(self.groups) for m in g})

    def machine_of(self, rank: int) -> int:
        return self.layout.machine_of(rank)

    @property
    def sized(self) -> bool:
        """The sends' bytes are known (a model shape or measured sizes)."""
        return self.shape is not None or self.measured is not None

    def group_of_machine(self, machine: int) -> int:
        try:
            return self._group_of[machine]
        except KeyError:
            raise ValueError(f"machine {machine} is outside 0..{self.layout.num_machines - 1}") from None

    def is_logged(self, src_rank: int, dst_rank: int) -> bool:
        """Whether the pipeline send ``src_rank -> dst_rank`` crosses a group boundary and is logged."""
        return (src_rank, dst_rank) in self._logged_pairs

    @property
    def update_stages(self) -> frozenset[int]:
        """The stages recovered by logging that log their updates (TranLogs), not their inbound messages."""
        return frozenset(s for s, k in self.stage_log_kind.items() if k == "updates")

    @property
    def replay_stages(self) -> frozenset[int]:
        """The stages recovered by logging that replay their inbound messages."""
        return frozenset(s for s, v in self.stage_strategy.items() if v == "logging") - self.update_stages

    @property
    def log_bytes_per_iteration(self) -> int:
        return sum(e.bytes_per_iteration for e in self.logged_edges)

    def sender_bytes_per_iteration(self) -> dict[int, int]:
        """Logged bytes per iteration of each sending rank (the sender copies what it sends)."""
        return sender_bytes(self.logged_edges)

    def boundaries(self) -> list[dict[str, Any]]:
        """Logged bytes per iteration across each boundary between consecutive groups."""
        out: dict[tuple[int, int], int] = {}
        for e in self.logged_edges:
            a, b = sorted(
                (self.group_of_machine(self.machine_of(e.src_rank)), self.group_of_machine(self.machine_of(e.dst_rank)))
            )
            out[(a, b)] = out.get((a, b), 0) + e.bytes_per_iteration
        return [{"groups": [a, b], "bytes_per_iteration": v} for (a, b), v in sorted(out.items())]

    def to_json(self) -> dict[str, Any]:
        lay, known = self.layout, self.sized
        stages = [
            {
                "stage": s,
                "strategy": self.stage_strategy[s],
                "ranks": ranks,
                "machines": sorted({r // lay.gpus_per_node for r in ranks}),
            }
            for s, ranks in ((s, lay.stage_ranks(s)) for s in range(lay.pp))
        ]
        shape = (
            None
            if self.shape is None
            else {**dataclasses.asdict(self.shape), "message_bytes": self.shape.message_bytes}
        )
        found = {
            name: {
                "groups": len(g.groups),
                "expected_recovery": g.recovery_time,
                "log_bytes_per_interval": g.storage,
                "optimal": g.optimal,
            }
            for name, g in (("greedy", self.greedy), ("exact", self.exact))
            if g is not None
        }
        log = self.log_bytes_per_iteration
        return {
            "layout": lay.to_json(),
            "shape": shape,
            "measured": self.measured.to_json() if self.measured is not None else None,
            "strategy": self.strategy,
            "mode": self.mode,
            "stages": stages,
            "groups": self.groups,
            "machine_of_rank": [r // lay.gpus_per_node for r in range(lay.world_size)],
            # bytes are unknown (None), not zero, without a model shape
            "log_bytes_per_iteration": log if known else None,
            "log_gb_per_iteration": round(log / GB, 2) if known else None,
            "candidate_log_bytes_per_iteration": self.candidate_log_bytes_per_iteration if known else None,
            "max_sender_bytes_per_iteration": max(self.sender_bytes_per_iteration().values(), default=0)
            if known
            else None,
            "logged_edges": len(self.logged_edges),
            "boundaries": self.boundaries(),
            "bubble_ratio": self.bubble_ratio,
            "worth_logging": {"value": self.worth_logging[0], "reason": self.worth_logging[1]},
            "grouping": {
                "method": self.grouping_method,
                "expected_recovery": self.expected_recovery,
                "recovery_units": self.recovery_units,
                **found,
            },
            "notes": list(self.notes),
            "min_budget_gb": self.min_budget_gb,
            "stage_log_kind": {str(k): v for k, v in sorted(self.stage_log_kind.items())},
        }


def _nothing_to_log(layout: ParallelLayout) -> ConfigError:
    return ConfigError(
        "swift config: strategy='logging' is impossible: no pipeline send crosses a machine boundary "
        f"(pp {layout.pp}, rank order {layout.order}, {layout.gpus_per_node} ranks per machine: each replica's "
        "stages share a machine, so a lost stage loses its neighbours too); use strategy auto or replication, "
        "or a rank order that puts pipeline stages on different machines (machines.rank_order)"
    )


def analyze(
    layout: ParallelLayout,
    shape: ModelShape | None = None,
    strategy: str = "auto",
    groups: int | None = None,
    storage_budget_gb: float | None = None,
    iteration_time_s: float | None = None,
    pcie_gbps: float | None = None,
    checkpoint_interval: int | None = None,
    stage_compute_s: float | Sequence[float] | None = None,
    *,
    network_gbps: float | None = None,
    parallel_recovery: bool = False,
    measured: MeasuredSizes | None = None,
    partition_copies: bool = False,
    mode: str | None = None,
) -> Plan:
    """Plan recovery for ``layout``.

    Args:
        layout: the 3D plan and its machines.
        shape: model shape; without it message sizes (and bytes) are unknown (0).
        strategy: the registered strategy planned for; its services say what a stage may recover by.
        groups: force this many balanced machine groups (selective logging).
        storage_budget_gb: instead of ``groups``, the log budget between checkpoints (GB; ds_swift.plan.grouping_exact).
        iteration_time_s: failure-free iteration time, for the bubble check of section 5.4.
        pcie_gbps: device-to-host bandwidth in GB/s (1e9 bytes/s), for the same check.
        checkpoint_interval: iterations between global checkpoints (needed with a budget).
        stage_compute_s: compute time per iteration of each stage (one number or one per
            stage) for the grouping objective; derived from ``iteration_time_s`` if absent.
        network_gbps: inter-machine bandwidth in GB/s for the ``M/B`` term (ignored if None).
        parallel_recovery: survivors share a failed group's replay (section 5.2).
        measured: instead of ``shape``, each send's bytes per iteration as an engine measured them.
        partition_copies: every optimizer partition has a buddy copy on another machine (copies_stand_in).
        mode: what to plan per stage (:data:`STAGE_MODES`; default: :func:`stage_mode` of ``strategy``).
    """
    budget, iteration_time, pcie, network = _check_inputs(
        strategy, groups, storage_budget_gb, iteration_time_s, pcie_gbps, network_gbps, checkpoint_interval
    )
    mode = stage_mode(SwiftConfig(strategy=strategy)) if mode is None else mode
    p, sizing = layout.pp, _sizing(shape, measured)

    spread = _replicated_stages(layout)
    replicated, candidates, copies_note = copies_stand_in(
        mode, spread, _candidate_stages(mode, spread), partition_copies
    )
    # Cross-machine pipeline sends; a send is a logging candidate if its receiver may replay.
    cross = pipeline_edges(layout, shape, measured)
    candidate_edges = [e for e in cross if e.dst_stage in candidates]
    if mode == "logging" and not candidate_edges:
        raise _nothing_to_log(layout)
    times, rec_units = stage_times(p, sizing, iteration_time, stage_compute_s)
    units = UnitChain.build(layout, cross, candidate_edges, times, network, checkpoint_interval, parallel_recovery)
    grouped = choose_groups(units, sizing is not None, groups, budget, checkpoint_interval)
    stage_strategy, logged = _assign_strategies(layout, mode, candidates, replicated, candidate_edges, grouped.machines)
    notes = grouped.notes + ([copies_note] if copies_note else [])
    verdict = worth_logging(p, sizing, logged, iteration_time, pcie, checkpoint_interval)
    candidate_bytes = sum(e.bytes_per_iteration for e in logged)
    stage_strategy, logged = _apply_verdict(mode, verdict[0], stage_strategy, logged, notes)
    return Plan(
        layout=layout,
        shape=shape,
        strategy=strategy,
        mode=mode,
        stage_strategy=stage_strategy,
        groups=grouped.machines,
        logged_edges=logged,
        worth_logging=verdict,
        bubble_ratio=bubble_ratio(p, sizing.micro_batches) if sizing is not None else None,
        grouping_method=grouped.method,
        expected_recovery=grouped.chosen.recovery_time,
        recovery_units=rec_units,
        candidate_log_bytes_per_iteration=candidate_bytes,
        greedy=grouped.greedy,
        exact=grouped.exact,
        notes=tuple(notes),
        measured=measured,
        min_budget_gb=grouped.min_budget_gb,
    )


def _sizing(shape: ModelShape | None, measured: MeasuredSizes | None) -> Sizing | None:
    if shape is not None and measured is not None:
        raise ConfigError("give the model shape or measured sizes, not both")
    return shape if shape is not None else measured


def _apply_verdict(
    strategy: str, worth: bool, stage_strategy: dict[int, StageStrategy], logged: list[Any], notes: list[str]
) -> tuple[dict[int, StageStrategy], list[Any]]:
    """Under ``auto``, logging that is not worth it goes (its stages recover by checkpoint); a forced
    ``logging`` keeps it, and the notes say so."""
    if strategy == "auto" and not worth and logged:
        return {s: ("checkpoint" if v == "logging" else v) for s, v in stage_strategy.items()}, []
    if strategy == "logging" and not worth:
        notes.append("strategy='logging' overrides the verdict that logging is not worth it")
    return stage_strategy, logged


def stage_mode(config: SwiftConfig) -> str:
    """What :func:`analyze` plans for ``config``, from the per-stage recoveries its strategy's services
    allow (ds_swift.recovery.services): both, ``auto``; one, forced everywhere; none, every stage
    recovers by checkpoint (no pipeline message is logged)."""
    kinds = services_of(config).stage_recovery
    if len(kinds) > 1:
        return "auto"
    return next(iter(kinds)) if kinds else "checkpoint"


def analyze_config(layout: ParallelLayout, config: SwiftConfig, shape: ModelShape | None = None, **kwargs: Any) -> Plan:
    """:func:`analyze` with the strategy, groups / storage budget, checkpoint interval and
    parallel recovery of a ``swift`` config section; ``kwargs`` (timings) pass through."""
    return analyze(
        layout,
        shape,
        strategy=config.strategy,
        mode=stage_mode(config),
        groups=config.logging.groups,
        storage_budget_gb=config.logging.storage_budget_gb,
        checkpoint_interval=config.checkpoint.interval,
        parallel_recovery=config.parallel_recovery,
        **kwargs,
    )


def _check_inputs(
    strategy: str,
    groups: int | None,
    storage_budget_gb: float | None,
    iteration_time_s: float | None,
    pcie_gbps: float | None,
    network_gbps: float | None,
    checkpoint_interval: int | None,
) -> tuple[float | None, float | None, float | None, float | None]:
    """Refuse bad arguments of :func:`analyze`, naming them; return the budget, iteration
    time, PCIe and network bandwidths as floats."""
    if strategy not in strategy_names():
        raise ConfigError(f"strategy={strategy!r} is invalid: one of {', '.join(strategy_names())}")
    if groups is not None:
        positive_int("groups", groups)
        if storage_budget_gb is not None:
            raise ConfigError("groups and storage_budget_gb are both set: give one (groups forces K balanced groups)")
    floats = (
        positive_float("storage_budget_gb", storage_budget_gb),
        positive_float("iteration_time_s", iteration_time_s),
        positive_float("pcie_gbps", pcie_gbps),
        positive_float("network_gbps", network_gbps),
    )
    if checkpoint_interval is not None:
        positive_int("checkpoint_interval", checkpoint_interval)
    return floats


def _replicated_stages(lay: ParallelLayout) -> list[bool]:
    """Per stage: every rank has a data-parallel replica on another machine."""
    return [
        all(any(lay.machine_of(q) != lay.machine_of(r) for q in lay.dp_peers(r)) for r in lay.stage_ranks(s))
        for s in range(lay.pp)
    ]


def _candidate_stages(strategy: str, replicated: list[bool]) -> set[int]:
    """Stages that may recover by logging, refusing a forced strategy the layout cannot have."""
    p = len(replicated)
    if strategy == "replication" and not all(replicated):
        s = replicated.index(False)
        raise ConfigError(
            f"strategy='replication' is impossible: stage {s} has no data-parallel replica on another machine"
        )
    if strategy == "logging" and p == 1:
        raise ConfigError("strategy='logging' needs pipeline parallelism (pp > 1): there are no pipeline sends to log")
    if strategy == "auto":
        return {s for s in range(p) if not replicated[s]} if p > 1 else set()
    return set(range(p)) if strategy == "logging" else set()


def _assign_strategies(
    lay: ParallelLayout,
    strategy: str,
    candidates: set[int],
    replicated: list[bool],
    candidate_edges: list[Edge],
    machine_groups: list[list[int]],
) -> tuple[dict[int, StageStrategy], list[Edge]]:
    """The strategy of every stage and the sends logged for it, given the machine groups."""
    group_of = {m: i for i, g in enumerate(machine_groups) for m in g}

    def group(rank: int) -> int:
        return group_of[lay.machine_of(rank)]

    logged = [e for e in candidate_edges if group(e.src_rank) != group(e.dst_rank)]
    # A candidate stage recovers by logging if its group receives logged sends to replay from.
    receiving = {group(e.dst_rank) for e in logged}
    stage_strategy: dict[int, StageStrategy] = {}
    for s in range(lay.pp):
        if strategy == "checkpoint":
            stage_strategy[s] = "checkpoint"
        elif s in candidates and all(group(r) in receiving for r in lay.stage_ranks(s)):
            stage_strategy[s] = "logging"
        elif replicated[s] and strategy != "logging":
            stage_strategy[s] = "replication"
        else:
            stage_strategy[s] = "checkpoint"
    # Sends into a stage that ends up not replaying (part of it in a group with nothing to
    # replay from) would be logged for nobody.
    return stage_strategy, [e for e in logged if stage_strategy[e.dst_stage] == "logging"]
