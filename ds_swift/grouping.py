"""Selective logging (SWIFT section 5.3): group machines so that logs fit a storage budget.

Machines ``0..N-1`` sit along the pipeline; a *grouping* cuts that chain into contiguous runs.
Sends that cross a cut are logged; sends inside a group are not, so a failure rolls the whole
group back to the last global checkpoint and replays it from the logs at its edges.

Inputs (plain lists of floats, one unit per machine or per inseparable run of machines):

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
``dR/dM`` until the logs fit). :func:`exact_grouping` is optimal: a DP over cut sets that keeps,
at every cut position, the Pareto front of (storage so far, recovery so far) and prunes labels
with Lagrangian lower bounds; it is never worse than the greedy result because it starts from
it. :func:`brute_force_grouping` enumerates every cut set (tests, ``N <= ~16``).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Grouping",
    "balanced_groups",
    "brute_force_grouping",
    "evaluate",
    "exact_grouping",
    "greedy_merge",
]

# Storage sums are accumulated in different orders by the methods below; this slack keeps
# "fits the budget" the same decision for all of them (N * eps is ~1e-13 for N = 1024).
_FIT_SLACK = 1e-12
# Labels are pruned only when their lower bound beats the best known solution by more than
# this, so floating-point noise in the bounds can never cut off the optimum.
_PRUNE_SLACK = 1e-9


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


class _Problem:
    """Validated inputs plus prefix sums, shared by the optimisers."""

    def __init__(
        self,
        R: Sequence[float],
        M: Sequence[float],
        M_max: float,
        B: float,
        T: float,
        parallel_recovery: bool,
    ) -> None:
        self.N = len(R)
        if self.N < 1:
            raise ValueError("R must hold at least one machine")
        if len(M) != self.N - 1:
            raise ValueError(f"M must hold N-1 = {self.N - 1} values (one per adjacent pair), got {len(M)}")
        for name, values in (("R", R), ("M", M)):
            for i, v in enumerate(values):
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name}[{i}]={v!r} must be a finite number >= 0")
        if math.isnan(M_max) or M_max < 0:
            raise ValueError(f"M_max={M_max!r} must be >= 0 (inf for no limit)")
        if math.isnan(B) or B <= 0:
            raise ValueError(f"B={B!r} must be > 0 bytes/s (inf ignores transfer time)")
        if not (math.isfinite(T) and T > 0):
            raise ValueError(f"T={T!r} must be a positive number of iterations")
        self.R = [float(r) for r in R]
        self.M = [float(m) for m in M]
        self.M_max = float(M_max)
        self.B = float(B)
        self.T = float(T)
        self.parallel = bool(parallel_recovery)
        # Budget on the sum of cut M (per iteration): comparing sums, not T*sums, keeps every
        # method's decision the same up to _FIT_SLACK.
        self.limit = self.M_max / self.T * (1 + _FIT_SLACK)
        self.PR = np.concatenate([[0.0], np.cumsum(self.R, dtype=np.float64)])
        self.PM = np.concatenate([[0.0], np.cumsum(self.M, dtype=np.float64)])
        # Mcut[k]: cost of cutting before unit k (k = 1..N-1); Mcut[N] = 0 ends the chain.
        self.Mcut = np.concatenate([[0.0], np.asarray(self.M, dtype=np.float64), [0.0]])

    def fits(self, cut_sum: float) -> bool:
        return cut_sum <= self.limit

    def group_cost(self, start: int, end: int) -> float:
        """Expected-recovery contribution of the group ``[start, end)`` (exact sums)."""
        size = end - start
        r = math.fsum(self.R[start:end]) + math.fsum(self.M[start : end - 1]) / self.B
        cost = r * size / self.N
        return cost / (self.N // size) if self.parallel else cost

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
            if self.parallel:
                cost /= np.floor(N / np.maximum(size, 1.0))
        cost[size <= 0] = np.inf
        return cost

    def result(self, cuts: Sequence[int], method: str) -> Grouping:
        bounds = [0, *sorted(cuts), self.N]
        groups = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))
        cut_sum = math.fsum(self.M[k - 1] for k in bounds[1:-1])
        rec = math.fsum(self.group_cost(a, b) for a, b in itertools.pairwise(bounds))
        return Grouping(groups, rec, self.T * cut_sum, self.fits(cut_sum), method)


def evaluate(
    groups: Sequence[Sequence[int]],
    R: Sequence[float],
    M: Sequence[float],
    M_max: float = math.inf,
    B: float = math.inf,
    T: float = 1.0,
    parallel_recovery: bool = False,
) -> Grouping:
    """Cost of a given grouping (contiguous runs covering ``0..N-1`` in order)."""
    problem = _Problem(R, M, M_max, B, T, parallel_recovery)
    flat = [u for g in groups for u in g]
    if flat != list(range(problem.N)) or any(len(g) == 0 for g in groups):
        raise ValueError(f"groups must be non-empty contiguous runs covering 0..{problem.N - 1} in order")
    return problem.result([g[0] for g in groups[1:]], "given")


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


def greedy_merge(
    R: Sequence[float],
    M: Sequence[float],
    M_max: float,
    B: float = math.inf,
    T: float = 1.0,
    parallel_recovery: bool = False,
) -> Grouping:
    """The paper's greedy: merge the adjacent pair with the smallest ``dR/dM`` until logs fit.

    A heap of candidate merges with lazy invalidation makes it ``O(N log N)``; pairs joined by
    ``M = 0`` are never merged (that frees no storage and only lengthens recovery).
    """
    p = _Problem(R, M, M_max, B, T, parallel_recovery)
    N = p.N
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


def brute_force_grouping(
    R: Sequence[float],
    M: Sequence[float],
    M_max: float,
    B: float = math.inf,
    T: float = 1.0,
    parallel_recovery: bool = False,
) -> Grouping:
    """Try all ``2**(N-1)`` cut sets. A reference for tests; keep ``N`` small."""
    p = _Problem(R, M, M_max, B, T, parallel_recovery)
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


def _relax(p: _Problem, cost: np.ndarray, weight: np.ndarray, lam: float) -> tuple[np.ndarray, float, list[int]]:
    """Lagrangian relaxation: ``h[k]`` = min over groupings of ``[k, N)`` of recovery plus
    ``lam`` times the ``weight`` of its cuts after ``k`` (``weight[j]`` for a cut before unit
    ``j``; ``weight[N] = 0``). Returns ``h`` and the weight and cuts of the whole-chain minimiser.
    """
    N = p.N
    h = np.zeros(N + 1)
    g = lam * weight  # g[j] = lam * weight[j] + h[j], the price of a cut before j and all after
    nxt = np.full(N + 1, N, dtype=np.int64)
    for k in range(N - 1, -1, -1):
        tot = cost[k, k + 1 :] + g[k + 1 :]
        a = int(tot.argmin())
        h[k] = tot[a]
        g[k] += h[k]
        nxt[k] = k + 1 + a
    cuts = []
    k = int(nxt[0])
    while k < N:
        cuts.append(k)
        k = int(nxt[k])
    return h, math.fsum(float(weight[c]) for c in cuts), cuts


class _Bounds:
    """Lagrangian lower bounds on the recovery of any completion of a partial grouping.

    Two relaxations of the budget: on storage (``sum of cut M <= limit``) and on the number
    of cuts (the residual budget over the smallest positive M left, plus the free M = 0
    cuts). The first is tight when M varies a lot, the second when M is nearly uniform:
    there the storage dual sits between two cut counts and leaves a gap as large as one
    cut's worth of recovery time, which would keep far too many labels alive.
    """

    def __init__(self, p: _Problem, cost: np.ndarray, best_rec: float, best_cuts: list[int]) -> None:
        self.p = p
        self.cost = cost
        self.best_rec = best_rec
        self.best_cuts = best_cuts
        N = p.N
        positions = np.arange(N + 1)
        ones = ((positions >= 1) & (positions < N)).astype(np.float64)
        # min positive M and number of free (M = 0) cut positions after each k
        mpos = np.where(p.Mcut > 0, p.Mcut, np.inf)
        mpos[N] = np.inf
        self.min_pos = np.minimum.accumulate(mpos[::-1])[::-1]  # over cuts j >= k
        self.free = np.cumsum((ones * (p.Mcut == 0))[::-1])[::-1]
        count_cap = self.max_cuts(0, np.array([0.0]))[0]
        self.storage = self._search(p.Mcut, p.limit)
        self.count = self._search(ones, float(count_cap))

    def max_cuts(self, k: int, used: np.ndarray) -> np.ndarray:
        """Most cuts after position ``k`` that a residual budget ``limit - used`` can pay for."""
        nxt = min(k + 1, self.p.N)
        with np.errstate(over="ignore", divide="ignore"):
            paid = np.floor((self.p.limit - used) / self.min_pos[nxt] * (1 + 1e-9))
        # Never more cuts than positions left: also keeps 0 * inf (a NaN bound) out.
        return np.asarray(np.minimum(self.free[nxt] + np.maximum(paid, 0.0), self.p.N - nxt))

    def _search(self, weight: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray]:
        """Parametric search for the dual optimum of ``weight(cuts) <= cap``; keeps a few bounds."""
        seen: list[tuple[float, np.ndarray]] = []

        def relax(lam: float) -> tuple[float, float, float]:
            h, w, cuts = _relax(self.p, self.cost, weight, lam)
            seen.append((lam, h))
            found = self.p.result(cuts, "exact")
            if found.fits and found.recovery_time < self.best_rec:
                self.best_rec, self.best_cuts = found.recovery_time, cuts
            return lam, w, float(h[0]) - lam * w

        lo = relax(0.0)  # every machine alone
        positive = weight[weight > 0]
        # Above (one-group cost) / (smallest positive weight) every weighted cut is a loss.
        with np.errstate(over="ignore", divide="ignore"):
            hi_lam = 2.0 * (float(self.cost[0, self.p.N]) + 1.0) / float(positive.min()) if positive.size else 0.0
        # A subnormal weight would overflow lam * weight into inf - inf: then keep lam = 0 only
        # (weaker bounds, still exact).
        if lo[1] > cap and positive.size and math.isfinite(hi_lam * float(positive.max()) * (self.p.N + 1)):
            hi = relax(hi_lam)
            for _ in range(64):
                (lo_lam, lo_w, lo_r), (hi_lam, hi_w, hi_r) = lo, hi
                if hi_w >= lo_w:
                    break
                # where the supporting lines rec + lam * w of the two minimisers cross
                mid = (hi_r - lo_r) / (lo_w - hi_w)
                if not lo_lam < mid < hi_lam:
                    break
                cur = relax(mid)
                if cur[1] in (lo_w, hi_w):
                    break  # no grouping below both lines: mid is the dual optimum
                if cur[1] > cap:
                    lo = cur
                else:
                    hi = cur
        # lam = 0 (every later machine alone) is the tightest near the end of the chain; of the
        # others, the few with the best dual value at the root do nearly all the pruning.
        seen.sort(key=lambda b: -(float(b[1][0]) - b[0] * cap))
        chosen = [b for b in seen if b[0] == 0.0][:1] + [b for b in seen if b[0] != 0.0][:3]
        return np.array([b[0] for b in chosen])[:, None], np.stack([b[1] for b in chosen])

    def lower(self, k: int, used: np.ndarray) -> np.ndarray:
        """Lower bound on the recovery of the rest of the chain for labels at cut ``k``."""
        lam_s, h_s = self.storage
        lam_c, h_c = self.count
        by_storage = np.max(h_s[:, k][:, None] - lam_s * (self.p.limit - used)[None, :], axis=0)
        by_count = np.max(h_c[:, k][:, None] - lam_c * self.max_cuts(k, used)[None, :], axis=0)
        return np.maximum(np.maximum(by_storage, by_count), 0.0)


def exact_grouping(
    R: Sequence[float],
    M: Sequence[float],
    M_max: float,
    B: float = math.inf,
    T: float = 1.0,
    parallel_recovery: bool = False,
    max_labels: int = 2_000_000,
) -> Grouping:
    """Optimal contiguous grouping under the budget; never worse than :func:`greedy_merge`.

    Forward DP over cut positions ``k``: a label is (cut sum so far, recovery so far, parent)
    for one grouping of units ``[0, k)`` that ends with a cut at ``k``. Labels at the same
    ``k`` dominated in both coordinates are dropped (the rest of the chain cannot tell them
    apart), and so are labels whose Lagrangian lower bound on any completion exceeds a
    target. Both prunings keep every grouping at or below the target, so a grouping found
    is optimal. The target starts just above the root lower bound and rises towards the best
    known grouping (greedy, improved by the Lagrangian solutions): a loose target is what
    makes the label sets explode when many groupings are nearly tied.

    The problem is a constrained shortest path, NP-hard in general: on adversarial inputs
    the label sets can still grow; past ``max_labels`` labels the best grouping known is
    returned with ``optimal=False``. Memory: an ``(N+1)^2`` cost table plus the labels.
    """
    p = _Problem(R, M, M_max, B, T, parallel_recovery)
    N = p.N
    greedy = greedy_merge(R, M, M_max, B, T, parallel_recovery)
    if len(greedy.groups) == N:
        # Every machine alone fits: merging only ever adds recovery time, so this is optimal.
        return dataclasses.replace(greedy, method="exact", optimal=True, lower_bound=greedy.recovery_time)

    cost = p.cost_table()
    bounds = _Bounds(p, cost, greedy.recovery_time, greedy.cuts)
    best_rec, best_cuts = bounds.best_rec, bounds.best_cuts
    root = float(bounds.lower(0, np.zeros(1))[0])
    gap = best_rec - root
    optimal = False
    for frac in (1 / 256, 1 / 16, 1 / 2, 1.0):
        target = best_rec if frac == 1.0 else root + gap * frac
        cuts, complete = _label_dp(p, cost, bounds, target * (1 + _PRUNE_SLACK), max_labels)
        if cuts is not None:
            found = p.result(cuts, "exact")
            if found.fits and found.recovery_time < best_rec:
                best_rec, best_cuts = found.recovery_time, cuts
        if not complete:
            break  # label cap hit: keep the best grouping known, unproven
        if cuts is not None or frac == 1.0:
            optimal = True  # nothing at or below the target was pruned: this is the optimum
            break
    out = p.result(best_cuts, "exact")
    return dataclasses.replace(
        out, optimal=optimal, lower_bound=out.recovery_time if optimal else min(root, out.recovery_time)
    )


def _label_dp(
    p: _Problem, cost: np.ndarray, bounds: _Bounds, ub: float, max_labels: int
) -> tuple[list[int] | None, bool]:
    """The best grouping with recovery <= ``ub`` (None if there is none) and whether the
    search finished within ``max_labels``."""
    N = p.N
    singles_suffix = bounds.storage[1][0]  # the lam = 0 row: every machine from k on alone
    # Labels live in flat arrays (those of cut k appended at step k); ``active`` holds the
    # ones that may still start a group. A label retires for good once its group plus every
    # later machine alone exceeds ``ub``: that bound only grows with the group's end (the
    # cost is superadditive), unlike the Lagrangian ones, which filter new labels only.
    cap = 1024
    S = np.zeros(cap)
    V = np.zeros(cap)
    node = np.zeros(cap, dtype=np.int64)
    parent = np.full(cap, -1, dtype=np.int64)
    n = 1  # label 0: the empty prefix, ending at position 0
    active = np.zeros(1, dtype=np.int64)
    for k in range(1, N + 1):
        cand_v = V[active] + cost[node[active], k]
        alive = cand_v + singles_suffix[k] <= ub
        active = active[alive]
        cand_v = cand_v[alive]
        cand_s = S[active] + p.Mcut[k]
        keep = np.nonzero((cand_s <= p.limit) & (cand_v + bounds.lower(k, cand_s) <= ub))[0]
        if keep.size == 0:
            continue
        if k == N:
            lab = int(active[keep[np.argmin(cand_v[keep])]])  # the last group's parent label
            cuts: list[int] = []
            while lab > 0:
                cuts.append(int(node[lab]))
                lab = int(parent[lab])
            return cuts, True
        order = keep[np.lexsort((cand_v[keep], cand_s[keep]))]
        vs = cand_v[order]
        # Pareto front: keep a label only if it beats every label with less or equal storage.
        front = order[np.concatenate([[True], vs[1:] < np.minimum.accumulate(vs)[:-1]])]
        m = front.size
        if n + m > max_labels:
            return None, False
        if n + m > cap:
            cap = max(2 * cap, n + m)
            S, V, node, parent = (np.resize(a, cap) for a in (S, V, node, parent))
        S[n : n + m] = cand_s[front]
        V[n : n + m] = cand_v[front]
        node[n : n + m] = k
        parent[n : n + m] = active[front]
        active = np.concatenate([active, np.arange(n, n + m)])
        n += m
    return None, True
