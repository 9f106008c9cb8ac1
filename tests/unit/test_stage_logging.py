"""Issue 34, items 1 and 4, the pure side: each logging stage's kind (messages or updates) and
whether logging pays there, decided from the first iteration's measured figures
(ds_swift.plan.stage_logging through ds_swift.plan.budget), and recovery choosing per lost stage
by its kind (the registry: TranLogs for update stages, the replay for message stages). No process group."""

from __future__ import annotations

from typing import Any

import pytest

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.budget import conservative_plan, decide, describe
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import MeasuredSizes
from ds_swift.plan.stage_logging import first_kinds
from ds_swift.recovery.consensus import LoggingSetup, RankReport
from ds_swift.recovery.registry import plan_recovery

PP4_ON_4 = ParallelLayout(pp=4, gpus_per_node=1)  # one stage per machine
B = 131_568  # one send's logged bytes per iteration (act or grad), as the tiny GPT measured them
PARAMS = 10**6  # per stage: its state is 16 MB


def config(kinds: Any = "auto", **swift: Any) -> SwiftConfig:
    return SwiftConfig.from_dict(
        {"machines": {"gpus_per_node": 1}, "logging": {"kinds": kinds}, "checkpoint": {"interval": 8}, **swift}
    )


def measured(update_bytes: list[int], nbytes: int = B, copy_gbps: float | None = None) -> MeasuredSizes:
    """pp 4: each rank logs its sends to its neighbours and (kinds auto) its updates."""
    reports = [
        {
            "rank": r,
            "iteration": 0,
            "sends": [[q, nbytes] for q in (r - 1, r + 1) if 0 <= q < 4],
            "seconds": 2.0,
            "params": PARAMS,
            "stage": r,
            "update_bytes": update_bytes[r],
            "copy_gbps": copy_gbps,
        }
        for r in range(4)
    ]
    return MeasuredSizes.from_reports(reports, micro_batches=4)


