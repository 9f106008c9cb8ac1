"""The exact selective-logging optimiser (SWIFT section 5.3), for the problem of :mod:`.grouping`.

:func:`exact_grouping` is optimal: a DP over cut sets that keeps, at every cut position, the
Pareto front of (storage so far, recovery so far) and prunes labels with Lagrangian lower
bounds; it is never worse than :func:`~ds_swift.plan.grouping.greedy_merge` because it starts
from its result.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ds_swift.plan.grouping import Chain, Grouping, greedy_merge

__all__ = ["exact_grouping"]

# Labels are pruned only when their lower bound beats the best known solution by more than
# this, so floating-point noise in the bounds can never cut off the optimum.
_PRUNE_SLACK = 1e-9


def _relax(p: Chain, cost: np.ndarray, weight: np.ndarray, lam: float) -> tuple[np.ndarray, float, list[int]]:
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

    def __init__(self, p: Chain, cost: np.ndarray, best_rec: float, best_cuts: list[int]) -> None:
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


def exact_grouping(chain: Chain, max_labels: int = 2_000_000) -> Grouping:
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
    p, N = chain, chain.N
    greedy = greedy_merge(chain)
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


def _label_dp(p: Chain, cost: np.ndarray, bounds: _Bounds, ub: float, max_labels: int) -> tuple[list[int] | None, bool]:
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
