"""From a layout to its selective-logging groups (section 5.3).

The machines of a layout form a chain of *units* (:func:`separable_runs`): every machine, or
runs of machines where stages span several of them. :class:`UnitChain` gives each unit its
compute time ``R`` and each boundary the candidate bytes ``M``; :func:`choose_groups` cuts the
chain as asked: ``groups`` balanced groups, the optimum under a storage budget, or every unit
alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ds_swift.config import ConfigError
from ds_swift.plan.grouping import Chain, Grouping, balanced_groups, evaluate, greedy_merge
from ds_swift.plan.grouping_exact import exact_grouping
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import GB, Edge

__all__ = ["MachineGroups", "UnitChain", "choose_groups", "separable_runs", "smallest_budget_gb"]


def separable_runs(layout: ParallelLayout, edges: Iterable[Edge]) -> list[list[int]]:
    """Runs of machines that selective logging treats as one (the chain of section 5.3).

    Normally every machine. When a pipeline send skips a machine (a stage's ranks span
    several machines), a group boundary may only fall where every stage lies wholly on one
    side, so that each send crosses at most one boundary and the chain's per-boundary bytes
    add up exactly.
    """
    n = layout.num_machines
    if all(abs(layout.machine_of(e.src_rank) - layout.machine_of(e.dst_rank)) <= 1 for e in edges):
        return [[m] for m in range(n)]
    lo = [min(layout.coords(r).pp for r in layout.machine_ranks(m)) for m in range(n)]
    hi = [max(layout.coords(r).pp for r in layout.machine_ranks(m)) for m in range(n)]
    units, current = [], [0]
    for m in range(1, n):
        if max(hi[:m]) < min(lo[m:]):
            units.append(current)
            current = []
        current.append(m)
    units.append(current)
    return units


@dataclass(frozen=True)
class UnitChain:
    """The grouping problem of a layout: its machine runs, their compute time ``R`` and the
    candidate bytes ``M`` across each boundary between consecutive runs."""

    units: list[list[int]]
    R: list[float]
    M: list[float]
    B: float
    T: int
    parallel_recovery: bool

    @classmethod
    def build(
        cls,
        lay: ParallelLayout,
        cross: list[Edge],
        candidate_edges: list[Edge],
        times: list[float],
        network: float | None,
        interval: int | None,
        parallel_recovery: bool,
    ) -> UnitChain:
        units = separable_runs(lay, cross)
        unit_of = {m: i for i, u in enumerate(units) for m in u}
        R = [
            math.fsum(times[s] for s in sorted({lay.coords(r).pp for m in u for r in lay.machine_ranks(m)}))
            for u in units
        ]
        M = [0.0] * (len(units) - 1)
        for e in candidate_edges:
            ua, ub = sorted((unit_of[lay.machine_of(e.src_rank)], unit_of[lay.machine_of(e.dst_rank)]))
            if ua != ub:
                M[ua] += e.bytes_per_iteration
        B = network * GB if network is not None else math.inf
        return cls(units, R, M, B, interval or 1, parallel_recovery)

    def chain(self, M_max: float = math.inf) -> Chain:
        return Chain(self.R, self.M, M_max, self.B, self.T, self.parallel_recovery)


@dataclass
class MachineGroups:
    """The grouping chosen for a layout, and how."""

    machines: list[list[int]]
    """Machine ids of each group, in pipeline order."""
    chosen: Grouping
    """The grouping of the units (its cost is the plan's expected recovery)."""
    method: str
    """``every-machine``, ``balanced`` (``groups=K``) or ``exact`` (budget)."""
    greedy: Grouping | None = None
    exact: Grouping | None = None
    notes: list[str] = field(default_factory=list)
    min_budget_gb: float | None = None
    """Set when the budget cannot be met (no grouping that logs anything fits it): the smallest
    ``storage_budget_gb`` that logs something (the cheapest single cut), rounded up."""


def smallest_budget_gb(units: UnitChain) -> float | None:
    """The smallest budget (GB, rounded up to 3 significant digits) under which some grouping
    logs: the cheapest single cut's bytes over a checkpoint interval. None if nothing can be logged."""
    cheapest = min((m for m in units.M if m > 0), default=None)
    if cheapest is None:
        return None
    gb = units.T * cheapest / GB
    scale = 10.0 ** (math.floor(math.log10(gb)) - 2)
    return math.ceil(gb / scale * (1 - 1e-12)) * scale


def choose_groups(
    units: UnitChain, sized: bool, groups: int | None, budget: float | None, interval: int | None
) -> MachineGroups:
    """Selective-logging groups: ``groups`` balanced ones, the optimum under ``budget`` GB, or
    every unit alone. ``sized``: the sends' bytes are known (a model shape or measured sizes)."""
    n = len(units.units)
    greedy = exact = None
    notes: list[str] = []
    min_budget: float | None = None
    if groups is not None:
        if groups > n:
            raise ConfigError(f"groups={groups} is invalid: at most {n} (the machine runs that can be separated)")
        chosen, method = evaluate(units.chain(), balanced_groups(n, groups)), "balanced"
    elif budget is None:
        chosen, method = evaluate(units.chain(), [[u] for u in range(n)]), "every-machine"
    else:
        if interval is None:
            raise ConfigError(
                "checkpoint_interval is needed with storage_budget_gb (the budget holds T iterations of logs)"
            )
        if not sized:
            raise ConfigError(
                "storage_budget_gb needs the model shape (hidden, seq_len, micro_batch_size, micro_batches)"
            )
        chain = units.chain(budget * GB)
        greedy, exact = greedy_merge(chain), exact_grouping(chain)
        chosen, method = exact, "exact"
        if not exact.logs and any(units.M):
            min_budget = smallest_budget_gb(units)
            notes.append(
                f"no grouping fits storage_budget_gb={budget:g}: one group, nothing logged "
                f"(the smallest budget that logs is {min_budget:.3g} GB)"
            )
        if exact.optimal is False:
            notes.append(
                "the exact optimiser stopped at its label cap: the grouping is the best found, not proven optimal"
            )
    machines = [sorted(m for u in g for m in units.units[u]) for g in chosen.groups]
    return MachineGroups(machines, chosen, method, greedy, exact, notes, min_budget)
