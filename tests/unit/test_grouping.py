"""Selective logging (section 5.3): greedy merge, the exact optimiser, brute force."""

from __future__ import annotations

import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.plan.grouping import Chain, balanced_groups, brute_force_grouping, evaluate, greedy_merge
from ds_swift.plan.grouping_exact import exact_grouping


@settings(max_examples=200, deadline=None)
@given(N=st.integers(1, 60), data=st.data())
def test_balanced_groups(N: int, data: st.DataObject) -> None:
    K = data.draw(st.integers(1, N))
    groups = balanced_groups(N, K)
    assert len(groups) == K
    assert [u for g in groups for u in g] == list(range(N))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_balanced_groups_rejects_bad_k() -> None:
    with pytest.raises(ValueError):
        balanced_groups(4, 5)
    with pytest.raises(ValueError):
        balanced_groups(4, 0)


def test_objective_by_hand() -> None:
    # N = 4, R = 1 each, M = 2 between neighbours, B = 1 (M/B counts), groups {0,1} {2} {3}
    g = evaluate(Chain([1, 1, 1, 1], [2, 2, 2], B=1.0, T=10), [[0, 1], [2], [3]])
    # {0,1}: (1 + 1 + 2) * 2/4 = 2 ; {2}: 1/4 ; {3}: 1/4
    assert math.isclose(g.recovery_time, 2.5)
    assert g.storage == 10 * (2 + 2) and g.cuts == [2, 3]
    # parallel recovery divides each group by floor(N/|G|): 2/2 + (1/4)/4 + (1/4)/4
    gp = evaluate(Chain([1, 1, 1, 1], [2, 2, 2], B=1.0, T=10, parallel_recovery=True), [[0, 1], [2], [3]])
    assert math.isclose(gp.recovery_time, 1 + 1 / 16 + 1 / 16)


def test_greedy_merges_the_smallest_dr_per_dm_first() -> None:
    # merging 0+1 costs little recovery for a lot of storage; 2+3 the other way round
    R = [0.1, 0.1, 5.0, 5.0]
    M = [10.0, 1.0, 1.0]
    g = greedy_merge(Chain(R, M, M_max=2.0))  # must drop 10 of 12: exactly the 0|1 cut
    assert g.as_lists() == [[0, 1], [2], [3]]
    assert g.storage == 2.0 and g.fits


def test_no_grouping_fits_means_one_group() -> None:
    R, M = [1.0] * 5, [3.0] * 4
    for fn in (greedy_merge, exact_grouping, brute_force_grouping):
        g = fn(Chain(R, M, 2.9))
        assert g.as_lists() == [[0, 1, 2, 3, 4]] and not g.logs and g.fits


def test_free_cuts_are_taken() -> None:
    # a boundary without traffic costs no storage: the exact optimiser cuts it even at budget 0
    g = exact_grouping(Chain([1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 5.0], M_max=0.0))
    assert g.as_lists() == [[0, 1], [2, 3]] and not g.logs and g.optimal


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="N-1"):
        Chain([1.0, 1.0], [1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match="R\\[1\\]"):
        Chain([1.0, float("nan")], [1.0], 1.0)
    with pytest.raises(ValueError, match="M_max"):
        Chain([1.0, 1.0], [1.0], -1.0)
    with pytest.raises(ValueError, match="contiguous"):
        evaluate(Chain([1.0] * 3, [1.0] * 2), [[0, 2], [1]])


instances = st.integers(1, 10).flatmap(
    lambda n: st.tuples(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0, 10), min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, 1.0, 3.0]) | st.floats(0, 10), min_size=n - 1, max_size=n - 1),
        st.floats(0, 1.2),  # budget as a fraction of logging everything
        st.sampled_from([math.inf, 0.5, 4.0]),
        st.sampled_from([1, 3, 100]),
        st.booleans(),
    )
)


@settings(max_examples=250, deadline=None)
@given(instances)
def test_exact_matches_brute_force_and_beats_greedy(inst: tuple) -> None:
    R, M, frac, B, T, parallel = inst
    M_max = frac * T * sum(M)
    chain = Chain(R, M, M_max, B, T, parallel)
    brute, exact, greedy = brute_force_grouping(chain), exact_grouping(chain), greedy_merge(chain)
    assert exact.fits and greedy.fits and brute.fits
    assert exact.optimal is True
    assert exact.recovery_time <= greedy.recovery_time
    assert math.isclose(exact.recovery_time, brute.recovery_time, rel_tol=1e-9, abs_tol=1e-12)
    assert exact.lower_bound == exact.recovery_time
    # the reported costs are those of the reported groups
    again = evaluate(chain, exact.groups)
    assert again.recovery_time == exact.recovery_time and again.storage == exact.storage


def test_label_cap_returns_the_best_known_unproven() -> None:
    rng = random.Random(3)
    N = 200
    R = [rng.uniform(0.5, 1.5) for _ in range(N)]
    M = [rng.uniform(0.9, 1.1) for _ in range(N - 1)]
    chain = Chain(R, M, sum(M) * 0.3)
    full = exact_grouping(chain)
    capped = exact_grouping(chain, max_labels=1)
    greedy = greedy_merge(chain)
    assert full.optimal is True
    assert capped.optimal is False and capped.fits
    assert full.recovery_time <= capped.recovery_time <= greedy.recovery_time
    assert capped.lower_bound is not None and capped.lower_bound <= full.recovery_time * (1 + 1e-9)


def test_exact_on_1024_machines() -> None:
    """The machine counts of a large job: uniform boundaries (what the planner produces for a
    transformer) with profiled, noisy per-machine compute times. Timing is printed; the
    bound only catches a blow-up (the target is well under a second)."""
    rng = random.Random(11)
    N = 1024
    R = [rng.uniform(0.9, 1.1) for _ in range(N)]
    M = [536_870_912.0] * (N - 1)
    for frac, parallel in ((0.02, False), (0.3, True), (0.9, False)):
        M_max = frac * 100 * sum(M)
        t0 = time.process_time()
        chain = Chain(R, M, M_max, B=12.5e9, T=100, parallel_recovery=parallel)
        exact = exact_grouping(chain)
        took = time.process_time() - t0
        greedy = greedy_merge(chain)
        print(f"N=1024 budget {frac:.0%} parallel={parallel}: exact {took:.3f} s CPU, {len(exact.groups)} groups")
        assert exact.optimal is True and exact.fits
        assert exact.recovery_time <= greedy.recovery_time
        assert took < 10.0
