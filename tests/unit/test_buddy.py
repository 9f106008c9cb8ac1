"""Buddy placement and the buddy strategy's decision (ds_swift.recovery.strategies.buddy), without processes."""

from __future__ import annotations

import threading

import pytest
import torch

from ds_swift.protect.buddy_holdings import BuddyHoldings
from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.holdings import BuddyHeld, holdings_of
from ds_swift.recovery.registry import plan_recovery
from ds_swift.recovery.state.buddies import BuddyError, Member, assign_buddies
from ds_swift.recovery.state.transfer import encode, flat_views
from ds_swift.recovery.strategies.buddy import buddy_target
from ds_swift.testing.configs import swift_config


def pp2_dp2(machines: dict[int, int] | None = None) -> list[Member]:
    """Ranks 0,1 = pipeline of replica 0 on machine 0; ranks 2,3 = replica 1 on machine 1."""
    machines = machines or {0: 0, 1: 0, 2: 1, 3: 1}
    return [Member(r, machines[r], stage=r % 2, dp=r // 2) for r in range(4)]


def test_buddies_are_data_parallel_peers_on_another_machine() -> None:
    assert assign_buddies(pp2_dp2()) == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}


def test_buddies_avoid_the_owners_failure_domain_and_spread_over_machines() -> None:
    members = [Member(r, r, stage=r % 2, dp=r // 2) for r in range(8)]  # 8 machines of one rank
    placement = assign_buddies(members, factor=2, failure_domains=[[0, 2, 4, 6], [1, 3, 5, 7]])
    for owner, buddies in placement.items():
        assert len(set(buddies)) == 2
        assert all(b % 2 != owner % 2 for b in buddies)  # the other domain
        assert len({members[b].machine for b in buddies}) == 2
    load = [sum(r in bs for bs in placement.values()) for r in range(8)]
    assert max(load) - min(load) <= 1


def test_too_few_machines_for_the_factor_is_an_error_naming_the_field() -> None:
    with pytest.raises(BuddyError, match="buddy.replication_factor=3"):
        assign_buddies(pp2_dp2(), factor=3)
    with pytest.raises(BuddyError):
        assign_buddies(pp2_dp2(), failure_domains=[[0, 1]])


def reports(
    stepped: dict[int, int], copies: dict[int, list[tuple[int, int]]], can_undo: bool = True, exact: bool = False
) -> list[RankReport]:
    """pp 2 x dp 2, machine 1 (ranks 2, 3) lost."""
    return [
        RankReport(
            rank=r,
            survivor=r in stepped,
            stage=r % 2,
            dp=r // 2,
            tp=0,
            machine=r // 2,
            last_stepped=stepped.get(r, -1),
            can_undo=can_undo,
            holdings=holdings_of(
                BuddyHeld(copies=tuple(copies.get(r, ())), own=(stepped[r] - 1,) if exact and r in stepped else ())
            ),
        )
        for r in range(4)
    ]


def test_buddy_copies_restore_a_partitioned_optimizer() -> None:
    rs = reports({0: 6, 1: 6}, {0: [(2, 5), (2, 6)], 1: [(3, 6)]})
    plan = plan_recovery(rs, zero_stage=1, partitioned=True)
    assert plan.strategy == "buddy", plan.reason
    assert plan.consensus == 6 and plan.undo == () and plan.donors == {2: 0, 3: 1}
    assert "replica does not hold the partitions" in plan.reason  # why replication could not


def test_a_copy_lagging_one_step_makes_the_survivors_undo() -> None:
    copies = {0: [(2, 5), (2, 6)], 1: [(3, 4), (3, 5)]}
    plan = plan_recovery(reports({0: 6, 1: 6}, copies, exact=True), zero_stage=1, partitioned=True)
    assert plan.strategy == "buddy" and plan.consensus == 5 and plan.undo == (0, 1), plan.reason
    assert "survivors [0, 1] undo to iteration 5 from their own copies of it" in plan.reason
    # Without own copies (the copier's host copies lost), the inverse update: said in the plan.
    plan = plan_recovery(reports({0: 6, 1: 6}, copies), zero_stage=1, partitioned=True)
    assert plan.strategy == "buddy" and plan.undo == (0, 1), plan.reason
    assert "survivors [0, 1] undo to iteration 5 by the inverse update" in plan.reason


def test_a_copy_too_far_behind_or_without_undo_falls_back_loudly() -> None:
    rs = reports({0: 6, 1: 6}, {0: [(2, 6)], 1: [(3, 3), (3, 4)]})
    plan = plan_recovery(rs, zero_stage=1, partitioned=True)
    assert plan.strategy == "checkpoint" and "do not reach the consensus iteration 6" in plan.reason
    rs = reports({0: 6, 1: 6}, {0: [(2, 6)], 1: [(3, 5)]}, can_undo=False)
    assert plan_recovery(rs, zero_stage=1, partitioned=True).strategy == "checkpoint"


def interval_reports(own: dict[int, tuple[int, ...]]) -> list[RankReport]:
    """Copies every 4 iterations (0, 4, 8): survivors 0 and 1 stepped 10, machine 1 lost."""
    copies = {0: [(2, 4), (2, 8)], 1: [(3, 4), (3, 8)]}
    return [
        RankReport(
            rank=r,
            survivor=r < 2,
            stage=r % 2,
            dp=r // 2,
            tp=0,
            machine=r // 2,
            last_stepped=10 if r < 2 else -1,
            can_undo=True,
            holdings=holdings_of(BuddyHeld(copies=tuple(copies.get(r, ())), own=own.get(r, ()))),
        )
        for r in range(4)
    ]


def test_copies_at_an_interval_take_every_rank_back_to_the_newest_common_copy() -> None:
    plan = plan_recovery(interval_reports({0: (4, 8), 1: (4, 8)}), zero_stage=1, partitioned=True)
    assert plan.strategy == "buddy" and plan.consensus == 8 and plan.undo == (0, 1), plan.reason
    assert plan.donors == {2: 0, 3: 1}
    assert "iterations 9..10 are trained again" in plan.reason
    assert "survivors [0, 1] undo to iteration 8 from their own copies of it" in plan.reason
    # A survivor whose own copy of 8 is gone (only 4 held) takes everyone back to 4.
    plan = plan_recovery(interval_reports({0: (4, 8), 1: (4,)}), zero_stage=1, partitioned=True)
    assert plan.strategy == "buddy" and plan.consensus == 4, plan.reason
    assert "iterations 5..10 are trained again" in plan.reason


def test_copies_at_an_interval_without_own_copies_fall_back_saying_why() -> None:
    """Two steps back is beyond update-undo: without own copies, the global checkpoint."""
    plan = plan_recovery(interval_reports({0: (4, 8)}), zero_stage=1, partitioned=True)
    assert plan.strategy == "checkpoint", plan.reason
    assert "do not reach the consensus iteration 10" in plan.reason and "rank 0: [4, 8]" in plan.reason


def test_an_exact_undo_is_judged_at_the_plans_iteration() -> None:
    inputs = RecoveryInputs.agree(interval_reports({0: (4, 8), 1: (8,)}), zero_stage=1, partitioned=True)
    assert inputs.consensus == 10 and inputs.undo == ()
    at8 = inputs.rebased(8)
    assert at8.undo == (0, 1) and at8.cannot_undo == ()
    assert at8.undoes_exactly(0) and at8.undoes_exactly(1)
    assert inputs.undoes_exactly(1, 8) and not inputs.undoes_exactly(1, 4) and inputs.undoes_exactly(0, 4)
    assert inputs.rebased(4).cannot_undo == (1,)
    assert inputs.rebased(9).cannot_undo == ()  # one step back: update-undo's inverse update
    assert not inputs.undoes_exactly(0, 9)
    assert inputs.rebased(7).cannot_undo == (0, 1)  # three back, and no own copy of 7


def test_losing_a_rank_and_its_only_buddy_says_why() -> None:
    rs = reports({0: 6, 1: 6}, {0: [(1, 6)], 1: [(0, 6)]})  # copies of survivors only
    plan = plan_recovery(rs, zero_stage=1, partitioned=True)
    assert plan.strategy == "checkpoint"
    assert "no buddy copy of the optimizer partition of rank(s) [2, 3] survived" in plan.reason


def test_a_copy_on_a_failed_machine_does_not_count() -> None:
    inputs = RecoveryInputs.agree(
        [
            RankReport(0, True, 0, 0, 0, 0, 6, True),
            RankReport(1, False, 0, 1, 0, 1, -1, False, ((0, 6),)),
            RankReport(2, True, 0, 2, 0, 1, 6, True, ((1, 6),)),
        ],
        zero_stage=1,
        partitioned=True,
    )
    assert buddy_target(inputs)[0] is None  # rank 2 sits on machine 1, which failed


def test_unpartitioned_optimizers_stay_with_replication() -> None:
    rs = reports({0: 6, 1: 6}, {})
    assert plan_recovery(rs).strategy == "replication"
    unsupported = plan_recovery(rs, optimizer="DeepSpeedZeroOptimizer_Stage3")
    assert unsupported.strategy == "checkpoint" and "Stage3" in unsupported.reason


def test_report_round_trips_buddy_copies() -> None:
    r = RankReport(1, True, 0, 0, 0, 0, 5, True, holdings_of(BuddyHeld(copies=((2, 4), (2, 5)), own=(0, 4))))
    back = RankReport.from_json(r.to_json())
    assert back == r and BuddyHeld.of(back) == BuddyHeld(copies=((2, 4), (2, 5)), own=(0, 4))


def test_holdings_keep_two_complete_copies_and_never_report_one_being_overwritten() -> None:
    h = BuddyHoldings()
    payload = {"optimizer": {"masters": [torch.arange(4.0)], "step": torch.tensor(3.0)}, "counters": {"g": 1}}
    manifest, tensors = encode(payload)
    assert [v.dtype for v in flat_views(manifest, {torch.float32: torch.empty(5)})] == [torch.float32, torch.float32]
    for version in (4, 5):
        flats = h.spare(7, manifest)
        flats[torch.float32].copy_(torch.cat([t.reshape(-1) for t in tensors]) + version)
        h.put(7, version, manifest, flats)
    assert h.copies() == ((7, 4), (7, 5))
    h.spare(7, manifest)  # a round receiving copy 6 reuses copy 4's buffers
    assert h.copies() == ((7, 5),)
    got = h.state_of(7, 5)
    assert torch.equal(got["optimizer"]["masters"][0], torch.arange(4.0) + 5) and got["counters"] == {"g": 1}
    with pytest.raises(KeyError):
        h.state_of(7, 4)
    assert h.nbytes() == 5 * 4


def test_holdings_are_thread_safe_enough_for_one_writer_and_readers() -> None:
    h = BuddyHoldings()
    manifest, _ = encode({"x": torch.zeros(3)})

    def writer() -> None:
        for v in range(200):
            h.put(1, v, manifest, h.spare(1, manifest))

    t = threading.Thread(target=writer)
    t.start()
    while t.is_alive():
        assert len(h.copies()) <= 2
    t.join()
    assert h.copies() == ((1, 198), (1, 199))


def test_the_buddy_section_of_the_config() -> None:
    from ds_swift.config import ConfigError

    cfg = swift_config({"buddy": {"replication_factor": 2}, "machines": {"failure_domains": [[0, 1], [2]]}})
    assert cfg.buddy.enabled and cfg.buddy.replication_factor == 2
    assert cfg.machines.failure_domains == ((0, 1), (2,))
    for bad, field in (
        ({"buddy": {"replication_factor": 0}}, "buddy.replication_factor"),
        ({"buddy": {"enabled": "yes"}}, "buddy.enabled"),
        ({"machines": {"failure_domains": [[0], [0, 1]]}}, "machines.failure_domains"),
        ({"machines": {"failure_domains": [[]]}}, "machines.failure_domains"),
    ):
        with pytest.raises(ConfigError, match=field):
            swift_config(bad)


def test_the_plan_prices_buddy_copies_per_rank() -> None:
    from ds_swift.config import SwiftConfig
    from ds_swift.plan.buddy_cost import buddy_cost
    from ds_swift.plan.layout import ParallelLayout

    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW"}}
    layout = ParallelLayout(tp=1, pp=2, dp=4, gpus_per_node=8)
    cost = buddy_cost(ds, swift_config({"buddy": {"replication_factor": 2}}), layout, 8e6)
    assert cost.active and cost.partition_bytes == 8_000_000 // 2 // 4 * 12
    # The default interval, "auto", is chosen once the job runs: the plan gives the most it can cost.
    assert cost.interval == "auto" and cost.network_bytes_per_rank_per_iteration == 2 * cost.partition_bytes
    assert "interval auto (bytes: a copy after every step, the most)" in cost.lines()[0][1]
    assert cost.host_bytes_per_rank == 2 * (2 + 1) * cost.partition_bytes  # the buddies' copies and two own
    off = buddy_cost(ds, swift_config({"buddy": {"enabled": False}}), layout, 8e6)
    assert not off.active and "buddy.enabled is false" in off.lines()[0][1]
    replicated = buddy_cost({"optimizer": {"type": "AdamW"}}, SwiftConfig(), layout, 8e6)
    assert not replicated.active and "not partitioned" in replicated.why
    spaced = buddy_cost(ds, swift_config({"buddy": {"replication_factor": 2, "interval": 4}}), layout, 8e6)
    assert spaced.network_bytes_per_rank_per_iteration == 2 * cost.partition_bytes // 4
    assert spaced.host_bytes_per_rank == cost.host_bytes_per_rank and "every 4 iterations" in spaced.lines()[0][1]


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "4", "Auto", None])
def test_a_bad_buddy_interval_is_an_error_naming_the_field(bad: object) -> None:
    from ds_swift.config import ConfigError

    with pytest.raises(ConfigError, match=r"buddy\.interval="):
        swift_config({"buddy": {"interval": bad}})


def test_a_buddy_interval_with_pipechurn_is_refused_not_ignored() -> None:
    from ds_swift.config import ConfigError

    with pytest.raises(ConfigError, match=r"buddy\.interval=4 .*'pipechurn'.*remove buddy\.interval"):
        swift_config({"strategy": "pipechurn", "buddy": {"interval": 4}})
    # "auto", the default, and 1 say nothing pipechurn does not do: a copy after every step.
    for interval in ("auto", 1):
        assert swift_config({"strategy": "pipechurn", "buddy": {"interval": interval}}).buddy.interval == interval
    assert swift_config({"strategy": "pipechurn"}).buddy.fixed_interval is None


def test_immediate_rollback_takes_the_newest_copy_and_undoes_nothing() -> None:
    # Rank 1 stepped iteration 6, rank 0 did not; rank 3's newest copy is of iteration 6, rank 2's of 5.
    rs = reports({0: 5, 1: 6}, {0: [(2, 4), (2, 5)], 1: [(3, 5), (3, 6)]}, can_undo=False)
    plan = plan_recovery(rs, zero_stage=1, partitioned=True, forced="immediate_rollback")
    assert plan.strategy == "immediate_rollback", plan.reason
    assert plan.consensus == 5 and plan.undo == () and plan.donors == {2: 0, 3: 1}
    assert "ranks [1] stepped it already and step it again" in plan.reason
    assert "1->3 (iteration 6)" in plan.reason and "0->2 (iteration 5)" in plan.reason
    # The exact buddy strategy cannot (rank 1 cannot undo), and auto never picks the approximate one.
    assert plan_recovery(rs, zero_stage=1, partitioned=True).strategy == "checkpoint"


def test_immediate_rollback_without_a_source_falls_back_saying_why() -> None:
    rs = reports({0: 6, 1: 6}, {0: [(1, 6)], 1: [(0, 6)]})
    plan = plan_recovery(rs, zero_stage=1, partitioned=True, forced="immediate_rollback")
    assert plan.strategy == "checkpoint" and "no buddy copy of the optimizer partition of rank(s) [2, 3]" in plan.reason
    unpartitioned = plan_recovery(reports({0: 6, 1: 7}, {}), forced="immediate_rollback")
    assert unpartitioned.strategy == "immediate_rollback" and unpartitioned.donors == {2: 0, 3: 1}
