"""Global checkpoints (ds_swift.checkpoint.periodic): which tags count, when saves are due."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ds_swift.checkpoint.periodic import (
    COMPLETE_MARKER,
    CheckpointManager,
    Origin,
    complete_checkpoints,
    job_id_for,
    latest_complete,
    tag_for,
)
from ds_swift.recovery.consensus import RankReport
from ds_swift.recovery.coordinator import checkpoint_bound


def make(root: Path, step: int, complete: bool) -> None:
    d = root / tag_for(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (d / COMPLETE_MARKER).write_text(f"{step}\n")


def test_only_complete_tags_count(tmp_path: Path) -> None:
    make(tmp_path, 5, True)
    make(tmp_path, 10, True)
    make(tmp_path, 15, False)  # a save that a failure interrupted
    (tmp_path / "latest").write_text("global_step15")
    (tmp_path / "global_stepX").mkdir()
    assert complete_checkpoints(tmp_path) == [(5, "global_step5"), (10, "global_step10")]
    assert latest_complete(tmp_path) == (10, "global_step10")
    assert latest_complete(tmp_path, at_most=9) == (5, "global_step5")
    assert latest_complete(tmp_path, at_most=4) is None


def test_missing_directory_has_none(tmp_path: Path) -> None:
    assert latest_complete(tmp_path / "nope") is None


def test_saves_are_due_on_multiples_once() -> None:
    m = CheckpointManager(ckpt_dir="unused", interval=5, rank=0)
    assert [n for n in range(12) if m.due(n)] == [5, 10]
    m.last_saved = 10  # e.g. just reloaded global_step10: do not write it again
    assert not m.due(10)


def stamp(root: Path, step: int, job: str | None) -> None:
    d = root / tag_for(step)
    d.mkdir(parents=True)
    (d / COMPLETE_MARKER).write_text(json.dumps({"iterations": step, "job": job}) + "\n")


def test_recovery_loads_only_this_jobs_checkpoints_and_says_which_it_skips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The case: an earlier run left global_step10 (and a legacy, unstamped global_step12).
    stamp(tmp_path, 4, "job-mine")
    stamp(tmp_path, 10, "job-earlier")
    make(tmp_path, 12, True)
    m = CheckpointManager(ckpt_dir=str(tmp_path), interval=4, rank=3, job_id="job-mine")
    assert m.latest(at_most=None) == (4, str(tmp_path), "global_step4")
    err = capsys.readouterr().err
    assert "global_step10" in err and "job-earlier" in err and "not this job (job-mine)" in err
    assert "global_step12" in err and "unknown job" in err
    m.latest(at_most=None)
    assert capsys.readouterr().err == ""  # said once
    assert latest_complete(tmp_path, job="job-earlier") == (10, "global_step10")


def test_never_newer_than_the_bound(tmp_path: Path) -> None:
    stamp(tmp_path, 4, "job-mine")
    stamp(tmp_path, 8, "job-mine")
    m = CheckpointManager(ckpt_dir=str(tmp_path), interval=4, rank=0, job_id="job-mine")
    assert m.latest(at_most=7) == (4, str(tmp_path), "global_step4")
    assert m.latest(at_most=8) == (8, str(tmp_path), "global_step8")
    assert m.latest(at_most=3) is None


def test_the_origin_is_trusted_although_another_launch_wrote_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "pretrained"
    stamp(elsewhere, 100, "job-earlier")
    stamp(tmp_path, 100, "job-earlier")
    m = CheckpointManager(ckpt_dir=str(tmp_path), interval=4, rank=0, job_id="job-mine")
    assert m.latest(at_most=None) is None
    m.origin = Origin(str(elsewhere), "global_step100", 100)
    assert m.latest(at_most=103) == (100, str(elsewhere), "global_step100")
    assert m.latest(at_most=99) is None
    m.origin = Origin(str(tmp_path), "global_step100", 100)  # in the checkpoint directory itself
    assert m.latest(at_most=None) == (100, str(tmp_path), "global_step100")
    assert Origin.from_json(m.origin.to_json()) == m.origin


def test_job_ids_hide_the_token() -> None:
    jid = job_id_for("s3cret-token")
    assert jid is not None and "s3cret" not in jid and jid == job_id_for("s3cret-token") != job_id_for("other")
    assert job_id_for(None) is None


def test_the_bound_is_what_every_survivor_trained() -> None:
    def report(rank: int, survivor: bool, last: int) -> RankReport:
        return RankReport(rank=rank, survivor=survivor, stage=0, dp=rank, tp=0, machine=rank, last_stepped=last)

    assert checkpoint_bound([report(0, True, 6), report(1, True, 7), report(2, False, -1)]) == 7
    assert checkpoint_bound([report(0, False, -1)]) is None


def test_a_checkpoint_whose_files_count_other_iterations_is_refused(tmp_path: Path) -> None:
    """Refused (the recovery then steps back to an older checkpoint, or falls back, loudly): it used
    to be said at INFO and trained on from the loaded state as the marker's iteration."""
    stamp(tmp_path, 8, "job-mine")
    engine = SimpleNamespace(global_steps=0)

    def load_checkpoint(where: str, tag: str, **kw: Any) -> tuple[str, dict[str, Any]]:
        engine.global_steps = 6  # what DeepSpeed's files in global_step8 say
        return f"{where}/{tag}", {}

    engine.load_checkpoint = load_checkpoint
    m = CheckpointManager(ckpt_dir=str(tmp_path), interval=4, rank=2, job_id="job-mine")
    with pytest.raises(RuntimeError) as err:
        m.load_latest(engine)
    assert str(err.value) == (
        f"checkpoint global_step8 in {tmp_path}: DeepSpeed's files say global_steps=6, its ds-swift marker 8 "
        "iterations done: not the state of iteration 8, not used"
    )
    assert m.last_saved != 8
