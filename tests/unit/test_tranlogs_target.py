"""TranLogs' landing iteration (ds_swift.recovery.strategies.tranlogs.update_target): a lost rank may
lack its update record of the consensus (lost in the passes after that step, before the record was
stored); every rank then lands one iteration earlier, the survivors going back one step bitwise.
Anything else stays at the consensus, for the check round to name and fall back on."""

from __future__ import annotations

import dataclasses

from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.holdings import BuddyHeld, UpdateLogHeld, holdings_of
from ds_swift.recovery.registry import STRATEGIES
from ds_swift.recovery.strategies.tranlogs import update_target


def reports(newest: dict[int, int | None], last: int = 9, exact: bool = False) -> list[RankReport]:
    """pp 2 x dp 2 on 2 machines: machine 1 (ranks 2, 3) lost, ranks 0 and 1 stepped ``last``."""
    return [
        RankReport(
            rank=r,
            survivor=r < 2,
            stage=r // 2,
            dp=r % 2,
            tp=0,
            machine=r // 2,
            last_stepped=last if r < 2 else -1,
            can_undo=r < 2,
            holdings=holdings_of(
                BuddyHeld(own=(last - 1,) if exact and r < 2 else ()), UpdateLogHeld(newest=newest.get(r))
            ),
        )
        for r in range(4)
    ]


def agree(newest: dict[int, int | None], checkpoint_step: int = 6, **kw: bool) -> RecoveryInputs:
    return RecoveryInputs.agree(reports(newest, **kw), checkpoint_step=checkpoint_step, forced="tranlogs")


def test_every_record_there_lands_on_the_consensus() -> None:
    assert update_target(agree({2: 9, 3: 9})) == (9, "")
    assert update_target(agree({2: None, 3: None})) == (9, "")  # not looked up: the check round decides
    # One short and one not looked up: landing earlier needs fewer records of either.
    assert update_target(agree({2: 8, 3: None}))[0] == 8


def test_a_record_of_the_consensus_missing_lands_one_earlier_and_the_survivors_go_back_bitwise() -> None:
    """Without own copies the survivors do not undo by the inverse update (within 2 ulp, and a digest
    check then fails the recovery): they load the checkpoint and re-apply their own records, as the
    replacements do. With own copies of the landing iteration they take those back instead."""
    inputs = agree({2: 9, 3: 8})
    target, why = update_target(inputs)
    assert target == 8 and why.startswith("ranks [3] were lost before their update records of iteration 9"), why
    plan, chosen = STRATEGIES.choose(inputs)
    assert chosen.name == "tranlogs" and plan.consensus == 8 and plan.undo == (), plan
    assert plan.replay_ranks == (0, 1, 2, 3) and list(plan.replay_iterations) == [6, 7, 8]
    assert plan.reason.endswith(
        "; survivors [0, 1], with no own copy of it, load global_step6 and re-apply their own records too"
    ), plan.reason
    exact, _ = STRATEGIES.choose(agree({2: 8, 3: 8}, exact=True))
    assert exact.consensus == 8 and exact.undo == (0, 1) and exact.replay_ranks == (2, 3), exact
    assert exact.reason.endswith("; survivors [0, 1] go back to it from their own copies"), exact.reason


def test_other_gaps_stay_at_the_consensus_for_the_check_round() -> None:
    assert update_target(agree({2: 7, 3: 9})) == (9, "")  # two records short: no landing reaches it
    assert update_target(agree({2: 8, 3: 8}, checkpoint_step=10)) == (9, "")  # the checkpoint covers 9
    stuck = reports({2: 8, 3: 8})
    stuck[0] = dataclasses.replace(stuck[0], can_undo=False)
    inputs = RecoveryInputs.agree(stuck, checkpoint_step=6, forced="tranlogs")
    assert update_target(inputs) == (9, "")  # a survivor that cannot undo its step


def test_a_report_carries_the_newest_record_through_json() -> None:
    (r,) = [x for x in reports({2: 8}) if x.rank == 2]
    assert UpdateLogHeld.of(RankReport.from_json(r.to_json())).newest == 8
    (s,) = [x for x in reports({}) if x.rank == 0]
    assert UpdateLogHeld.of(RankReport.from_json(s.to_json())).newest is None
