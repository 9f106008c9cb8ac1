"""Recovery timelines (ds_swift.recovery.timeline): the paper's three durations and the phases."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ds_swift.recovery import registry
from ds_swift.recovery.timeline import RankTimeline, Timeline, build_timeline, write_timeline
from ds_swift.runtime.timeline import summary_line
from ds_swift.testing.stub_strategy import StubStrategy


def ranks() -> list[RankTimeline]:
    s0 = RankTimeline(
        rank=0,
        role="survivor",
        failed_generation=0,
        t_detect=100.2,
        t_torn_down=100.5,
        t_joined=104.0,
        t_rebuilt=104.4,
        t_consensus=106.0,
        t_restored=106.1,
        t_back=106.2,
    )
    s1 = RankTimeline(
        rank=1,
        role="survivor",
        failed_generation=0,
        t_detect=100.1,
        t_torn_down=100.4,
        t_joined=104.0,
        t_rebuilt=104.3,
        t_consensus=106.0,
        t_undone=106.05,
        t_restored=106.1,
        t_back=106.2,
        undone_from=7,
    )
    r2 = RankTimeline(
        rank=2,
        role="replacement",
        failed_generation=0,
        t_start=100.3,
        t_joined=104.0,
        t_rebuilt=106.0,
        t_consensus=106.0,
        t_restored=106.15,
        t_back=106.25,
    )
    return [r2, s0, s1]


def test_paper_durations() -> None:
    tl = build_timeline(
        ranks(),
        strategy="replication",
        reason="r",
        consensus=6,
        t_kill=100.0,
        t_agent_detected=100.15,
        failed_machine=1,
        undo_ranks=[1],
        donors={2: 0},
    )
    assert tl.first_detect == pytest.approx(100.1)  # the first survivor beat the agent
    assert tl.joined == pytest.approx(106.0)  # the last rank with its groups re-formed
    assert tl.back == pytest.approx(106.25)
    assert tl.initialization_s == pytest.approx(5.9)
    assert tl.recovery_s == pytest.approx(0.25)
    assert tl.total_s == pytest.approx(6.25)
    assert [r.rank for r in tl.ranks] == [0, 1, 2]
    # Phases tile the interval from the kill to back without gaps or overlaps.
    assert sum(tl.phases.values()) == pytest.approx(tl.total_s)
    assert tl.pre_failure_iteration == 7


def test_without_a_kill_time_total_starts_at_detection() -> None:
    tl = build_timeline(
        ranks(),
        strategy="checkpoint",
        reason="r",
        consensus=6,
        t_kill=None,
        t_agent_detected=None,
        failed_machine=None,
        undo_ranks=[],
        donors={},
        checkpoint_step=5,
    )
    assert tl.total_s == pytest.approx(106.25 - 100.1)
    line = summary_line(tl)
    assert "checkpoint (reload of global_step5)" in line and "detection -> back at iteration 7" in line


def test_missing_stamps_are_an_error() -> None:
    broken = [RankTimeline(rank=0, role="survivor", failed_generation=0, t_detect=1.0)]
    with pytest.raises(ValueError):
        build_timeline(
            broken,
            strategy="replication",
            reason="",
            consensus=0,
            t_kill=None,
            t_agent_detected=None,
            failed_machine=None,
            undo_ranks=[],
            donors={},
        )


def test_written_file_round_trips(tmp_path: Path) -> None:
    tl = build_timeline(
        ranks(),
        strategy="replication",
        reason="r",
        consensus=6,
        t_kill=100.0,
        t_agent_detected=None,
        failed_machine=1,
        undo_ranks=[1],
        donors={2: 0, 3: 1},
    )
    path = write_timeline(tmp_path, tl)
    assert path.name == "timeline-gen0.json"
    data = json.loads(path.read_text())
    assert data["undo_ranks"] == [1] and data["donors"] == {"2": 0, "3": 1}
    assert RankTimeline.from_json(json.dumps(data["ranks"][1])).undone_from == 7


def _timeline(strategy: str, replay: dict[str, Any] | None = None, checkpoint_step: int | None = None) -> Timeline:
    return build_timeline(
        ranks(),
        strategy=strategy,
        reason="r",
        consensus=6,
        t_kill=100.0,
        t_agent_detected=None,
        failed_machine=1,
        undo_ranks=[],
        donors={},
        checkpoint_step=checkpoint_step,
        replay=replay,
    )


REDO = {"ranks": [2, 3], "from": 4, "to": 6, "source": "global_step4", "replay_s": 1.234, "log_bytes_read": 2.5e6}


def test_the_recovering_strategy_words_what_its_restore_did() -> None:
    line = summary_line(_timeline("logging", {**REDO, "parallel": "exact"}, checkpoint_step=4))
    assert (
        "logging (ranks [2, 3] replayed iterations 4..6 from global_step4 in 1.23 s, 2.5 MB of log, parallel exact)"
        in line
    )
    line = summary_line(_timeline("tranlogs", REDO, checkpoint_step=4))
    assert (
        "tranlogs (ranks [2, 3] re-applied the updates of iterations 4..6 from global_step4 in 1.23 s, 2.5 MB of log)"
        in line
    )
    assert "checkpoint (reload of the initial state);" in summary_line(_timeline("checkpoint"))
    # Nothing replayed (no rank lost its state), or a strategy with nothing to add: its name alone.
    assert "): logging; consensus" in summary_line(_timeline("logging"))
    assert "): replication; consensus" in summary_line(_timeline("replication", REDO))


class _Worded(StubStrategy):
    name = "worded"

    def summary_words(self, summary: Mapping[str, Any] | None, checkpoint_step: int | None) -> str:
        return f"redid {(summary or {})['passes']} passes after global_step{checkpoint_step}"


def test_a_new_strategy_s_words_need_no_edit_in_the_timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "): worded; consensus" in summary_line(_timeline("worded", {"passes": 3}, 5))  # not registered
    grown = registry.strategies().copy()
    grown.register(_Worded())
    monkeypatch.setattr(registry, "STRATEGIES", grown)
    assert "): worded (redid 3 passes after global_step5); consensus" in summary_line(
        _timeline("worded", {"passes": 3}, 5)
    )


def test_the_summary_says_which_survivors_kept_their_engine_and_the_state_transfers_bandwidth() -> None:
    """Issue 50: a survivor that kept its engine stamps its swap's times (``engine_kept_s``), a rank that
    received state its transfer's bytes and seconds (``transfer``); the summary line says both."""
    rs = ranks()
    rs[1].extra["engine_kept_s"] = {"replay": 0.4, "refill": 0.001}  # rank 0 kept its engine, rank 1 rebuilt
    rs[0].extra["transfer"] = {"sent_bytes": 0, "received_bytes": 100_000_000, "s": 0.5}
    tl = build_timeline(
        rs,
        strategy="replication",
        reason="r",
        consensus=6,
        t_kill=100.0,
        t_agent_detected=None,
        failed_machine=1,
        undo_ranks=[],
        donors={2: 0},
    )
    line = summary_line(tl)
    assert "; 1 of 2 survivors kept their engine; 100.0 MB restored at 200 MB/s;" in line
