"""The recovery-strategy registry (ds_swift.recovery.base/registry): chosen by capability and cost."""

from __future__ import annotations

import dataclasses

import pytest

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import LoggingSetup, RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import MessageLogHeld, holdings_of
from ds_swift.recovery.registry import STRATEGIES, plan_recovery


def pipeline_only(lost_machine: int = 1, last: int = 11) -> list[RankReport]:
    """pp 4 on 2 machines, one replica: a lost machine's stages have no donor anywhere."""
    return [
        RankReport(
            rank=r,
            survivor=r // 2 != lost_machine,
            stage=r,
            dp=0,
            tp=0,
            machine=r // 2,
            last_stepped=-1 if r // 2 == lost_machine else last,
            can_undo=True,
        )
        for r in range(4)
    ]


class SnapshotStrategy(RecoveryStrategy):
    """A dummy: restores any lost rank whose stage is in ``stages``, at a given cost."""

    name = "snapshot"

    def __init__(self, stages: set[int], cost: float) -> None:
        self.stages, self.cost = stages, cost

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        missing = sorted({inputs.by_rank[r].stage for r in inputs.replacements} - self.stages)
        return f"no snapshot of stage(s) {missing}" if missing else None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return self.cost

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        return inputs.plan(self.name, "every lost stage has a snapshot")

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        return RecoveryOutcome(plan, plan.consensus + 1)


def test_the_defaults_are_ordered_by_cost_with_the_checkpoint_last() -> None:
    inputs = RecoveryInputs.agree(pipeline_only(), checkpoint_step=8)
    assert [s.name for s in STRATEGIES.candidates(inputs)] == ["replication", "buddy", "logging"]
    assert STRATEGIES.names()[-1] == "checkpoint"


def test_a_registered_strategy_is_chosen_by_capability_and_cost() -> None:
    registry = STRATEGIES.copy()
    registry.register(SnapshotStrategy({2, 3}, cost=0.5))  # the one line a new strategy needs
    setup = LoggingSetup(frozenset(range(4)), ((0,), (1,)), checkpoint_step=8)
    # Replication cannot (no replica); the snapshot can, and costs less than the replay.
    plan = plan_recovery(pipeline_only(), logging=setup, registry=registry)
    assert plan.strategy == "snapshot"
    assert plan.reason == (
        "no surviving data-parallel replica of stage(s) [2, 3] (ranks [2, 3]); the optimizer state is not "
        "partitioned (no buddy copies are kept): every lost stage has a snapshot"
    )
    assert plan.consensus == 11 and plan.replacements == (2, 3)
    # Dearer than the replay: the replay goes first.
    costly = STRATEGIES.copy()
    costly.register(SnapshotStrategy({2, 3}, cost=1e9))
    assert plan_recovery(pipeline_only(), logging=setup, registry=costly).strategy == "logging"
    # Unable (stage 3 has no snapshot) and no log: the checkpoint, with every reason.
    unable = STRATEGIES.copy()
    unable.register(SnapshotStrategy({2}, cost=0.5))
    plan = plan_recovery(pipeline_only(), registry=unable)
    assert plan.strategy == "checkpoint"
    assert "no snapshot of stage(s) [3]" in plan.reason and "logging-based recovery is not set up" in plan.reason
    # Forced: only it is asked (then the checkpoint).
    assert plan_recovery(pipeline_only(), forced="snapshot", registry=registry).strategy == "snapshot"
    plan = plan_recovery(pipeline_only(), forced="snapshot", registry=unable)
    assert plan.strategy == "checkpoint"
    assert plan.reason == 'the config forces strategy "snapshot"; no snapshot of stage(s) [3]'


def test_a_name_is_registered_once_and_an_unknown_forced_name_is_refused() -> None:
    class Imposter(SnapshotStrategy):
        name = "logging"

    with pytest.raises(ValueError, match="registered already"):
        STRATEGIES.copy().register(Imposter(set(), 0.0))
    with pytest.raises(ValueError, match="unknown recovery strategy 'fast'"):
        plan_recovery(pipeline_only(), forced="fast")


def test_reasons_two_strategies_share_are_said_once() -> None:
    reports = pipeline_only()
    wrapper = "DeepSpeedZeroOptimizer_Stage3"
    plan = plan_recovery(reports, zero_stage=3, optimizer=wrapper, logging=LoggingSetup(frozenset(range(4))))
    assert plan.strategy == "checkpoint"
    assert plan.reason.count(wrapper) == 1


def test_zero1_and_bf16_partitions_come_from_the_checkpoint_in_a_replay() -> None:
    """Logging recovery reloads the replayed ranks' own partitions: no replica needs them."""
    plan = plan_recovery(pipeline_only(), zero_stage=1, partitioned=True, logging=LoggingSetup(frozenset(range(4))))
    assert plan.strategy == "logging" and plan.replay_ranks == (2, 3)


