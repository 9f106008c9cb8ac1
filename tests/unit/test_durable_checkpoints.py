"""Durable checkpoint markers (issue 32, item 4): what a crash leaves is never trusted, markers
reach the disk (file and directory fsynced), and only ds-swift's own marker makes a checkpoint the
job's origin."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_swift.checkpoint.background import AsyncWriter
from ds_swift.checkpoint.periodic import COMPLETE_MARKER, CheckpointManager, Origin, complete_checkpoints, origin_of


class _Killed(BaseException):
    """The process dying at this point (nothing after it runs, no handler catches it)."""


class FakeEngine:
    """What CheckpointManager's synchronous save needs of a DeepSpeed engine."""

    def __init__(self, global_steps: int, loaded_from: str | None = None) -> None:
        self.global_steps = global_steps
        self._curr_ckpt_path = loaded_from
        self.checkpoint_engine = TorchCheckpointEngine()

    def save_checkpoint(self, save_dir: str, tag: str, **_: Any) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save({"w": torch.ones(2)}, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt"))


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every file or directory os.fsync is called on, in order."""
    seen: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return seen


def test_a_kill_between_the_markers_write_and_its_rename_is_never_trusted(
    tmp_path: Path, gloo_world: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_replace = os.replace

    def die_at_the_marker(src: Any, dst: Any) -> None:
        if Path(dst).name == COMPLETE_MARKER:
            raise _Killed
        real_replace(src, dst)

    m = CheckpointManager(str(tmp_path), interval=4, rank=0, job_id="job-mine")
    m.save(FakeEngine(4))  # a good one first
    monkeypatch.setattr(os, "replace", die_at_the_marker)
    with pytest.raises(_Killed):
        m.save(FakeEngine(8))
    monkeypatch.setattr(os, "replace", real_replace)
    assert [p.name for p in (tmp_path / "global_step8").iterdir() if p.name.startswith(COMPLETE_MARKER)] == [
        f"{COMPLETE_MARKER}.tmp"
    ]  # the marker's whole text, under its temporary name
    capsys.readouterr()
    assert m.latest(at_most=None) == (4, str(tmp_path), "global_step4")
    err = capsys.readouterr().err
    assert "global_step8" in err and "renamed into place" in err and "not trusted" in err, err
    # A marker torn by a crash after the rename (no fsync): truncated JSON, or empty.
    (tmp_path / "global_step8" / COMPLETE_MARKER).write_text('{"iterations": 8, "jo')
    (tmp_path / "global_step12").mkdir()
    (tmp_path / "global_step12" / COMPLETE_MARKER).write_text("")
    assert m.latest(at_most=None) == (4, str(tmp_path), "global_step4")
    err = capsys.readouterr().err
    assert "global_step12" in err and "truncated or corrupt" in err, err
    assert complete_checkpoints(tmp_path) == [(4, "global_step4")]
    m.latest(at_most=None)
    assert capsys.readouterr().err == ""  # said once each


def test_a_synchronous_save_fsyncs_its_files_then_the_marker_and_its_directory(
    tmp_path: Path, gloo_world: None, fsynced: list[str]
) -> None:
    engine = FakeEngine(4)
    CheckpointManager(str(tmp_path), interval=4, rank=0, job_id="job-mine").save(engine)
    assert "save" not in vars(engine.checkpoint_engine)  # DeepSpeed's own save method again
    tag = tmp_path / "global_step4"
    assert json.loads((tag / COMPLETE_MARKER).read_text()) == {"iterations": 4, "job": "job-mine"}
    data, marker_tmp = str(tag / "mp_rank_00_model_states.pt"), str(tag / f"{COMPLETE_MARKER}.tmp")
    assert data in fsynced and marker_tmp in fsynced, fsynced
    assert fsynced.index(data) < fsynced.index(marker_tmp)  # DeepSpeed's files reach the disk first
    assert str(tag) in fsynced[fsynced.index(marker_tmp) + 1 :], fsynced  # and then the rename


def test_an_asynchronous_checkpoint_fsyncs_files_markers_latest_and_directories(
    tmp_path: Path, fsynced: list[str]
) -> None:
    writer = AsyncWriter(rank=0, world_size=1, complete_timeout_s=30.0)
    tag = tmp_path / "global_step4"
    writer.begin("global_step4", str(tmp_path), "job.g0", json.dumps({"iterations": 4, "job": "job"}) + "\n")
    tag.mkdir()
    writer.add_file({"w": torch.ones(3)}, str(tag / "model_states.pt"))
    writer.end()
    assert writer.wait_idle(10.0) and writer.wait_complete(10.0) and writer.close(5.0)
    assert (tmp_path / "latest").read_text() == "global_step4"
    for path in (
        tag / "model_states.pt.swift-tmp",
        tag / "swift_persisted.job.g0.rank0.tmp",
        tag / f"{COMPLETE_MARKER}.tmp",
        tmp_path / "latest.tmp",
        tag,
        tmp_path,
    ):
        assert str(path) in fsynced, (path, fsynced)
    assert fsynced.index(str(tag / f"{COMPLETE_MARKER}.tmp")) < len(fsynced) - 1 - fsynced[::-1].index(str(tag))


def test_deepspeeds_latest_without_a_ds_swift_marker_is_not_the_origin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DeepSpeed wrote its files and its 'latest', but ds-swift never confirmed every rank's files.
    FakeEngine(8).save_checkpoint(str(tmp_path), "global_step8")
    (tmp_path / "latest").write_text("global_step8")
    engine = FakeEngine(8, loaded_from=str(tmp_path / "global_step8"))
    assert origin_of(engine) is None
    err = capsys.readouterr().err
    assert "global_step8" in err and "not trusted as this job's origin" in err, err
    # Not from the job store either (a replacement reads the origin there).
    m = CheckpointManager(str(tmp_path), interval=4, rank=0, job_id="job-mine")
    m.origin = Origin(str(tmp_path), "global_step8", 8)
    assert m.latest(at_most=None) is None
    assert "global_step8" in capsys.readouterr().err
    # With ds-swift's marker it is the origin, although another job wrote it.
    (tmp_path / "global_step8" / COMPLETE_MARKER).write_text(json.dumps({"iterations": 8, "job": "job-other"}))
    assert origin_of(engine, rank=0) == Origin(str(tmp_path), "global_step8", 8)
    assert m.latest(at_most=None) == (8, str(tmp_path), "global_step8")


class _BarrierEngine(FakeEngine):
    """DeepSpeed's save, which ends in a barrier on the world."""

    def save_checkpoint(self, save_dir: str, tag: str, **_: Any) -> None:
        super().save_checkpoint(save_dir, tag)
        dist.barrier()


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_write_error_enters_deepspeeds_last_barrier_only_where_the_save_did_not(
    tmp_path: Path, gloo_world: None, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Every rank must enter DeepSpeed's closing barrier once. A file's fsync fails before it (this
    rank owes it); the fsync of the tag's directory after it (an EIO there sent this rank into a
    second barrier, which no peer matches: the peers are in the marker's gather)."""
    barriers: list[str] = []
    real_barrier, real_fsync = dist.barrier, os.fsync

    def barrier(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals["__name__"]
        if not caller.startswith("ds_swift.transport"):  # ds-swift's own barriers are on its own group
            barriers.append(caller)
        return real_barrier(*args, **kwargs)

    monkeypatch.setattr(dist, "barrier", barrier)

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if (where == "file" and path.suffix == ".pt") or (where == "directory" and path.name == "global_step4"):
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    m = CheckpointManager(str(tmp_path), interval=4, rank=0, job_id="job-mine")
    assert m.save(_BarrierEngine(4)) == "global_step4"
    assert len(barriers) == 1, barriers  # DeepSpeed's own, or the one owed for it: never both
    assert not (tmp_path / "global_step4" / COMPLETE_MARKER).exists()  # it does not count
