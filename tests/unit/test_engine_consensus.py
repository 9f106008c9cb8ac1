"""The recovery decision (ds_swift.recovery.consensus + registry): consensus, undo, donors, fallback."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.recovery.consensus import RankReport
from ds_swift.recovery.registry import plan_recovery


def pp2_dp2(last: dict[int, int], lost_machine: int = 1, can_undo: bool = True) -> list[RankReport]:
    """4 ranks, 'tp-pp-dp' order: machine 0 = ranks 0,1 (pipeline 0), machine 1 = ranks 2,3 (its replica)."""
    reports = []
    for rank in range(4):
        machine = rank // 2
        survivor = machine != lost_machine
        reports.append(
            RankReport(
                rank=rank,
                survivor=survivor,
                stage=rank % 2,
                dp=rank // 2,
                tp=0,
                machine=machine,
                last_stepped=last.get(rank, -1) if survivor else -1,
                can_undo=can_undo and survivor,
            )
        )
    return reports


def test_replication_pairs_each_lost_rank_with_its_replica() -> None:
    plan = plan_recovery(pp2_dp2({0: 6, 1: 6}))
    assert plan.strategy == "replication"
    assert plan.consensus == 6 and plan.pre_failure_iteration == 7
    assert plan.donors == {2: 0, 3: 1}
    assert plan.undo == ()
    assert plan.recipients_of(0) == [2] and plan.donor_of(3) == 1


def test_a_survivor_ahead_by_one_undoes() -> None:
    plan = plan_recovery(pp2_dp2({0: 6, 1: 7}))
    assert plan.strategy == "replication"
    assert plan.consensus == 6
    assert plan.undo == (1,)


def test_without_undo_a_survivor_ahead_forces_the_checkpoint() -> None:
    plan = plan_recovery(pp2_dp2({0: 6, 1: 7}, can_undo=False))
    assert plan.strategy == "checkpoint"
    assert "cannot undo" in plan.reason


def test_two_steps_ahead_cannot_be_undone() -> None:
    plan = plan_recovery(pp2_dp2({0: 5, 1: 7}))
    assert plan.strategy == "checkpoint"


def test_pipeline_only_has_no_donor() -> None:
    # pp 4 on 2 machines: stages 2 and 3 (machine 1) have no replica anywhere.
    reports = [
        RankReport(rank=r, survivor=r < 2, stage=r, dp=0, tp=0, machine=r // 2, last_stepped=11 if r < 2 else -1)
        for r in range(4)
    ]
    plan = plan_recovery(reports)
    assert plan.strategy == "checkpoint"
    assert "no surviving data-parallel replica of stage(s) [2, 3]" in plan.reason


def test_zero1_partitions_force_the_checkpoint() -> None:
    plan = plan_recovery(pp2_dp2({0: 6, 1: 6}), zero_stage=1)
    assert plan.strategy == "checkpoint"
    assert "ZeRO stage 1" in plan.reason


def test_forced_strategies() -> None:
    assert plan_recovery(pp2_dp2({0: 6, 1: 6}), forced="checkpoint").strategy == "checkpoint"
    assert plan_recovery(pp2_dp2({0: 6, 1: 6}), forced="logging").strategy == "checkpoint"
    assert plan_recovery(pp2_dp2({0: 6, 1: 6}), forced="replication").strategy == "replication"


def test_donor_on_the_failed_machine_is_refused() -> None:
    # 'tp-dp-pp' order: both replicas of a stage share a machine; losing it loses the stage.
    reports = [
        RankReport(rank=r, survivor=r < 2, stage=r // 2, dp=r % 2, tp=0, machine=r // 2, last_stepped=3)
        for r in range(4)
    ]
    assert plan_recovery(reports).strategy == "checkpoint"


def test_no_survivor() -> None:
    reports = [RankReport(rank=r, survivor=False, stage=r, dp=0, tp=0, machine=r) for r in range(2)]
    assert plan_recovery(reports).strategy == "checkpoint"


def test_report_round_trips_through_json() -> None:
    r = RankReport(rank=3, survivor=True, stage=1, dp=1, tp=0, machine=1, last_stepped=9, can_undo=True)
    assert RankReport.from_json(r.to_json()) == r


@st.composite
def jobs(draw: st.DrawFn) -> list[RankReport]:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    per_machine = draw(st.sampled_from([1, 2, 4]))
    lost = draw(st.integers(0, (pp * dp - 1) // per_machine))
    base = draw(st.integers(0, 50))
    reports = []
    for rank in range(pp * dp):
        machine = rank // per_machine
        survivor = machine != lost
        ahead = draw(st.integers(0, 1))
        reports.append(
            RankReport(
                rank=rank,
                survivor=survivor,
                stage=rank % pp,
                dp=rank // pp,
                tp=0,
                machine=machine,
                last_stepped=base + ahead if survivor else -1,
                can_undo=True,
            )
        )
    return reports


@settings(max_examples=200, deadline=None)
@given(jobs())
def test_plan_invariants(reports: list[RankReport]) -> None:
    plan = plan_recovery(reports)
    by_rank = {r.rank: r for r in reports}
    survivors = [r for r in reports if r.survivor]
    if not survivors:
        assert plan.strategy == "checkpoint"
        return
    assert plan.consensus == min(r.last_stepped for r in survivors)
    assert set(plan.undo) == {r.rank for r in survivors if r.last_stepped > plan.consensus}
    # The same reports in any order give the same plan: every rank decides alone.
    assert plan_recovery(list(reversed(reports))) == plan
    if plan.strategy == "replication":
        assert set(plan.donors) == set(plan.replacements)
        for lost, donor in plan.donors.items():
            assert by_rank[donor].survivor
            assert by_rank[donor].stage == by_rank[lost].stage
            assert by_rank[donor].machine != by_rank[lost].machine
    else:
        stages_with_replica = all(any(s.stage == by_rank[r].stage for s in survivors) for r in plan.replacements)
        assert not stages_with_replica or not plan.replacements


def test_an_optimizer_wrapper_forces_the_checkpoint() -> None:
    plan = plan_recovery(pp2_dp2({0: 6, 1: 6}), optimizer="BF16_Optimizer")
    assert plan.strategy == "checkpoint" and "BF16_Optimizer" in plan.reason


def test_a_later_declarer_completes_a_declaration_whose_writer_died() -> None:
    from ds_swift.jobstore.membership import JobStore

    store = JobStore.host("tok-repair")
    # the first declarer got its counter in, then died before writing the flag and the bump
    store.kv.add("gen0/failed_n", 1)
    assert store.failure(0) is None and store.generation() == 0
    assert store.declare_failure(0, "machine 1 died") is False  # not first...
    assert store.failure(0) == "machine 1 died"  # ...but the flag is there now
    assert store.generation() == 1
    # repeating it changes nothing, and never moves the generation backwards
    store.declare_failure(0, "again")
    assert store.failure(0) == "machine 1 died" and store.generation() == 1
