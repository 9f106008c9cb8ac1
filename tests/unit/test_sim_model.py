"""The simulator's cost model and failure processes: exact cases and properties."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.config import ConfigError
from ds_swift.sim.failures import FailureModel, poisson_quantile
from ds_swift.sim.model import (
    LoggingSpec,
    StrategySpec,
    Workload,
    expected_failure_cost_s,
    expected_replay_iterations,
    failure_costs_s,
    failure_free_s,
    recovery_paths,
    shrunk_throughput,
)
from ds_swift.sim.runner import mean_ci, simulate, simulate_samples

# --------------------------------------------------------------------------- generators
costs = st.floats(min_value=0.0, max_value=500.0, allow_nan=False)
intervals = st.one_of(st.none(), st.integers(min_value=1, max_value=3000))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    machines = draw(st.integers(1, 8))
    return Workload(
        name="w",
        total_iterations=draw(st.integers(1, 5000)),
        iteration_time_s=draw(st.floats(0.01, 20.0)),
        machines=machines,
        pipeline_stages=draw(st.integers(1, 4)) * machines,
        micro_batches=draw(st.integers(1, 16)),
    )


@st.composite
def strategies_(draw: st.DrawFn, machines: int) -> StrategySpec:
    kind: Any = draw(st.sampled_from(["checkpoint", "snapshot", "replication", "logging", "elastic"]))
    common: dict[str, Any] = dict(
        checkpoint_interval=draw(intervals),
        checkpoint_cost_s=draw(costs),
        restart_s=draw(costs),
        iteration_overhead=draw(st.floats(0.0, 0.2)),
    )
    if kind == "checkpoint":
        return StrategySpec("s", kind, load_s=draw(costs), **common)
    if kind == "snapshot":
        return StrategySpec(
            "s",
            kind,
            snapshot_interval=draw(st.integers(1, 500)),
            snapshot_cost_s=draw(costs),
            load_s=draw(costs),
            broadcast_s=draw(costs),
            **common,
        )
    if kind == "replication":
        return StrategySpec("s", kind, undo_s=draw(costs), broadcast_s=draw(costs), **common)
    if kind == "elastic":
        given = machines < 2 or draw(st.booleans())
        return StrategySpec(
            "s",
            kind,
            undo_s=draw(costs),
            broadcast_s=draw(costs),
            grow_s=draw(costs),
            repair_s=draw(st.one_of(st.none(), st.floats(0.0, 1e5))),
            shrunk_throughput=draw(st.floats(0.3, 0.95)) if given else None,
            **common,
        )
    if draw(st.booleans()):
        spec = LoggingSpec(
            replay_fraction=draw(st.floats(0.05, 1.0)),
            parallel_recovery=draw(st.booleans()),
            parallel_speedup=draw(st.floats(1.0, 16.0)),
        )
    else:
        sizes: list[int] = []
        while sum(sizes) < machines:
            sizes.append(draw(st.integers(1, machines - sum(sizes))))
        spec = LoggingSpec(
            groups=tuple(sizes),
            parallel_recovery=draw(st.booleans()),
            download_s_per_iteration=draw(st.floats(0.0, 2.0)),
            upload_s=draw(costs),
        )
    return StrategySpec("s", kind, load_s=draw(costs), undo_s=draw(costs), logging=spec, **common)


@st.composite
def jobs(draw: st.DrawFn) -> tuple[Workload, StrategySpec]:
    wl = draw(workloads())
    return wl, draw(strategies_(wl.machines))


# --------------------------------------------------------------------------- exact cases
def test_zero_failures_is_failure_free_time_plus_checkpoint_costs_example() -> None:
    wl = Workload("w", total_iterations=1000, iteration_time_s=2.0)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=300, checkpoint_cost_s=7.0, restart_s=50, load_s=5)
    res = simulate(wl, [gc], FailureModel(count=0), repeats=3, seed=1)["gc"]
    assert res.samples_hours == ((1000 * 2.0 + 3 * 7.0) / 3600,) * 3
    assert res.mean_failures == 0


@settings(max_examples=60, deadline=None)
@given(jobs(), st.integers(0, 2**31 - 1))
def test_zero_failures_property(job: tuple[Workload, StrategySpec], seed: int) -> None:
    wl, s = job
    want = wl.total_iterations * wl.iteration_time_s * (1 + s.iteration_overhead)
    if s.checkpoint_interval is not None:
        want += (wl.total_iterations // s.checkpoint_interval) * s.checkpoint_cost_s
    if s.snapshot_interval is not None:
        want += (wl.total_iterations // s.snapshot_interval) * s.snapshot_cost_s
    res = simulate(wl, [s], FailureModel(count=0), repeats=2, seed=seed)["s"]
    assert res.samples_hours == (want / 3600, want / 3600)
    assert failure_free_s(wl, s) == want


def test_failure_cost_by_hand() -> None:
    wl = Workload("w", total_iterations=100, iteration_time_s=10.0)
    gc = StrategySpec("gc", "checkpoint", checkpoint_interval=20, restart_s=100.0, load_s=5.0)
    # x = 0.455 * 100 = 45.5 iterations: last checkpoint at 40, 5 done + half an iteration lost.
    assert failure_costs_s(wl, gc, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(105 + 55.0)
    snap = StrategySpec("cf", "snapshot", checkpoint_interval=20, snapshot_interval=15, restart_s=100.0)
    # restore points 0, 15, 20, 30, 40, 45, ...: at 45.5 only the in-flight half is lost.
    assert failure_costs_s(wl, snap, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(105.0)
    rep = StrategySpec("r", "replication", checkpoint_interval=20, restart_s=100.0, undo_s=1.0, broadcast_s=2.0)
    assert failure_costs_s(wl, rep, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(108.0)
    log = StrategySpec(
        "l",
        "logging",
        checkpoint_interval=20,
        restart_s=100.0,
        logging=LoggingSpec(replay_fraction=0.5, parallel_recovery=True, parallel_speedup=2.0),
    )
    assert failure_costs_s(wl, log, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(100 + 5 + 5 * 2.5)


def test_an_elastic_shrink_costs_the_throughput_lost_until_the_machine_is_back() -> None:
    wl = Workload("w", total_iterations=100, iteration_time_s=10.0, machines=4)
    # Default: 3 of 4 machines, 0.75 of the speed. The machine is back after 200 s: 50 s of work not
    # done meanwhile, plus the pause to grow back, plus half an in-flight iteration and the reshard.
    el = StrategySpec("e", "elastic", restart_s=100.0, broadcast_s=2.0, repair_s=200.0, grow_s=30.0)
    assert failure_costs_s(wl, el, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(102 + 5 + 50 + 30)
    # 100 s of compute left (x = 90): it ends shrunk, before the machine is back: 100 * (1/0.75 - 1).
    assert failure_costs_s(wl, el, np.array([0.9]), np.array([0.0]))[0] == pytest.approx(102 + 100 / 3)
    never = StrategySpec("e", "elastic", restart_s=100.0, shrunk_throughput=0.5)  # it never comes back
    assert failure_costs_s(wl, never, np.array([0.5]), np.array([0.0]))[0] == pytest.approx(100 + 500)
    assert expected_failure_cost_s(wl, never) == pytest.approx(100 + 5 + 0.5 * 1000)
    with pytest.raises(ConfigError, match="machines=1 is invalid: at least 2 for kind elastic"):
        failure_costs_s(Workload("one", 10, 1.0), el, np.array([0.5]), np.array([0.0]))
    with pytest.raises(ConfigError, match="only read by kind elastic"):
        StrategySpec("r", "replication", repair_s=10.0)
    with pytest.raises(ConfigError, match="shrunk_throughput=1.0 is invalid"):
        StrategySpec("e", "elastic", shrunk_throughput=1.0)


def test_selective_logging_groups_replay_the_whole_group() -> None:
    # 4 machines, 16 stages, 4 micro-batches; groups of 1 and 3 machines.
    wl = Workload("w", total_iterations=100, iteration_time_s=1.0, machines=4, pipeline_stages=16, micro_batches=4)
    s = StrategySpec("l", "logging", checkpoint_interval=50, logging=LoggingSpec(groups=(1, 3)))
    paths = recovery_paths(wl, s)
    assert [p.weight for p in paths] == [0.25, 0.75]
    # k = 4 stages: (4 + 3) / (4 + 15); k = 12 stages: (4 + 11) / 19.
    assert [p.replay_s_per_iteration for p in paths] == pytest.approx([7 / 19, 15 / 19])
    x = np.array([0.1, 0.1])  # 10 completed iterations since the checkpoint at 0
    cost = failure_costs_s(wl, s, x, np.array([0.1, 0.9]))
    assert cost == pytest.approx([10 * 7 / 19, 10 * 15 / 19])
    # Parallel recovery divides by floor(machines / group size), the paper's ideal.
    pr = StrategySpec(
        "l", "logging", checkpoint_interval=50, logging=LoggingSpec(groups=(1, 3), parallel_recovery=True)
    )
    assert [p.replay_s_per_iteration for p in recovery_paths(wl, pr)] == pytest.approx([7 / 19 / 4, 15 / 19 / 1])


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 400), st.lists(st.integers(1, 500), max_size=3))
def test_expected_replay_matches_enumeration(n: int, steps: list[int]) -> None:
    j = np.arange(n)
    restore = np.zeros(n)
    for step in steps:
        restore = np.maximum(restore, (j // step) * step)
    assert expected_replay_iterations(n, tuple(steps)) == pytest.approx(float(np.mean(j - restore)))


@settings(max_examples=40, deadline=None)
@given(jobs())
def test_expected_cost_matches_the_monte_carlo_mean(job: tuple[Workload, StrategySpec]) -> None:
    wl, s = job
    # Stratified positions (k + 0.5) / K and machine uniforms: a deterministic quadrature of
    # the same expectation, tight enough to compare without a statistical tolerance.
    k = 20000
    u = (np.arange(k) + 0.5) / k
    machine_u = np.random.default_rng(0).permutation(u)
    mc = float(np.mean(failure_costs_s(wl, s, u, machine_u)))
    exact = expected_failure_cost_s(wl, s)
    # An elastic shrink costs up to the rest of the job over its shrunk speed, on top.
    spread = 1 + (1 / shrunk_throughput(wl, s) if s.kind == "elastic" else 0)
    scale = s.fixed_s + s.grow_s + wl.iteration_time_s * (1 + s.iteration_overhead) * (wl.total_iterations + 1) * spread
    assert abs(mc - exact) <= 2e-3 * scale


# --------------------------------------------------------------------------- monotonicity
@settings(max_examples=60, deadline=None)
@given(jobs(), st.integers(0, 40), st.integers(1, 10), st.integers(0, 2**31 - 1))
def test_more_failures_never_make_a_job_faster(
    job: tuple[Workload, StrategySpec], n: int, extra: int, seed: int
) -> None:
    wl, s = job
    fewer = simulate_samples(wl, s, FailureModel(count=n).sample(wl.compute_s, 3, seed))
    more = simulate_samples(wl, s, FailureModel(count=n + extra).sample(wl.compute_s, 3, seed))
    assert np.all(more >= fewer)


@settings(max_examples=40, deadline=None)
@given(jobs(), st.floats(0.5, 50.0), st.floats(1.0, 4.0), st.integers(0, 2**31 - 1))
def test_poisson_coupling_is_monotone_in_the_rate(
    job: tuple[Workload, StrategySpec], mtbf: float, factor: float, seed: int
) -> None:
    wl, s = job
    rare = FailureModel("exponential", mtbf_hours=mtbf * factor).sample(wl.compute_s, 3, seed)
    often = FailureModel("exponential", mtbf_hours=mtbf).sample(wl.compute_s, 3, seed)
    for a, b in zip(rare, often):
        assert len(b) >= len(a)
        assert np.array_equal(b.positions[: len(a)], a.positions)
    assert np.all(simulate_samples(wl, s, often) >= simulate_samples(wl, s, rare))


# --------------------------------------------------------------------------- failure processes
def test_uniform_count_from_mtbf_rounds_like_the_paper() -> None:
    f = FailureModel(mtbf_hours=17)
    assert [f.expected_count(h) for h in (479.4, 85.6, 461.1)] == [28, 5, 27]
    assert len(f.sample_one(479.4 * 3600, seed=0, repeat=0)) == 28


def test_poisson_quantile() -> None:
    assert poisson_quantile(0.0, 3.0) == 0
    assert poisson_quantile(0.5, 0.0) == 0
    us = (np.arange(4000) + 0.5) / 4000
    for mean in (0.3, 5.0, 60.0, 900.0):
        ks = np.array([poisson_quantile(float(u), mean) for u in us])
        assert np.all(np.diff(ks) >= 0)
        assert ks.mean() == pytest.approx(mean, rel=0.02, abs=0.01)


def test_exponential_median_is_mean_times_ln2() -> None:
    assert FailureModel("exponential", median_hours=math.log(2) * 10).mean_gap_hours == pytest.approx(10)


@pytest.mark.parametrize("shape", [0.7, 1.0, 2.0])
def test_weibull_renewal_rate(shape: float) -> None:
    f = FailureModel("weibull", mtbf_hours=5.0, shape=shape)
    samples = f.sample(1000 * 3600.0, repeats=40, seed=3)
    counts = np.array([len(s) for s in samples])
    # Renewal theorem: about T / mean gaps; a fresh start shifts it by O(1).
    assert abs(counts.mean() - 200) < 12
    assert all(np.all((s.positions >= 0) & (s.positions < 1)) for s in samples)
    assert all(np.all(np.diff(s.positions) > 0) for s in samples)


def test_weibull_median() -> None:
    f = FailureModel("weibull", median_hours=3.0, shape=2.0)
    scale = 3.0 / math.log(2) ** 0.5
    assert f.mean_gap_hours == pytest.approx(scale * math.gamma(1.5))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(count=-1), "count"),
        (dict(count=3, mtbf_hours=2), "exactly one"),
        (dict(), "exactly one"),
        (dict(model="exponential", count=3), "count"),
        (dict(model="weibull", mtbf_hours=3), "shape"),
        (dict(model="exponential", mtbf_hours=3, shape=2), "shape"),
        (dict(mtbf_hours=0), "mtbf_hours"),
        (dict(model="gamma", mtbf_hours=1), "model"),
        (dict(median_hours=3), "median_hours"),
    ],
)
def test_failure_model_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        FailureModel(**kwargs)  # type: ignore[arg-type]


def test_mean_ci() -> None:
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert (lo, hi) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
    assert all(math.isnan(v) for v in mean_ci([5.0])[1:])


def test_strategy_errors() -> None:
    with pytest.raises(ConfigError, match="snapshot_interval"):
        StrategySpec("s", "snapshot")
    with pytest.raises(ConfigError, match="snapshot_interval"):
        StrategySpec("s", "checkpoint", snapshot_interval=3)
    with pytest.raises(ConfigError, match="restart_s"):
        StrategySpec("s", "checkpoint", restart_s=-1)
    with pytest.raises(ConfigError, match="kind"):
        StrategySpec("s", "magic")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="logging.groups"):
        LoggingSpec(groups=(2,), replay_fraction=0.5)
    wl = Workload("w", total_iterations=10, iteration_time_s=1.0, machines=4)
    with pytest.raises(ConfigError, match="add up"):
        recovery_paths(wl, StrategySpec("l", "logging", logging=LoggingSpec(groups=(1, 2))))


def test_parallel_recovery_costs_its_set_up_and_gradient_swap() -> None:
    """Parallel replay (issue 34): the helpers' set-up once per failure, the copies' gradient swap on
    every replayed iteration; neither counts without parallel recovery."""
    wl = Workload("w", total_iterations=100, iteration_time_s=10.0)
    par = LoggingSpec(
        replay_fraction=0.5,
        parallel_recovery=True,
        parallel_speedup=2.0,
        parallel_setup_s=7.0,
        parallel_exchange_s_per_iteration=0.5,
    )
    log = StrategySpec("l", "logging", checkpoint_interval=20, restart_s=100.0, logging=par)
    # 5 iterations replayed and half an iteration in flight (see above): 100 + 7 set-up + 5 + 5 x (10 x 0.5 / 2 + 0.5)
    assert failure_costs_s(wl, log, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(100 + 7 + 5 + 5 * 3.0)
    seq = StrategySpec(
        "s",
        "logging",
        checkpoint_interval=20,
        restart_s=100.0,
        logging=LoggingSpec(replay_fraction=0.5, parallel_setup_s=7.0, parallel_exchange_s_per_iteration=0.5),
    )
    assert failure_costs_s(wl, seq, np.array([0.455]), np.array([0.0]))[0] == pytest.approx(100 + 5 + 5 * 5.0)
    with pytest.raises(ConfigError, match="parallel_setup_s"):
        LoggingSpec(parallel_setup_s=-1.0)
