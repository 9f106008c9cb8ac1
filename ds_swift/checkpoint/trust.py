"""Which global checkpoints count: completion markers, job stamps and the job's origin.

A tag ``global_step<N>`` counts once rank 0 wrote its ``swift_complete`` marker after every rank's
files (:class:`ds_swift.checkpoint.periodic.CheckpointManager` writes it); a marker counts only if
it reads back whole and names the tag's iterations. It names the job that wrote it
(:func:`job_id_for`, a hash of the job token), and the one foreign checkpoint a job trusts is the
one it started from, its :class:`Origin`. See :mod:`ds_swift.checkpoint.periodic` for the whole story.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_swift.checkpoint.durable import COMPLETE_MARKER, temp_path
from ds_swift.logs import say

__all__ = [
    "Origin",
    "checkpoint_job",
    "complete_checkpoints",
    "is_complete",
    "job_id_for",
    "latest_complete",
    "marker_problem",
    "origin_of",
    "tag_for",
    "trusted_origin",
]

_TAG = re.compile(r"^global_step(\d+)$")


def tag_for(iterations_done: int) -> str:
    return f"global_step{iterations_done}"


def marker_problem(tag_dir: str | os.PathLike[str], iterations: int) -> str | None:
    """Why ``tag_dir`` (a tag of ``iterations`` iterations done) is not complete; None if it is.
    A marker counts only if it reads back whole and names those iterations (a crash may leave an
    empty or truncated file, or the temporary one before its rename)."""
    marker = Path(tag_dir) / COMPLETE_MARKER
    try:
        text = marker.read_text()
    except FileNotFoundError:
        if temp_path(marker).exists():  # the writer died between the marker's write and its rename
            return f"its save stopped before {temp_path(marker).name} was renamed into place: not trusted"
        return f"no {COMPLETE_MARKER} marker"
    except (OSError, UnicodeDecodeError) as exc:
        return f"its {COMPLETE_MARKER} cannot be read ({type(exc).__name__}: {exc})"
    try:
        doc = json.loads(text)
    except ValueError:
        return f"its {COMPLETE_MARKER} is truncated or corrupt ({len(text)} bytes, not JSON): not trusted"
    # ds-swift before job stamps wrote the bare iteration count.
    said = doc.get("iterations") if isinstance(doc, dict) else doc
    if isinstance(said, bool) or not isinstance(said, int) or said != iterations:
        return f"its {COMPLETE_MARKER} does not name {iterations} iterations done ({text.strip()[:80]!r}): not trusted"
    return None


def is_complete(ckpt_dir: str | os.PathLike[str], tag: str) -> bool:
    """Whether ``tag`` in ``ckpt_dir`` carries a whole ds-swift completion marker for its iterations."""
    m = _TAG.match(tag)
    return m is not None and marker_problem(Path(ckpt_dir) / tag, int(m.group(1))) is None


def complete_checkpoints(
    ckpt_dir: str | os.PathLike[str], report: Callable[[str, str], None] | None = None
) -> list[tuple[int, str]]:
    """``(iterations done, tag)`` of every complete checkpoint in ``ckpt_dir``, oldest first.
    ``report(tag, why)`` hears of each tag whose marker is there but not trusted (torn, truncated)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _TAG.match(entry.name)
        if not (m and entry.is_dir()):
            continue
        why = marker_problem(entry, int(m.group(1)))
        if why is None:
            found.append((int(m.group(1)), entry.name))
        elif report is not None and not why.startswith("no "):
            report(entry.name, why)
    return sorted(found)


def latest_complete(
    ckpt_dir: str | os.PathLike[str], at_most: int | None = None, job: str | None = None
) -> tuple[int, str] | None:
    """The newest complete checkpoint (with at most ``at_most`` iterations done, and written by
    job ``job``, where given)."""
    found = [
        c
        for c in complete_checkpoints(ckpt_dir)
        if (at_most is None or c[0] <= at_most) and (job is None or checkpoint_job(ckpt_dir, c[1]) == job)
    ]
    return found[-1] if found else None


def job_id_for(token: str | None) -> str | None:
    """The job id stamped in checkpoints: a hash of the job token (the token may be a secret)."""
    return None if token is None else "job-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def checkpoint_job(ckpt_dir: str | os.PathLike[str], tag: str) -> str | None:
    """The job id a complete checkpoint's marker names (None: written without one, or unreadable)."""
    try:
        doc = json.loads((Path(ckpt_dir) / tag / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc.get("job") if isinstance(doc, dict) and isinstance(doc.get("job"), str) else None


def origin_of(engine: Any, rank: int | None = None) -> Origin | None:
    """The checkpoint a DeepSpeed pipeline engine was loaded from before ds-swift wrapped it (the
    script's ``--load``), read from the path the engine keeps for its layer files; None if none, or
    if that checkpoint is not complete by ds-swift's marker (:func:`trusted_origin`)."""
    path = getattr(engine, "_curr_ckpt_path", None)
    if not isinstance(path, str) or int(getattr(engine, "global_steps", 0)) <= 0:
        return None
    where = Path(path)
    return trusted_origin(where.parent, where.name, int(engine.global_steps), rank)


def trusted_origin(
    ckpt_dir: str | os.PathLike[str], tag: str, iterations: int, rank: int | None = None
) -> Origin | None:
    """The loaded checkpoint ``tag`` as the job's origin, if ds-swift's marker says it is complete.
    DeepSpeed's ``latest`` may name a tag whose files not every rank wrote: such a checkpoint (or
    one plain DeepSpeed saved) is never an origin, and this says so on stderr."""
    if is_complete(ckpt_dir, tag):
        return Origin(str(ckpt_dir), tag, iterations)
    m = _TAG.match(tag)
    why = marker_problem(Path(ckpt_dir) / tag, int(m.group(1))) if m else "its tag is not global_step<N>"
    say(
        f"checkpoint {tag} in {ckpt_dir} was loaded, but {why}: not trusted as this job's origin "
        "(DeepSpeed's 'latest' names a tag before every rank's files are confirmed); a checkpoint fallback before this "
        "job's first complete checkpoint restarts from the initial state. Fix: load a checkpoint ds-swift completed",
        rank,
        level=logging.WARNING,
        name=__name__,
    )
    return None


@dataclass(frozen=True)
class Origin:
    """The checkpoint a job started from (loaded by the training script before its first iteration)."""

    ckpt_dir: str
    tag: str
    iterations: int

    def to_json(self) -> str:
        return json.dumps({"dir": self.ckpt_dir, "tag": self.tag, "iterations": self.iterations})

    @classmethod
    def from_json(cls, text: str) -> Origin:
        doc = json.loads(text)
        return cls(str(doc["dir"]), str(doc["tag"]), int(doc["iterations"]))
