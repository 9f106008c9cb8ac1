"""Periodic global checkpoints in DeepSpeed's own format: the safety net of every strategy.

Every ``checkpoint.interval`` iterations all ranks call ``engine.save_checkpoint(dir,
tag="global_step<N>")`` (N = iterations done). A checkpoint counts only once every rank has
written its files: after DeepSpeed's save (which ends in a barrier) rank 0 writes a marker file
``swift_complete`` into the tag's directory. A failure in the middle of a save leaves no marker,
and recovery skips that tag, so nobody loads half a checkpoint.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["COMPLETE_MARKER", "CheckpointManager", "complete_checkpoints", "latest_complete", "tag_for"]

COMPLETE_MARKER = "swift_complete"
_TAG = re.compile(r"^global_step(\d+)$")


def tag_for(iterations_done: int) -> str:
    return f"global_step{iterations_done}"


def complete_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(iterations done, tag)`` of every complete checkpoint in ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _TAG.match(entry.name)
        if m and entry.is_dir() and (entry / COMPLETE_MARKER).exists():
            found.append((int(m.group(1)), entry.name))
    return sorted(found)


def latest_complete(ckpt_dir: str | os.PathLike[str], at_most: int | None = None) -> tuple[int, str] | None:
    """The newest complete checkpoint (with at most ``at_most`` iterations done, if given)."""
    found = [c for c in complete_checkpoints(ckpt_dir) if at_most is None or c[0] <= at_most]
    return found[-1] if found else None


@dataclass
class CheckpointManager:
    """Saves every ``interval`` iterations and loads the newest complete checkpoint.

    Args:
        ckpt_dir: the directory (shared by every machine).
        interval: iterations between checkpoints.
        rank: this worker's global rank (rank 0 writes the completion marker).
    """

    ckpt_dir: str
    interval: int
    rank: int
    last_saved: int = -1

    def due(self, iterations_done: int) -> bool:
        return iterations_done > 0 and iterations_done % self.interval == 0 and iterations_done != self.last_saved

    def maybe_save(self, engine: Any) -> str | None:
        """Save if the engine just finished an iteration that is a multiple of the interval."""
        done = int(engine.global_steps)
        if not self.due(done):
            return None
        return self.save(engine)

    def save(self, engine: Any) -> str:
        done = int(engine.global_steps)
        tag = tag_for(done)
        engine.save_checkpoint(self.ckpt_dir, tag=tag)
        # DeepSpeed's save ends in a barrier, but only after *its* files; ours must follow every rank's.
        dist.barrier()
        if self.rank == 0:
            marker = Path(self.ckpt_dir) / tag / COMPLETE_MARKER
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(f"{done}\n")
            os.replace(tmp, marker)
        self.last_saved = done
        return tag

    def load_latest(self, engine: Any, at_most: int | None = None) -> int | None:
        """Load the newest complete checkpoint into ``engine``; returns its iterations done, or None."""
        found = latest_complete(self.ckpt_dir, at_most)
        if found is None:
            return None
        done, tag = found
        load_path, _ = engine.load_checkpoint(
            self.ckpt_dir, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {self.ckpt_dir}")
        if int(engine.global_steps) != done:
            print(
                f"[ds-swift] checkpoint {tag} says global_steps={engine.global_steps}; using {done}",
                file=sys.stderr,
                flush=True,
            )
        self.last_saved = done
        return done