def test_a_sender_whose_log_has_a_hole_forces_the_checkpoint() -> None:
    reports = pipeline_only()
    reports[1] = dataclasses.replace(
        reports[1], holdings=holdings_of(MessageLogHeld(lost="message log on rank 1 lost records: [Errno 28] No space"))
    )
    plan = plan_recovery(reports, logging=LoggingSetup(frozenset(range(4))))
    assert plan.strategy == "checkpoint"
    assert "message log of rank(s) [1] stopped covering" in plan.reason and "No space" in plan.reason
    # a hole in a log that the failed group does not need changes nothing
    reports[1] = dataclasses.replace(reports[1], holdings={})
    reports[0] = dataclasses.replace(reports[0], holdings=holdings_of(MessageLogHeld(lost="x")))
    assert plan_recovery(reports, logging=LoggingSetup(frozenset(range(4)))).strategy == "logging"


def test_the_consensus_is_pure_and_order_free() -> None:
    reports = pipeline_only()
    reports[1] = RankReport(rank=1, survivor=True, stage=1, dp=0, tp=0, machine=0, last_stepped=12, can_undo=True)
    inputs = RecoveryInputs.agree(reversed(reports))
    assert inputs.consensus == 11 and inputs.undo == (1,) and inputs.cannot_undo == ()
    assert inputs.survivors == (0, 1) and inputs.replacements == (2, 3) and inputs.failed_machines == {1}
    assert inputs == RecoveryInputs.agree(reports)
    far = RecoveryInputs.agree(
        [*reports[:1], RankReport(1, True, 1, 0, 0, 0, last_stepped=13, can_undo=True), *reports[2:]]
    )
    assert far.cannot_undo == (1,) and "cannot undo" in (far.keep_blocker() or "")


def test_forced_logging_with_nobody_lost_keeps_the_survivors() -> None:
    reports = [
        RankReport(rank=r, survivor=True, stage=r, dp=0, tp=0, machine=r // 2, last_stepped=5, can_undo=True)
        for r in range(4)
    ]
    plan = plan_recovery(reports, forced="logging", logging=LoggingSetup(frozenset(range(4))))
    assert plan.strategy == "logging" and plan.replay_ranks == () and list(plan.replay_iterations) == []
    assert plan_recovery(reports).strategy == "replication"


def test_tranlogs_is_chosen_only_by_name_and_reloads_only_the_lost_ranks() -> None:
    inputs = RecoveryInputs.agree(pipeline_only(last=9), checkpoint_step=6, forced="tranlogs")
    plan, chosen = STRATEGIES.choose(inputs)
    assert chosen.name == "tranlogs" and plan.replay_ranks == (2, 3) and list(plan.replay_iterations) == [6, 7, 8, 9]
    assert plan.reason == (
        'the config forces strategy "tranlogs": ranks [2, 3] load global_step6 and re-apply their logged updates '
        "of iterations 6..9"
    )
    # Nothing writes update logs under auto: it never chooses them.
    auto = RecoveryInputs.agree(pipeline_only(), checkpoint_step=6)
    assert "tranlogs" not in [s.name for s in STRATEGIES.candidates(auto)]
    # A survivor two steps ahead cannot undo to the consensus: the checkpoint, saying why.
    reports = pipeline_only(last=9)
    reports[0] = dataclasses.replace(reports[0], last_stepped=11)
    plan = plan_recovery(reports, forced="tranlogs", checkpoint_step=6)
    assert plan.strategy == "checkpoint" and "cannot undo" in plan.reason, plan.reason


def test_scar_is_chosen_only_by_name_is_approximate_and_needs_a_survivor() -> None:
    inputs = RecoveryInputs.agree(pipeline_only(last=9), checkpoint_step=6, forced="scar")
    plan, chosen = STRATEGIES.choose(inputs)
    assert chosen.name == "scar" and not chosen.exact and plan.replay_ranks == (2, 3)
    assert plan.reason == (
        'the config forces strategy "scar": ranks [2, 3] load global_step6 and train on from iteration 10 with the '
        "survivors' state (partial recovery: approximate)"
    )
    assert "scar" not in [
        s.name for s in STRATEGIES.candidates(RecoveryInputs.agree(pipeline_only(), checkpoint_step=6))
    ]
    # Every rank lost: nothing to keep, so a checkpoint restart, saying why.
    everyone = [dataclasses.replace(r, survivor=False) for r in pipeline_only(last=9)]
    plan = plan_recovery(everyone, forced="scar", checkpoint_step=6)
    assert plan.strategy == "checkpoint" and "no rank survived with its state" in plan.reason, plan.reason
