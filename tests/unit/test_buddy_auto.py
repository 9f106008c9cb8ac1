"""``buddy.interval: "auto"`` (ds_swift.protect.buddy_interval): the interval rank 0 chooses from the
step time it measures, and how every rank learns it (the round's ``done`` key)."""

from __future__ import annotations

import threading

import pytest

from ds_swift.config import SwiftConfig
from ds_swift.jobstore.membership import JobStore
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.protect.buddy_holdings import StoreLanding
from ds_swift.protect.buddy_interval import DECIDE_AFTER, AutoInterval, choose_interval, decided, decision


@pytest.mark.parametrize(
    ("step_s", "round_s", "interval"),
    [
        (1.0, 0.01, 1),  # a step of 0.5 s or more: a copy after every step
        (0.5, 0.01, 1),
        (0.3, 0.01, 2),  # ceil(0.5 / 0.3) = 2
        (0.2, 0.01, 5),  # 3 -> the ladder's 5
        (0.1, 0.01, 5),
        (0.09, 0.01, 10),  # 6 -> 10: the tiny CPU GPT's step
        (0.1, 0.4, 10),  # a round of 0.4 s wants 0.8 s between rounds: 8 steps -> 10
        (1.0, 0.9, 2),  # a round nearly a step long: every second step
        (1e-4, 0.0, 1000),  # the ladder's end
        (0.0, 0.0, 1000),
    ],
)
def test_the_interval_leaves_half_a_second_and_twice_a_round_between_rounds(
    step_s: float, round_s: float, interval: int
) -> None:
    assert choose_interval(step_s, round_s) == interval


def test_the_leader_chooses_once_at_the_decisive_round_from_the_medians_of_what_it_measured() -> None:
    auto = AutoInterval()
    t, notes = 100.0, []
    for version in range(-1, DECIDE_AFTER + 5):
        step = 5.0 if version < 3 else (0.12 if version != 10 else 3.0)  # start-up, then ~0.12 s, one outlier
        t += step
        notes.append(auto.before_landing(version, t))
        auto.after_landing(t, t + (0.5 if version < 3 else 0.02))
    chosen = [(i, n) for i, n in enumerate(notes) if n is not None]
    assert chosen == [(DECIDE_AFTER - 1, decision(5))], chosen  # 0.5 / 0.12 -> 5, the outliers left out
    assert auto.chosen == 5 and "a step takes 120.0 ms and a round 20.0 ms" in auto.why, auto.why
    # Once chosen, the later rounds are not recorded: nothing grows over a job of weeks.
    # (_landed: rounds 5..19 timed, the first 4 skipped, the deciding round's landing came after)
    assert len(auto._submitted) == DECIDE_AFTER and len(auto._landed) == DECIDE_AFTER - 5


def test_a_done_value_carries_an_interval_or_nothing() -> None:
    assert decided(decision(20)) == 20
    for plain in (None, "1", "interval=", "interval=x", "interval=0", "interval=-5"):
        assert decided(plain) is None, plain


def test_the_leaders_choice_reaches_every_rank_with_the_round_that_carries_it() -> None:
    store = JobStore.host("unit-buddy-auto")
    other = JobStore.connect("127.0.0.1", store.port, "unit-buddy-auto", timeout_s=10)
    leader, follower = StoreLanding(store, 0, 2, rank=0), StoreLanding(other, 0, 2, rank=1)
    results: dict[str, bool] = {}
    waiting = threading.Thread(target=lambda: results.setdefault("follower", follower(19, lambda: False)))
    waiting.start()
    try:
        assert leader(19, lambda: False, decision(5)) is True
    finally:
        waiting.join(30)
    assert results == {"follower": True}
    assert decided(follower.done_value) == 5 and decided(leader.done_value) == 5
    # The next round is a plain one: nothing to adopt again.
    waiting = threading.Thread(target=lambda: follower(20, lambda: False))
    waiting.start()
    leader(20, lambda: False)
    waiting.join(30)
    assert follower.done_value == "1" and decided(follower.done_value) is None


def test_a_rank_adopts_the_chosen_interval_before_its_next_step_and_a_configured_one_stays() -> None:
    copier = BuddyCopier(1, (), interval=SwiftConfig().buddy.fixed_interval)
    assert copier.auto and copier.interval == 1  # the default is "auto": every step until a choice
    landed = threading.Event()
    landed.set()
    copier._worker = type("W", (), {"landed": landed, "error": None, "decided": 5})()  # type: ignore[assignment]
    copier.before_step()
    assert copier.interval == 5
    fixed = BuddyCopier(1, (), interval=4)
    fixed._worker = copier._worker
    fixed.before_step()
    assert not fixed.auto and fixed.interval == 4  # a configured interval is never replaced
