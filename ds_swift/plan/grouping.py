"""Selective logging (SWIFT section 5.3): group machines so that logs fit a storage budget.

Machines ``0..N-1`` sit along the pipeline; a *grouping* cuts that chain into contiguous runs.
Sends that cross a cut are logged; sends inside a group are not, so a failure rolls the whole
group back to the last global checkpoint and replays it from the logs at its edges.

Inputs, held by a :class:`Chain` (one unit per machine or per inseparable run of machines):

- ``R[i]``: compute time of machine ``i`` per iteration (seconds, or any unit);
- ``M[i]``: bytes per iteration sent between machine ``i`` and ``i+1`` (``len(M) == N-1``);
- ``M_max``: storage budget in bytes for the logs kept between two global checkpoints;
- ``B``: network bandwidth in bytes/s (``inf`` ignores the transfer term);
- ``T``: checkpoint interval in iterations;
- ``parallel_recovery``: survivors share a group's replay (section 5.2).

Objective (the paper's): expected recovery time ``sum_G R(G) * |G| / N`` where
``R(G) = sum of R in G + internal M / B``, divided by ``floor(N / |G|)`` with parallel
recovery; constraint ``T * sum of M over the cuts <= M_max``.

:func:`greedy_merge` is the paper's heuristic (merge the adjacent pair with the smallest
``dR/dM`` until the logs fit). :func:`~ds_swift.plan.grouping_exact.exact_grouping` is optimal
(a label-setting DP with Lagrangian bounds, in its own module). :func:`brute_force_grouping`
enumerates every cut set (tests, ``N <= ~16``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Chain",
    "Grouping",
    "balanced_groups",
    "brute_force_grouping",
    "evaluate",
    "greedy_merge",
]

# Storage sums are accumulated in different orders by the methods below; this slack keeps
# "fits the budget" the same decision for all of them (N * eps is ~1e-13 for N = 1024).
_FIT_SLACK = 1e-12


@dataclass(frozen=True)
class Grouping:
    """A grouping of machines and what it costs."""

    groups: tuple[tuple[int, ...], ...]
    """Contiguous runs of machine (unit) ids, in order."""

    recovery_time: float
    """Expected recovery time (the objective), in the unit of ``R``."""

    storage: float
    """Log bytes kept between two checkpoints: ``T * sum of M over the cuts``."""

    fits: bool
    """``storage <= M_max``. Always true for a result of the optimisers (one group fits)."""

    method: str
    """``greedy``, ``exact``, ``brute-force``, ``balanced`` or ``given``."""

    optimal: bool | None = None
    """For ``exact``: True when proven optimal, False when the search hit its label cap and
    this is the best grouping found. None for the other methods."""

    lower_bound: float | None = None
    """For ``exact``: a lower bound on the optimal recovery time (equal to it when optimal)."""

    @property
    def cuts(self) -> list[int]:
        """Positions ``k`` where a group starts (the boundary between unit ``k-1`` and ``k``)."""
        return [g[0] for g in self.groups[1:]]

    @property
    def logs(self) -> bool:
        """Whether anything is logged at all (one group, or only free cuts, logs nothing)."""
        return self.storage > 0

    def as_lists(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


@dataclass(frozen=True, eq=False)
class Chain:
    """One grouping problem: the machines along the pipeline, their costs and the budget.

    Every optimiser takes one, so the inputs are validated once and the prefix sums are shared.
    """

    R: Sequence[float]
    """Compute time of each unit per iteration (seconds, or any unit)."""
    M: Sequence[float]
    """Bytes per iteration between unit ``i`` and ``i+1`` (``N-1`` values)."""
    M_max: float = math.inf
    """Log budget in bytes between two global checkpoints (``inf`` for no limit)."""
    B: float = math.inf
    """Network bandwidth in bytes/s (``inf`` ignores the transfer term)."""
    T: float = 1.0
    """Checkpoint interval in iterations."""
    parallel_recovery: bool = False
    """Survivors share a group's replay (section 5.2)."""
    limit: float = field(init=False, repr=False)
    """Budget on the sum of cut M per iteration: comparing sums, not T*sums, keeps every
    method's decision the same up to the fit slack."""
    PR: np.ndarray = field(init=False, repr=False)
    PM: np.ndarray = field(init=False, repr=False)
    Mcut: np.ndarray = field(init=False, repr=False)
    """``Mcut[k]``: cost of cutting before unit k (k = 1..N-1); ``Mcut[N] = 0`` ends the chain."""

    def __post_init__(self) -> None:
        N = len(self.R)
        if N < 1:
            raise ValueError("R must hold at least one machine")
        if len(self.M) != N - 1:
            raise ValueError(f"M must hold N-1 = {N - 1} values (one per adjacent pair), got {len(self.M)}")
        for name, values in (("R", self.R), ("M", self.M)):
            for i, v in enumerate(values):
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name}[{i}]={v!r} must be a finite number >= 0")
        if math.isnan(self.M_max) or self.M_max < 0:
            raise ValueError(f"M_max={self.M_max!r} must be >= 0 (inf for no limit)")
        if math.isnan(self.B) or self.B <= 0:
            raise ValueError(f"B={self.B!r} must be > 0 bytes/s (inf ignores transfer time)")
        if not (math.isfinite(self.T) and self.T > 0):
            raise ValueError(f"T={self.T!r} must be a positive number of iterations")
        R, M = [float(r) for r in self.R], [float(m) for m in self.M]
        derived = {
            "R": R,
            "M": M,
            "M_max": float(self.M_max),
            "B": float(self.B),
            "T": float(self.T),
            "parallel_recovery": bool(self.parallel_recovery),
            "limit": float(self.M_max) / float(self.T) * (1 + _FIT_SLACK),
            "PR": np.concatenate([[0.0], np.cumsum(R, dtype=np.float64)]),
            "PM": np.concatenate([[0.0], np.cumsum(M, dtype=np.float64)]),
            "Mcut": np.concatenate([[0.0], np.asarray(M, dtype=np.float64), [0.0]]),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def N(self) -> int:
        return len(self.R)

    def fits(self, cut_sum: float) -> bool:
        return cut_sum <= self.limit

    def group_cost(self, start: int, end: int) -> float:
        """Expected-recovery contribution of the group ``[start, end)`` (exact sums)."""
        size = end - start
        r = math.fsum(self.R[start:end]) + math.fsum(self.M[start : end - 1]) / self.B
        cost = r * size / self.N
        return cost / (self.N // size) if self.parallel_recovery else cost

    def cost_table(self) -> np.ndarray:
        """``cost[i, j]`` for the group ``[i, j)``, an ``(N, N+1)`` table; ``inf`` where ``j <= i``."""
        N = self.N
        s = np.arange(N, dtype=np.float64)[:, None]
        e = np.arange(N + 1, dtype=np.float64)[None, :]
        # PM at j-1 for column j (column 0 is never a group end)
        pm_end = np.concatenate([[0.0], self.PM[:N]])[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            size = e - s
            r = (self.PR[None, :] - self.PR[:N, None]) + (pm_end - self.PM[:N, None]) / self.B
            cost = r * size / N
            if self.parallel_recovery:
                cost /= np.floor(N / np.maximum(size, 1.0))
        cost[size <= 0] = np.inf
        return cost

    def result(self, cuts: Sequence[int], method: str) -> Grouping:
        """The grouping that starts a group at each of ``cuts``, with its cost."""
        bounds = [0, *sorted(cuts), self.N]
        groups = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))
        cut_sum = math.fsum(self.M[k - 1] for k in bounds[1:-1])
        rec = math.fsum(self.group_cost(a, b) for a, b in itertools.pairwise(bounds))
        return Grouping(groups, rec, self.T * cut_sum, self.fits(cut_sum), method)


def evaluate(chain: Chain, groups: Sequence[Sequence[int]]) -> Grouping:
    """Cost of a given grouping (contiguous runs covering ``0..N-1`` in order)."""
    flat = [u for g in groups for u in g]
    if flat != list(range(chain.N)) or any(len(g) == 0 for g in groups):
        raise ValueError(f"groups must be non-empty contiguous runs covering 0..{chain.N - 1} in order")
    return chain.result([g[0] for g in groups[1:]], "given")


def balanced_groups(N: int, K: int) -> list[list[int]]:
    """``K`` contiguous groups of ``N`` machines whose sizes differ by at most one (larger first)."""
    if N < 1:
        raise ValueError(f"N={N} must be >= 1")
    if not 1 <= K <= N:
        raise ValueError(f"K={K} groups must be between 1 and N={N}")
    size, extra = divmod(N, K)
    out: list[list[int]] = []
    start = 0
    for g in range(K):
        end = start + size + (1 if g < extra else 0)
        out.append(list(range(start, end)))
        start = end
    return out


def greedy_merge(chain: Chain) -> Grouping:
    """The paper's greedy: merge the adjacent pair with the smallest ``dR/dM`` until logs fit.

    A heap of candidate merges with lazy invalidation makes it ``O(N log N)``; pairs joined by
    ``M = 0`` are never merged (that frees no storage and only lengthens recovery).
    """
    p, N = chain, chain.N
    # Segments keyed by their first unit: end (exclusive) and a version bumped on each merge.
    end = {i: i + 1 for i in range(N)}
    prev: dict[int, int | None] = {i: (i - 1 if i > 0 else None) for i in range(N)}
    version = dict.fromkeys(range(N), 0)
    cut_sum = math.fsum(p.M)
    heap: list[tuple[float, int, int, int, int]] = []

    def push(a: int, b: int) -> None:
        dm = p.M[b - 1]
        if dm <= 0:
            return
        dr = p.group_cost(a, end[b]) - p.group_cost(a, end[a]) - p.group_cost(b, end[b])
        heapq.heappush(heap, (dr / (dm * p.T), a, b, version[a], version[b]))

    for i in range(N - 1):
        push(i, i + 1)
    while not p.fits(cut_sum) and heap:
        _, a, b, va, vb = heapq.heappop(heap)
        if version.get(a) != va or version.get(b) != vb:
            continue  # stale: one side was merged since this entry was pushed
        cut_sum -= p.M[b - 1]
        end[a] = end.pop(b)
        del version[b], prev[b]
        version[a] += 1
        nxt = end[a]
        if nxt < N:
            prev[nxt] = a
            push(a, nxt)
        before = prev[a]
        if before is not None:
            push(before, a)
        if p.fits(cut_sum):
            # The running difference drifts by a few ulps; confirm with an exact sum.
            cut_sum = math.fsum(p.M[k - 1] for k in end if k > 0)
    return p.result([k for k in end if k > 0], "greedy")


def brute_force_grouping(chain: Chain) -> Grouping:
    """Try all ``2**(N-1)`` cut sets. A reference for tests; keep ``N`` small."""
    p = chain
    if p.N > 20:
        raise ValueError(f"brute force over 2**{p.N - 1} cut sets is too slow; use exact_grouping")
    best: Grouping | None = None
    for mask in range(1 << (p.N - 1)):
        cuts = [k + 1 for k in range(p.N - 1) if mask >> k & 1]
        cand = p.result(cuts, "brute-force")
        if cand.fits and (best is None or cand.recovery_time < best.recovery_time):
            best = cand
    assert best is not None  # mask 0 (one group, no logs) always fits
    return best
