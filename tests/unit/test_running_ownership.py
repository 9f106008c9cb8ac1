"""SCAR's running checkpoints belong to their job (issue 32): stamped with it, and a fresh start
never deletes another run's directory (its own earlier launch's only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.checkpoint.running import MANIFEST, RunningCheckpoint, RunningCheckpointError
from ds_swift.protect.running_checkpoint import RunningCheckpoints


def _running(directory: Path, **kwargs: Any) -> None:
    """A running checkpoint written in ``directory`` (as a run of ``job=`` leaves it)."""
    with RunningCheckpoint(directory, fraction=1.0, interval=1, background=False, **kwargs) as ckpt:
        ckpt.save(1, {"w": torch.arange(4, dtype=torch.float32)})
    assert (directory / MANIFEST).exists()


def test_a_fresh_scar_start_leaves_another_runs_running_checkpoint_alone(tmp_path: Path) -> None:
    # Another run's (an older, unstamped one) in the layout every run shared before job stamps.
    theirs = tmp_path / "running" / "rank0"
    _running(theirs)
    before = sorted(p.name for p in theirs.iterdir())
    with pytest.raises(RunningCheckpointError, match=f"{theirs}.*left alone.*Fix: remove {theirs}"):
        RunningCheckpoints(0.5, 4, str(tmp_path), 0, True)  # a run without a job id
    assert sorted(p.name for p in theirs.iterdir()) == before
    # A stamped job keeps its own directory, and never touches the other one.
    other = tmp_path / "running" / "job-other" / "rank0"
    _running(other, job="job-other")
    mine = RunningCheckpoints(0.5, 4, str(tmp_path), 0, True, job="job-mine")
    assert mine.directory == tmp_path / "running" / "job-mine" / "rank0"
    assert sorted(p.name for p in theirs.iterdir()) == before and (other / MANIFEST).exists()


def test_a_fresh_start_removes_only_its_own_jobs_earlier_running_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ds_swift.checkpoint.running import running_checkpoint_job

    own = tmp_path / "running" / "job-mine" / "rank0"
    _running(own, job="job-mine")
    assert running_checkpoint_job(own) == "job-mine"
    RunningCheckpoints(0.5, 4, str(tmp_path), 0, True, job="job-mine")
    assert not own.exists() and any("removing this job's earlier one" in s for s in caplog.messages)
    # A replacement (not fresh) keeps it: it loads from there.
    _running(own, job="job-mine")
    RunningCheckpoints(0.5, 4, str(tmp_path), 0, False, job="job-mine")
    assert (own / MANIFEST).exists()
    # Another job's manifest under this job's path (a copied directory) is refused, not deleted.
    _running(own, job="job-other")
    with pytest.raises(RunningCheckpointError, match="job-other"):
        RunningCheckpoints(0.5, 4, str(tmp_path), 0, True, job="job-mine")
    assert running_checkpoint_job(own) == "job-other"