def test_auto_takes_per_stage_the_fewer_bytes_measured_so_one_job_logs_both_kinds() -> None:
    cfg = config()
    first = conservative_plan(PP4_ON_4, cfg)
    # before measuring, every stage recovered by logging logs both kinds (the first iteration serves either)
    assert first_kinds(cfg.logging.kinds, first) == {s: {"messages", "updates"} for s in range(4)}
    # inbound messages: stage 0 and 3 receive one send (B), stages 1 and 2 two (2B)
    m = measured([10 * B, B, 3 * B, B // 2])
    plan, decisions = decide(PP4_ON_4, cfg, m)
    assert [d.kind for d in decisions] == ["messages", "updates", "messages", "updates"]
    assert plan.update_stages == {1, 3} and plan.replay_stages == {0, 2}
    assert set(plan.stage_strategy.values()) == {"logging"}
    # sends into update stages are not logged any more; sends into message stages still are
    assert {(e.src_rank, e.dst_rank) for e in plan.logged_edges} == {(1, 0), (1, 2), (3, 2)}
    lines = describe(plan, cfg, decisions)
    assert (
        f"{3 * B} bytes of messages and {B + B // 2} bytes of updates (stages [1, 3]) logged per iteration" in lines[0]
    )
    line = lines[-1]
    assert line.startswith("per-stage logging (measured in iteration 0, iteration 2 s): stage 0: messages (")
    assert "stage 1: updates (updates 0.132 MB < inbound messages 0.263 MB; pays: < its state 16 MB" in line
    assert "no device-to-host copy (CPU training)" in line
    # the default logs messages everywhere, as before
    plan, decisions = decide(PP4_ON_4, config("messages"), m)
    assert not plan.update_stages and len(plan.logged_edges) == 6
    assert {d.kind for d in decisions} == {"messages"}


def test_a_stage_where_logging_does_not_pay_is_not_logged_and_the_line_says_why() -> None:
    cfg = config("messages")
    # the middle stages' inbound logs (2 x 10 MB) are bigger than a checkpoint of them (16 MB): they
    # recover from the checkpoint; the end stages' (10 MB) are not, and stay logged
    plan, decisions = decide(PP4_ON_4, cfg, measured([0] * 4, nbytes=10 * PARAMS))
    assert plan.worth_logging[0]  # the whole plan's verdict (60 MB < 64 MB of model state) says yes
    assert plan.stage_strategy == {0: "logging", 1: "checkpoint", 2: "checkpoint", 3: "logging"}
    assert {(e.src_rank, e.dst_rank) for e in plan.logged_edges} == {(1, 0), (2, 3)}
    assert decisions[1].reason.endswith(
        "not logged: 20 MB per iteration is not smaller than its state 16 MB (a checkpoint of it every iteration "
        "would write less)"
    )
    # a per-stage verdict: one stage's messages too big for the bubbles, the others fit
    m = measured([0] * 4, copy_gbps=0.001)  # bubbles 3/7 x 2 s x 1 MB/s = 0.857 MB
    small = decide(PP4_ON_4, cfg, m)[1]
    assert all(d.kind == "messages" for d in small)
    assert "fits in the bubbles (0.857 s x 0.001 GB/s)" in small[0].reason
    m = measured([0] * 4, nbytes=500_000, copy_gbps=0.001)  # the middle ranks copy 1 MB: every stage's sender
    plan, decisions = decide(PP4_ON_4, cfg, m)
    assert plan.worth_logging[0]  # (the whole plan's verdict has no bandwidth to check against)
    assert [d.kind for d in decisions] == [None] * 4
    assert set(plan.stage_strategy.values()) == {"checkpoint"} and not plan.logged_edges
    assert decisions[1].reason.endswith(
        "not logged: 1 MB per rank per iteration does not fit in the bubbles (0.857 s x 0.001 GB/s = 0.857 MB)"
    )
    line = describe(plan, cfg, decisions)[-1]
    assert "stage 1: nothing (logging.kinds=messages: inbound messages 1 MB; not logged: 1 MB per rank" in line
    # strategy logging keeps them logged, and says so
    forced = config("messages", strategy="logging")
    plan, decisions = decide(PP4_ON_4, forced, m)
    assert set(plan.stage_strategy.values()) == {"logging"} and len(plan.logged_edges) == 6
    assert decisions[1].reason.endswith('"strategy": "logging" keeps it logged')


def test_stages_sharing_a_logging_group_are_decided_together() -> None:
    pp4_on_2 = ParallelLayout(pp=4, gpus_per_node=2)  # machine 0: stages 0, 1; machine 1: stages 2, 3
    reports = [
        {
            "rank": r,
            "iteration": 0,
            "sends": [[q, B] for q in (r - 1, r + 1) if q in (1, 2) and r in (1, 2)],
            "seconds": 1.0,
            "params": PARAMS,
            "stage": r,
            "update_bytes": B // 4,
        }
        for r in range(4)
    ]
    m = MeasuredSizes.from_reports(reports, 4)
    plan, decisions = decide(pp4_on_2, config(), m)
    assert [d.stages for d in decisions] == [(0, 1), (2, 3)]
    assert [d.kind for d in decisions] == ["updates", "updates"]  # B/2 of updates < B of messages, per group
    with pytest.raises(ConfigError, match=r"logging.kinds gives stages \[0, 1\] different kinds"):
        decide(pp4_on_2, config(["updates", "messages", "messages", "messages"]), m)


def test_the_kinds_config_is_checked_naming_the_field() -> None:
    assert config(["messages", "updates", "messages", "updates"]).logging.kinds == (
        "messages",
        "updates",
        "messages",
        "updates",
    )
    for bad in ("both", [], ["messages", "activations"]):
        with pytest.raises(ConfigError, match="logging.kinds"):
            config(bad)
    with pytest.raises(ConfigError, match="logging.kinds has 2 entries for 4 pipeline stages"):
        decide(PP4_ON_4, config(["messages", "updates"]), measured([0] * 4))


def reports_pp4(lost_machine: int) -> list[RankReport]:
    return [
        RankReport(
            rank=r,
            survivor=r != lost_machine,
            stage=r,
            dp=0,
            tp=0,
            machine=r,
            last_stepped=-1 if r == lost_machine else 11,
            can_undo=True,
        )
        for r in range(4)
    ]


@pytest.mark.parametrize("forced", ["auto", "logging"])
def test_recovery_restores_each_lost_stage_from_its_kind(forced: str) -> None:
    setup = LoggingSetup(frozenset({0, 2}), ((0,), (1,), (2,), (3,)), 8, update_stages=frozenset({1, 3}))
    upd = plan_recovery(reports_pp4(1), forced=forced, logging=setup)
    assert upd.strategy == "tranlogs" and upd.replay_ranks == (1,) and upd.replay_from == 8
    msg = plan_recovery(reports_pp4(2), forced=forced, logging=setup)
    assert msg.strategy == "logging" and msg.replay_ranks == (2,)
    if forced == "auto":  # (the update log is asked first: it is cheaper)
        assert "stage(s) [2] of the lost ranks do not log their updates" in msg.reason
    # without update stages the update log is never asked (nothing logged it)
    plain = LoggingSetup(frozenset(range(4)), ((0,), (1,), (2,), (3,)), 8)
    assert plan_recovery(reports_pp4(1), forced=forced, logging=plain).strategy == "logging"


def test_the_simulator_prices_each_groups_kind_and_the_bench_runs_the_mix() -> None:
    from ds_swift.bench.run import strategy_overrides
    from ds_swift.sim.model import LoggingSpec, StrategySpec, Workload, recovery_paths

    job = Workload("pp4", 1000, 2.0, machines=4, pipeline_stages=4, micro_batches=4)
    spec = LoggingSpec(kinds=("messages", "updates", "none", "messages"), apply_fraction=0.05)
    paths = recovery_paths(job, StrategySpec("mix", "logging", logging=spec))
    # a message group replays its stage's share (m + k - 1) / (m + p - 1) = 4/7; an update group
    # re-applies at 5 % of an iteration; a group where logging did not pay rolls everyone back
    assert [p.replay_s_per_iteration for p in paths] == pytest.approx([2.0 * 4 / 7, 0.1, 2.0, 2.0 * 4 / 7])
    assert [p.weight for p in paths] == [0.25] * 4
    with pytest.raises(ConfigError, match="logging.kinds"):
        recovery_paths(job, StrategySpec("mix", "logging", logging=LoggingSpec(kinds=("updates",))))
    with pytest.raises(ConfigError, match="logging.kinds"):
        LoggingSpec(kinds=("activations",))
    # ds-swift bench's logging_mix row: half the stages log messages, half their updates
    assert strategy_overrides("logging_mix", 8, pp=4) == {
        "strategy": "logging",
        "logging": {"kinds": ["messages", "messages", "updates", "updates"]},
        "checkpoint": {"interval": 8},
    }
