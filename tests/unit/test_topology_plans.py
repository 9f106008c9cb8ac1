"""Topology analyzer: the plans and their bytes (paper figures, strategies, the section 5.4 verdict,
the storage budget, invariants); layouts and conversions: tests/unit/test_topology.py."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_swift.config import ConfigError
from ds_swift.plan.analysis import analyze, analyze_config
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import Edge, ModelShape

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
BERT = ModelShape(hidden=1024, seq_len=128, micro_batch_size=128, micro_batches=4, dtype="fp32")
VIT = ModelShape(hidden=1024, seq_len=49, micro_batch_size=256, micro_batches=16, dtype="fp32")


# ---------------------------------------------------------------------------- plans: paper figures
@pytest.mark.parametrize(
    ("shape", "groups", "gb"),
    [(BERT, 16, 8.05), (BERT, 8, 3.76), (VIT, 16, 24.66), (VIT, 8, 11.51)],
)
def test_table3_logging_sizes(shape: ModelShape, groups: int, gb: float) -> None:
    plan = analyze(ParallelLayout(tp=1, pp=128, dp=1, gpus_per_node=8), shape, groups=groups)
    assert round(plan.log_bytes_per_iteration / 1e9, 2) == gb
    # exactly: (groups - 1) boundaries, an activation and a gradient per micro-batch each
    assert plan.log_bytes_per_iteration == (groups - 1) * 2 * shape.micro_batches * shape.message_bytes
    assert len(plan.groups) == groups and set(plan.stage_strategy.values()) == {"logging"}


def test_megatron_figure2_replicas_on_one_machine_is_logging() -> None:
    lay = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8, order="tp-dp-pp")
    shape = ModelShape(hidden=1024, seq_len=128, micro_batch_size=4, micro_batches=8, dtype="bf16")
    plan = analyze(lay, shape)
    assert plan.stage_strategy == {0: "logging", 1: "logging", 2: "logging", 3: "logging"}
    assert plan.groups == [[0], [1]]
    # stage 1 (ranks 4-7, machine 0) sends activations to stage 2 (ranks 8-11, machine 1); the
    # gradients come back; one pair per TP rank and data-parallel replica
    acts = sorted((e.src_rank, e.dst_rank) for e in plan.logged_edges if e.kind == "act")
    grads = sorted((e.src_rank, e.dst_rank) for e in plan.logged_edges if e.kind == "grad")
    assert acts == [(4, 8), (5, 9), (6, 10), (7, 11)]
    assert grads == [(8, 4), (9, 5), (10, 6), (11, 7)]
    assert plan.is_logged(4, 8) and plan.is_logged(8, 4)
    assert not plan.is_logged(0, 4) and not plan.is_logged(8, 12) and not plan.is_logged(4, 9)
    assert plan.log_bytes_per_iteration == 8 * 8 * shape.message_bytes
    assert all(e.src_stage in (1, 2) and abs(e.src_stage - e.dst_stage) == 1 for e in plan.logged_edges)


def test_buddy_copies_of_the_partitions_restore_a_stage_without_replicas_and_nothing_is_logged() -> None:
    """Figure 2's layout under ZeRO-1 with buddy copies: every rank's partition is held on the other
    machine, so the copies restore any one lost machine exactly; auto logs nothing for it, and says
    why. A forced ``logging`` still logs (it recovers from the log, not the copies)."""
    lay = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8, order="tp-dp-pp")
    shape = ModelShape(hidden=1024, seq_len=128, micro_batch_size=4, micro_batches=8, dtype="bf16")
    copied = analyze(lay, shape, partition_copies=True)
    assert copied.stage_strategy == {0: "replication", 1: "replication", 2: "replication", 3: "replication"}
    assert copied.logged_edges == [] and copied.log_bytes_per_iteration == 0
    assert any("stages [0, 1, 2, 3] have no data-parallel replica" in n and "buddy copies" in n for n in copied.notes)
    forced = analyze(lay, shape, strategy="logging", partition_copies=True)
    assert (
        set(forced.stage_strategy.values()) == {"logging"}
        and forced.log_bytes_per_iteration == 8 * 8 * shape.message_bytes
    )
    # where data-parallel replicas already spread, the copies change nothing (and say nothing)
    spread = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8, order="tp-pp-dp")
    assert analyze(spread, shape, partition_copies=True) == analyze(spread, shape)


def test_megatron_figure2_replicas_spread_is_replication() -> None:
    lay = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8, order="tp-pp-dp")
    plan = analyze(lay, BERT)
    assert set(plan.stage_strategy.values()) == {"replication"}
    assert plan.logged_edges == [] and plan.log_bytes_per_iteration == 0
    assert plan.worth_logging[0] is False


# ---------------------------------------------------------------------------- strategies
def test_forced_strategies() -> None:
    spread = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8, order="tp-pp-dp")
    packed = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8)
    assert set(analyze(packed, BERT, strategy="checkpoint").stage_strategy.values()) == {"checkpoint"}
    assert analyze(packed, BERT, strategy="checkpoint").log_bytes_per_iteration == 0
    with pytest.raises(ConfigError, match="strategy='replication'.*stage 0"):
        analyze(packed, strategy="replication")
    # spread replicas, stages 0-3 on each machine: no pipeline send crosses machines
    with pytest.raises(ConfigError, match="strategy='logging'"):
        analyze(spread, strategy="logging")
    with pytest.raises(ConfigError, match="pp > 1"):
        analyze(ParallelLayout(dp=16, gpus_per_node=8), strategy="logging")
    with pytest.raises(ConfigError, match="strategy='bogus'"):
        analyze(packed, strategy="bogus")


def test_replication_and_logging_mix() -> None:
    # pp=4, dp=2, 2 ranks per machine, order pp-dp-tp... here tp-pp-dp with dp spread makes stage
    # replicas live on other machines -> replication everywhere, even with cross-machine sends
    lay = ParallelLayout(pp=4, dp=2, gpus_per_node=2, order="tp-pp-dp")
    plan = analyze(lay, BERT)
    assert set(plan.stage_strategy.values()) == {"replication"}
    # forcing logging logs the cross-machine sends instead
    forced = analyze(lay, BERT, strategy="logging")
    assert set(forced.stage_strategy.values()) == {"logging"}
    assert forced.log_bytes_per_iteration == 2 * 2 * BERT.micro_batches * BERT.message_bytes


def test_stage_split_over_machines_groups_whole_stages() -> None:
    # tp=16 on 8-GPU machines: each stage spans two machines and sends skip a machine; group
    # boundaries may only fall between stages
    lay = ParallelLayout(tp=16, pp=4, dp=1, gpus_per_node=8)
    plan = analyze(lay, BERT)
    assert plan.groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert set(plan.stage_strategy.values()) == {"logging"}
    assert plan.log_bytes_per_iteration == 3 * 16 * 2 * BERT.micro_batches * BERT.message_bytes
    with pytest.raises(ConfigError, match="groups=5 is invalid: at most 4"):
        analyze(lay, BERT, groups=5)


def test_single_group_logs_nothing() -> None:
    plan = analyze(ParallelLayout(pp=16, gpus_per_node=8), BERT, groups=1)
    assert plan.log_bytes_per_iteration == 0 and set(plan.stage_strategy.values()) == {"checkpoint"}


# ---------------------------------------------------------------------------- verdict (section 5.4)
def test_worth_logging_bubble_fit() -> None:
    lay = ParallelLayout(pp=128, gpus_per_node=8)
    per_gpu = BERT.micro_batches * BERT.message_bytes  # one boundary send per sending GPU
    bubble = 127 / (4 + 127)
    # capacity = bubble * t * bw: choose t so that it is exactly 10% above / below the need
    t_fit = per_gpu * 1.1 / (bubble * 16e9)
    t_tight = per_gpu * 0.9 / (bubble * 16e9)
    fit = analyze(lay, BERT, groups=16, iteration_time_s=t_fit, pcie_gbps=16)
    assert fit.worth_logging[0] is True and "fits in the bubbles" in fit.worth_logging[1]
    assert math.isclose(fit.bubble_ratio or 0, bubble)
    tight = analyze(lay, BERT, groups=16, iteration_time_s=t_tight, pcie_gbps=16)
    assert tight.worth_logging[0] is False and "does not fit" in tight.worth_logging[1]
    # auto drops logging when it is not worth it, but says what it would have cost
    assert tight.log_bytes_per_iteration == 0 and set(tight.stage_strategy.values()) == {"checkpoint"}
    assert tight.candidate_log_bytes_per_iteration == fit.log_bytes_per_iteration
    # a forced strategy keeps logging and says so
    forced = analyze(lay, BERT, strategy="logging", groups=16, iteration_time_s=t_tight, pcie_gbps=16)
    assert forced.log_bytes_per_iteration == fit.log_bytes_per_iteration
    assert any("overrides" in n for n in forced.notes)


def test_worth_logging_model_state() -> None:
    lay = ParallelLayout(pp=128, gpus_per_node=8)
    total = 15 * 2 * BERT.micro_batches * BERT.message_bytes
    small = ModelShape(**{**BERT.__dict__, "num_params": total // 16 - 1})
    big = ModelShape(**{**BERT.__dict__, "num_params": total // 16 + 1})
    no = analyze(lay, small, groups=16, checkpoint_interval=100)
    assert no.worth_logging[0] is False and "model state" in no.worth_logging[1]
    yes = analyze(lay, big, groups=16, checkpoint_interval=100)
    assert yes.worth_logging[0] is True and "between checkpoints" in yes.worth_logging[1]


def test_worth_logging_unknowns_are_reported() -> None:
    plan = analyze(ParallelLayout(pp=16, gpus_per_node=8))
    assert plan.worth_logging[0] is True and "shape unknown" in plan.worth_logging[1]
    assert analyze(ParallelLayout(dp=16, gpus_per_node=8)).worth_logging == (
        False,
        "no pipeline parallelism (pp=1): there are no pipeline sends to log",
    )


# ---------------------------------------------------------------------------- budget -> optimiser
def test_storage_budget_runs_the_exact_optimiser() -> None:
    lay = ParallelLayout(pp=128, gpus_per_node=8)
    boundary = 2 * BERT.micro_batches * BERT.message_bytes
    budget_gb = 7 * boundary * 100 / 1e9  # exactly 7 boundaries for 100 iterations
    plan = analyze(lay, BERT, storage_budget_gb=budget_gb, checkpoint_interval=100)
    assert plan.grouping_method == "exact" and plan.exact is not None and plan.greedy is not None
    assert plan.log_bytes_per_iteration == 7 * boundary and len(plan.groups) == 8
    assert plan.exact.recovery_time <= plan.greedy.recovery_time and plan.exact.optimal
    # groups partition the machines into contiguous runs
    assert [m for g in plan.groups for m in g] == list(range(16))
    tiny = analyze(lay, BERT, storage_budget_gb=1e-3, checkpoint_interval=100)
    assert tiny.groups == [list(range(16))] and tiny.log_bytes_per_iteration == 0
    assert any("no grouping fits" in n for n in tiny.notes)
    with pytest.raises(ConfigError, match="checkpoint_interval"):
        analyze(lay, BERT, storage_budget_gb=10)
    with pytest.raises(ConfigError, match="both set"):
        analyze(lay, BERT, groups=2, storage_budget_gb=10, checkpoint_interval=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"groups": 0}, "groups=0"),
        ({"storage_budget_gb": -1.0, "checkpoint_interval": 1}, "storage_budget_gb=-1.0"),
        ({"iteration_time_s": float("nan")}, "iteration_time_s=nan"),
        ({"pcie_gbps": 0}, "pcie_gbps=0"),
        ({"checkpoint_interval": -5}, "checkpoint_interval=-5"),
        ({"stage_compute_s": [1.0, 2.0]}, "stage_compute_s"),
    ],
)
def test_bad_analyze_arguments_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        analyze(ParallelLayout(pp=16, gpus_per_node=8), BERT, **kwargs)
    assert field in str(err.value)


def test_model_shape_validation() -> None:
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        ModelShape(hidden=1, seq_len=1, micro_batch_size=1, micro_batches=1, dtype="fp8")
    with pytest.raises(ConfigError, match="micro_batches=0"):
        ModelShape(hidden=1, seq_len=1, micro_batch_size=1, micro_batches=0)
    assert ModelShape(hidden=3, seq_len=5, micro_batch_size=7, micro_batches=1, dtype="bf16").message_bytes == 210


# ---------------------------------------------------------------------------- invariants
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.integers(1, 12),
    dp=st.sampled_from([1, 2, 4]),
    gpn=st.sampled_from([1, 2, 4, 8]),
    order=st.sampled_from(ORDERS),
    data=st.data(),
)
def test_plan_invariants(tp: int, pp: int, dp: int, gpn: int, order: str, data: st.DataObject) -> None:
    world = tp * pp * dp
    if world > gpn and world % gpn:
        return
    lay = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=gpn, order=order)
    shape = ModelShape(hidden=8, seq_len=4, micro_batch_size=2, micro_batches=3, dtype="fp16")
    groups = data.draw(st.one_of(st.none(), st.integers(1, lay.num_machines)))
    try:
        plan = analyze(lay, shape, groups=groups)
    except ConfigError as exc:
        assert "at most" in str(exc)  # more groups than separable machine runs
        return
    assert [m for g in plan.groups for m in g] == list(range(lay.num_machines))
    assert plan.log_bytes_per_iteration == sum(e.bytes_per_iteration for e in plan.logged_edges)
    for e in plan.logged_edges:
        assert isinstance(e, Edge) and abs(e.src_stage - e.dst_stage) == 1
        assert e.kind == ("act" if e.dst_stage == e.src_stage + 1 else "grad")
        assert plan.group_of_machine(plan.machine_of(e.src_rank)) != plan.group_of_machine(plan.machine_of(e.dst_rank))
        assert plan.is_logged(e.src_rank, e.dst_rank)
        assert plan.stage_strategy[e.dst_stage] == "logging"
    for s, strategy in plan.stage_strategy.items():
        replicas_elsewhere = all(
            any(lay.machine_of(q) != lay.machine_of(r) for q in lay.dp_peers(r)) for r in lay.stage_ranks(s)
        )
        assert (strategy == "replication") == replicas_elsewhere
    # with one group per machine every cross-machine send into a non-replicated stage is logged
    if groups is None and pp > 1 and len(plan.groups) == lay.num_machines:
        expected = 0
        for s in range(pp - 1):
            for r in lay.stage_ranks(s):
                c = lay.coords(r)
                q = lay.rank(tp=c.tp, pp=s + 1, dp=c.dp)
                if lay.machine_of(r) != lay.machine_of(q):
                    expected += (plan.stage_strategy[s + 1] == "logging") + (plan.stage_strategy[s] == "logging")
        assert plan.log_bytes_per_iteration == expected * shape.micro_batches * shape.message_bytes
    js = plan.to_json()
    assert js["log_bytes_per_iteration"] == plan.log_bytes_per_iteration
    assert [s["strategy"] for s in js["stages"]] == [plan.stage_strategy[s] for s in range(pp)]


def test_analyze_config_takes_the_swift_section() -> None:
    from ds_swift.config import SwiftConfig

    lay = ParallelLayout(pp=128, gpus_per_node=8)
    cfg = SwiftConfig.from_dict({"logging": {"groups": 8}, "checkpoint": {"interval": 10}})
    assert (
        analyze_config(lay, cfg, BERT).log_bytes_per_iteration == analyze(lay, BERT, groups=8).log_bytes_per_iteration
    )
    forced = analyze_config(lay, SwiftConfig.from_dict({"strategy": "checkpoint"}), BERT)
    assert set(forced.stage_strategy.values()) == {"checkpoint"}
    budget = SwiftConfig.from_dict({"logging": {"storage_budget_gb": 100.0}, "checkpoint": {"interval": 10}})
    plan = analyze_config(lay, budget, BERT, iteration_time_s=1.0)
    assert plan.grouping_method == "exact" and plan.log_bytes_per_iteration * 10 <= 100e9
