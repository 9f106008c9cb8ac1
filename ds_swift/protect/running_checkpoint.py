"""This rank's SCAR running checkpoint during training (``checkpoint.running_fraction``, strategy scar).

After every step that a round is due (every ``running_fraction x checkpoint.interval``
iterations), the most-changed blocks of the rank's optimizer state go to its running checkpoint
(ds_swift.checkpoint.running, written on a background thread); ds_swift.recovery.strategies.scar loads it for a
replacement. A write error does not stop training: it is said loudly, each time, and the blocks it
lost are written first by the next rounds (a replacement meanwhile loads older ones).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ds_swift.checkpoint.running import (
    CorruptCheckpointError,
    RunningCheckpoint,
    RunningCheckpointError,
    block_elements,
    running_checkpoint_job,
    running_dir,
    running_state,
)
from ds_swift.logs import say
from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.recovery.base import loud

__all__ = ["RunningCheckpoints", "claim_running_dir"]


def claim_running_dir(directory: Path, job: str | None, rank: int | None = None) -> None:
    """A fresh start's running-checkpoint directory, emptied of this job's earlier launch.

    The directory is this job's by its path (``running/<job>/rank<r>``) unless its manifest names
    another job; then, or where this run has no job id and cannot tell, it is left alone and the
    start refused (the first round would otherwise replace that run's manifest and collect its files).

    Raises:
        RunningCheckpointError: ``directory`` holds another run's running checkpoint (names it and the fix).
    """
    if not directory.exists() or not any(directory.iterdir()):
        return
    try:
        owner: str | None = running_checkpoint_job(directory)
        stamped = True
    except CorruptCheckpointError:  # no manifest (a first round cut short) or a torn one: no owner named
        owner, stamped = None, False
    if job is not None and (owner == job or not stamped):
        say(f"running checkpoint: removing this job's earlier one in {directory} (a fresh start)", rank, name=__name__)
        shutil.rmtree(directory)
        return
    who = owner if owner is not None else "a run without a job id"
    raise RunningCheckpointError(
        f"running checkpoint directory {directory} holds the running checkpoint of {who}, not of this run "
        f"({job or 'no job id: launched without ds-swift-launch'}); it is left alone. Fix: remove {directory} "
        "if no run needs it, or give this run another checkpoint.dir"
    )


class RunningCheckpoints(Protection):
    """This rank's running checkpoint rounds (the protection ``running``).

    Args:
    fraction: SCAR's r (``checkpoint.running_fraction``).
    interval: the global checkpoint interval (SCAR's C).
    ckpt_dir: the global checkpoint directory (the running checkpoints go under it).
    rank: this rank.
    fresh: this process starts the job (not a replacement): this job's running checkpoint of this
        rank left by an earlier launch is removed (a replacement must not load blocks of a launch
        that went further); another run's is never touched (:func:`claim_running_dir`).
    job: the job id stamped in the running checkpoint (:func:`ds_swift.checkpoint.periodic.job_id_for`).
    wait_s: the longest a round waits for the previous round's write (then it is skipped, loudly).
    """

    def __init__(
        self,
        fraction: float,
        interval: int,
        ckpt_dir: str,
        rank: int,
        fresh: bool,
        job: str | None = None,
        wait_s: float | None = None,
    ) -> None:
        self.fraction, self.interval, self.rank, self.job = fraction, interval, rank, job
        self.wait_s = wait_s
        self.directory = running_dir(ckpt_dir, rank, job)
        if fresh:
            claim_running_dir(self.directory, job, rank)
        self._ckpt: RunningCheckpoint | None = None

    name = "running"
    label = "running checkpoints"

    @classmethod
    def build(cls, site: Site) -> RunningCheckpoints | str | None:
        """SCAR's running checkpoint of this rank, where the config asks for one and checkpoints have a directory."""
        fraction, ckpt = site.cfg.checkpoint.running_fraction, site.ckpt
        if not site.services.running_checkpoint:
            return None
        if fraction is None:
            return "checkpoint.running_fraction not set: a replacement loads the global checkpoint alone"
        if ckpt is None or ckpt.ckpt_dir is None:
            return "checkpoint.dir not set"
        env = site.ctx.env
        return cls(
            fraction,
            site.cfg.checkpoint.interval,
            ckpt.ckpt_dir,
            env.rank if env is not None else dist.get_rank(),
            env is None or not env.replacement,
            job=ckpt.job_id,
            wait_s=site.cfg.checkpoint.save_timeout_s / 2,
        )

    def usage(self) -> dict[str, Any]:
        return {"running_bytes": self.bytes_written}

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        from ds_swift.protect.costs import mb

        every = max(1, round(self.fraction * self.interval))
        return (
            f"  running checkpoints: the most-changed {self.fraction:g} of the optimizer state every {every} "
            f"iteration(s) to {self.directory}, gathered on the training thread and written by a background "
            f"thread (the rank state is {mb(costs.total_bytes)}; bytes written in the end-of-job usage)"
        )

    @property
    def bytes_written(self) -> int:
        return self._ckpt.bytes_written if self._ckpt is not None else 0

    def after_step(self, engine: Any) -> None:
        """A round, where one is due after the step just taken."""
        done = int(engine.global_steps)
        if self._ckpt is not None and not self._ckpt.due(done):
            return  # most steps: nothing to gather
        tensors, groups = running_state(engine.optimizer)
        if self._ckpt is None:
            self._ckpt = RunningCheckpoint(
                self.directory,
                fraction=self.fraction,
                interval=self.interval,
                groups=groups,
                block_elements=block_elements(tensors),
                job=self.job,
                wait_s=self.wait_s,
            )
            say(
                f"running checkpoint: {self._ckpt.fraction:g} of the optimizer state every "
                f"{self._ckpt.every} iteration(s) to {self.directory}",
                self.rank,
                name=__name__,
            )
        if not self._ckpt.due(done):
            return
        try:
            self._ckpt.save(done, tensors)
        except RunningCheckpointError as exc:
            loud(self.rank, f"running checkpoint: {exc} (training goes on; a replacement loads older blocks)")

    def close(self, timeout_s: float = 0.0) -> None:
        if self._ckpt is None:
            return
        try:
            self._ckpt.close()
        except RunningCheckpointError as exc:
            loud(self.rank, f"running checkpoint: {exc}")
