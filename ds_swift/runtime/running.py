"""This rank's SCAR running checkpoint during training (``checkpoint.running_fraction``, strategy scar).

After every step that a round is due (every ``running_fraction x checkpoint.interval``
iterations), the most-changed blocks of the rank's optimizer state go to its running checkpoint
(ds_swift.running_checkpoint, written on a background thread); ds_swift.recovery.scar loads it for a
replacement. A write error does not stop training: it is said loudly, each time, and the blocks it
lost are written first by the next rounds (a replacement meanwhile loads older ones).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

from ds_swift.recovery.base import loud
from ds_swift.recovery.scar import block_elements, running_dir, running_state
from ds_swift.running_checkpoint import RunningCheckpoint, RunningCheckpointError

__all__ = ["RunningCheckpoints"]


class RunningCheckpoints:
    """Args:
    fraction: SCAR's r (``checkpoint.running_fraction``).
    interval: the global checkpoint interval (SCAR's C).
    ckpt_dir: the global checkpoint directory (the running checkpoints go under it).
    rank: this rank.
    fresh: this process starts the job (not a replacement): an earlier run's running checkpoint
        of this rank is removed, so that a replacement never loads another run's blocks.
    log: one line to this rank's log.
    """

    def __init__(
        self, fraction: float, interval: int, ckpt_dir: str, rank: int, fresh: bool, log: Callable[[str], None]
    ) -> None:
        self.fraction, self.interval, self.rank, self._log = fraction, interval, rank, log
        self.directory = running_dir(ckpt_dir, rank)
        if fresh:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._ckpt: RunningCheckpoint | None = None

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
            self._ckpt = RunningCheckpoint(self.directory, fraction=self.fraction, interval=self.interval, groups=groups,
                                           block_elements=block_elements(tensors))  # fmt: skip
            self._log(f"running checkpoint: {self._ckpt.fraction:g} of the optimizer state every "
                      f"{self._ckpt.every} iteration(s) to {self.directory}")  # fmt: skip
        if not self._ckpt.due(done):
            return
        try:
            self._ckpt.save(done, tensors)
        except RunningCheckpointError as exc:
            loud(self.rank, f"running checkpoint: {exc} (training goes on; a replacement loads older blocks)")

    def close(self) -> None:
        if self._ckpt is None:
            return
        try:
            self._ckpt.close()
        except RunningCheckpointError as exc:
            loud(self.rank, f"running checkpoint: {exc}")
