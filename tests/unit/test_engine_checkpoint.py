"""Global checkpoints (ds_swift.checkpoint): which tags count, when saves are due."""

from __future__ import annotations

from pathlib import Path

from ds_swift.checkpoint import COMPLETE_MARKER, CheckpointManager, complete_checkpoints, latest_complete, tag_for


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
