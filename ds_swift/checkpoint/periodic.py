"""Periodic global checkpoints in DeepSpeed's own format: the safety net of every strategy.

Every ``checkpoint.interval`` iterations all ranks call ``engine.save_checkpoint(dir,
tag="global_step<N>")`` (N = iterations done). A checkpoint counts only once every rank has
written its files: after DeepSpeed's save (which ends in a barrier; each rank fsyncs the files it
wrote) rank 0 writes a marker ``swift_complete`` in the tag's directory (durably: :mod:`ds_swift.checkpoint.durable`).
A failure in the middle of a save leaves no marker, and recovery skips that tag, so nobody loads
half a checkpoint (a tag saved again first loses its old marker). A marker counts only if it reads
back whole and names its tag's iterations: a truncated one, or a ``swift_complete.tmp`` that a
crash left before its rename, is ignored and said.

DeepSpeed's own ``latest`` file decides nothing here: DeepSpeed writes it before every rank's files
are confirmed. Only ds-swift's marker makes a checkpoint trusted, the job's origin included.

Checkpoints belong to a job. The marker names the job that wrote it (:func:`job_id_for`: a hash
of the launcher's job token, never the token itself), and recovery only loads checkpoints of its
own job, never one newer than the iteration the survivors agreed on: a directory that still holds
another run's ``global_step10`` cannot send a job back (or forward) to it. The one foreign
checkpoint trusted is the one the job itself started from (``engine.load_checkpoint`` through the
ds-swift engine records it as the job's *origin*). To resume a job in a later launch and keep its
own checkpoints trusted, load one at start (the origin) or launch with the same ``--job-token``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ds_swift import transport
from ds_swift.checkpoint.durable import COMPLETE_MARKER, remove_durable, write_atomic
from ds_swift.checkpoint.fs_calls import FsCalls
from ds_swift.checkpoint.trust import (
    Origin,
    checkpoint_job,
    complete_checkpoints,
    is_complete,
    job_id_for,
    latest_complete,
    marker_problem,
    origin_of,
    tag_for,
    trusted_origin,
)
from ds_swift.checkpoint.write_errors import is_write_error as _write_error
from ds_swift.logs import say

if TYPE_CHECKING:
    from ds_swift.checkpoint.background import AsyncWriter
    from ds_swift.checkpoint.checkfreq import CheckFreqTuner

# Which checkpoints count (markers, job stamps, the origin) lives in ds_swift.checkpoint.trust; those
# names stay importable from here.
__all__ = [
    "COMPLETE_MARKER",
    "CheckpointManager",
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
    job_id: str | None = None
    """Stamped in every marker; recovery loads only this job's checkpoints (and :attr:`origin`)."""
    origin: Origin | None = None
    """The checkpoint the job started from, if it loaded one."""
    save_timeout_s: float | None = None
    """Op timeout of every process group while saving (None: leave them as they are)."""
    writer: AsyncWriter | None = None
    """Asynchronous saves (:mod:`ds_swift.checkpoint.background`); None: DeepSpeed writes while training waits."""
    save_id: str = "0"
    """Names this job's saves in this generation (markers of an earlier save of a tag never count)."""
    pending: str | None = None
    """The asynchronous checkpoint in flight, until its completion marker is on storage."""
    tuner: CheckFreqTuner | None = None
    """CheckFreq: the interval is chosen from the first checkpoint's measured costs."""
    fs_deadline_s: float = 30.0
    """The longest the training thread waits for one of the checkpoint's small file-system calls (rank
    0's marker removal and write): a hung shared file system must not hold training (ds_swift.checkpoint.fs_calls)."""
    complete: int = -1
    """Iterations of the newest checkpoint this process saw complete among the ones its job saved since
    it started (or since it joined): what the logs are collected against. Never the newest in the
    directory: a launch restarted from an older checkpoint than the last launch reached needs the logs
    since its own, which a newer tag of the same job id would have let go."""
    _warned: set[str] = field(default_factory=set, repr=False)
    _fs: FsCalls | None = field(default=None, repr=False)

    @property
    def fs(self) -> FsCalls:
        """The thread that makes this manager's file-system calls for the training thread."""
        if self._fs is None:
            self._fs = FsCalls(self.ckpt_dir, self.fs_deadline_s, self.rank)
        return self._fs

    def due(self, iterations_done: int) -> bool:
        if iterations_done <= 0 or iterations_done == self.last_saved:
            return False
        if self.tuner is not None:
            if self.tuner.chosen is None:
                return iterations_done == self.tuner.profile_at
            return iterations_done % self.tuner.chosen == 0
        return iterations_done % self.interval == 0

    def maybe_save(self, engine: Any) -> str | None:
        """Save if the engine just finished an iteration that is a multiple of the interval."""
        done = int(engine.global_steps)
        if not self.due(done):
            return None
        return self.save(engine)

    def save(self, engine: Any) -> str:
        if self.save_timeout_s is None:
            return self._save(engine)
        from ds_swift.patches.deepspeed_rebuild import long_op_timeout

        with long_op_timeout(self.save_timeout_s):
            return self._save(engine)

    def _save(self, engine: Any) -> str:
        if self.writer is not None:
            return self._save_async(engine, self.writer)
        from ds_swift.checkpoint.background import durable_saves  # imports DeepSpeed: only where it saves

        done = int(engine.global_steps)
        tag = tag_for(done)
        marker = Path(self.ckpt_dir) / tag / COMPLETE_MARKER
        if not self._old_marker_gone(tag):
            self.last_saved = done  # tried again at the next interval
            return tag
        written, passed = True, False
        try:
            # DeepSpeed closes its files without an fsync: the marker must not reach the disk first.
            with durable_saves(engine, Path(self.ckpt_dir) / tag):
                engine.save_checkpoint(self.ckpt_dir, tag=tag)
                passed = True  # DeepSpeed's save returns from the barrier it ends with
        except (OSError, RuntimeError) as exc:
            if not _write_error(exc, self.ckpt_dir):
                raise
            written = False
            say(
                f"checkpoint {tag} could not be written ({type(exc).__name__}: {str(exc)[:200]}); it does not "
                "count: a recovery loads the last complete one; training goes on",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )
            if not passed:
                # DeepSpeed's traffic, not ds-swift's: the barrier its save ends with (on the world,
                # where the other ranks wait in it), which this rank did not reach. After it (the
                # fsync of the tag's directory failed: EIO), every rank is past it already, and one
                # more barrier would meet the peers' next collective instead, or nothing.
                dist.barrier()  # transport: ok
        # DeepSpeed's save ends in a barrier, but only after *its* files; ours must follow every
        # rank's, and says whether every rank wrote them.
        everyone = transport.all_gather_json(written)
        if self.rank == 0 and all(everyone):
            text = json.dumps({"iterations": done, "job": self.job_id}) + "\n"
            # Past its deadline the write goes on in the background: complete once it lands (poll).
            self.fs.call(lambda: write_atomic(marker, text), f"writing the completion marker of {tag}")
        elif self.rank == 0:
            bad = [r for r, ok in enumerate(everyone) if not ok]
            say(
                f"checkpoint {tag} does not count: ranks {bad} could not write their files",
                level=logging.WARNING,
                name=__name__,
            )
        self.last_saved = done
        if all(everyone):
            self.pending = tag  # complete once every rank has seen its marker (poll)
        return tag

    def _old_marker_gone(self, tag: str) -> bool:
        """Rank 0 removes ``tag``'s old marker before any rank writes a file of it (a tag saved again,
        after a recovery or by an earlier run in this directory, is not complete while its files are
        rewritten, also after a crash): a collective, and False on every rank where the removal did
        not finish within ``fs_deadline_s`` (the tag is skipped, loudly; a barrier after a removal
        without a deadline held every rank as long as a hung file system did)."""
        ok = True
        if self.rank == 0:
            marker = Path(self.ckpt_dir) / tag / COMPLETE_MARKER
            ok, _ = self.fs.call(lambda: remove_durable(marker), f"removing the old completion marker of {tag}")
        if all(transport.all_gather_json(ok)):
            return True
        if self.rank == 0:
            say(
                f"checkpoint {tag} skipped on every rank: its old completion marker could not be removed within "
                f"{self.fs_deadline_s:g} s; training goes on, the next is tried at its interval",
                level=logging.WARNING,
                name=__name__,
            )
        return False

    def _save_async(self, engine: Any, writer: AsyncWriter) -> str:
        """Snapshot now, persist in the background; complete once every rank persisted (see
        :mod:`ds_swift.checkpoint.background`). Waits for the previous checkpoint's persist first."""
        from ds_swift.checkpoint.background import SnapshotCheckpointEngine
        from ds_swift.patches.async_checkpoint import saving_through

        done = int(engine.global_steps)
        tag = tag_for(done)
        if not self._previous_persisted(writer, tag):
            self.last_saved = done  # tried again at the next interval, not at every iteration
            return tag
        if not self._old_marker_gone(tag):  # nobody snapshots before the old marker is gone
            self.last_saved = done
            return tag
        stats = writer.begin(
            tag, self.ckpt_dir, self.save_id, json.dumps({"iterations": done, "job": self.job_id}) + "\n"
        )
        with saving_through(engine, SnapshotCheckpointEngine(writer)):
            engine.save_checkpoint(self.ckpt_dir, tag=tag, save_latest=False)
        writer.end()
        self.last_saved = done
        self.pending = tag
        if self.tuner is not None and self.tuner.chosen is None:
            self.tuner.choose(stats, writer)
        return tag

    def _previous_persisted(self, writer: AsyncWriter, tag: str) -> bool:
        """Whether every rank's previous persist is done (a collective): waits for this rank's at
        most half of ``save_timeout_s`` (the others wait in the gather for up to all of it). Else
        every rank skips ``tag``, loudly, and training goes on: a hung file system blocked the
        training thread here for good, where nothing watches it (outside the iteration)."""
        if self.save_timeout_s is None:
            return True  # begin() waits, as long as it takes
        ready = writer.wait_idle(self.save_timeout_s / 2)
        everyone = transport.all_gather_json(ready)
        if all(everyone):
            return True
        if self.rank == 0:
            slow = [r for r, ok in enumerate(everyone) if not ok]
            say(
                f"checkpoint {tag} skipped on every rank: ranks {slow} were still writing their previous checkpoint "
                f"after {self.save_timeout_s / 2:.0f} s (a slow or hung file system under {self.ckpt_dir}); "
                "training goes on, a recovery loads the last complete checkpoint, the next is tried at its interval",
                level=logging.WARNING,
                name=__name__,
            )
        return False

    def new_generation(self, generation: int) -> None:
        """Saves from now on belong to ``generation`` (their persisted markers say so)."""
        self.save_id = f"{self.job_id or 'job'}.g{generation}"
        if self.tuner is not None:
            self.tuner.refresh()

    def after_iteration(self) -> bool:
        """Called after each optimizer step: CheckFreq measures; True when the checkpoint last saved
        has just been seen complete (the logs it makes unneeded may go, up to :attr:`complete`)."""
        if self.tuner is not None:
            self.tuner.tick()
        return self.poll()

    def on_failure(self) -> None:
        """A failure: the checkpoint in flight may never complete; rank 0 stops waiting for it."""
        if self.writer is not None:
            self.writer.abandon()

    def poll(self) -> bool:
        """True once the checkpoint last saved (asynchronous: in flight) is seen complete on storage
        (say each failed persist, once). Never waits: the marker is read on :attr:`fs`'s thread, and
        its answer collected at a later poll (a hung file system held the training thread here at
        every iteration while a save was pending)."""
        if self.pending is None:
            return False
        if self.writer is not None:
            self.writer.report_errors()
        tag, where = self.pending, self.ckpt_dir
        got = self.fs.ask(lambda: (tag, is_complete(where, tag)), f"reading the completion marker of {tag}")
        if got is None:
            return False
        seen, complete = got[1]
        if not complete:
            return False
        self.complete = max(self.complete, int(seen.removeprefix("global_step")))
        if self.pending == seen:
            self.pending = None
        return True

    def settle(self) -> bool:
        """At the end of training: :meth:`poll`'s answer, waited for (at most ``fs_deadline_s``)."""
        if self.pending is None:
            return False
        tag, where = self.pending, self.ckpt_dir
        ok, complete = self.fs.call(lambda: is_complete(where, tag), f"reading the completion marker of {tag}")
        if not (ok and complete):
            return False
        self.complete = max(self.complete, int(tag.removeprefix("global_step")))
        self.pending = None
        return True

    def close(self) -> None:
        """Let the checkpoint in flight land (a job's last one must), then stop the writer."""
        if self.writer is not None and not self.writer.close(self.save_timeout_s or 600.0) and self.pending:
            say(
                f"checkpoint {self.pending} was still being written at exit: it does not count",
                self.rank,
                level=logging.WARNING,
                name=__name__,
            )

    def latest(self, at_most: int | None) -> tuple[int, str, str] | None:
        """``(iterations done, directory, tag)`` of the newest checkpoint recovery may load: this
        job's own, or its origin, with at most ``at_most`` iterations done. Another job's
        checkpoints in the directory are skipped, and said once each, as are checkpoints whose
        marker a crash left torn (never trusted)."""
        own = [
            c for c in complete_checkpoints(self.ckpt_dir, self._say_untrusted) if at_most is None or c[0] <= at_most
        ]
        found: list[tuple[int, str, str]] = []
        for done, tag in own:
            job = checkpoint_job(self.ckpt_dir, tag)
            if job == self.job_id or self._is_origin(self.ckpt_dir, tag):
                found.append((done, self.ckpt_dir, tag))
            elif tag not in self._warned:
                self._warned.add(tag)
                say(
                    f"checkpoint {tag} in {self.ckpt_dir} belongs to "
                    f"{job or 'an unknown job (no job id in its marker)'}, not this job ({self.job_id}): not loaded",
                    self.rank,
                    level=logging.WARNING,
                    name=__name__,
                )
        o = self.origin
        if o is not None and (at_most is None or o.iterations <= at_most):
            # Set from the store or by hand, the origin is still only trusted with ds-swift's marker.
            why = marker_problem(Path(o.ckpt_dir) / o.tag, o.iterations)
            if why is None:
                found.append((o.iterations, o.ckpt_dir, o.tag))
            else:
                self._say_untrusted(o.tag, f"{why} (the job's origin, in {o.ckpt_dir})")
        return max(found, key=lambda c: c[0]) if found else None

    def _say_untrusted(self, tag: str, why: str) -> None:
        if f"untrusted {tag}" in self._warned:
            return
        self._warned.add(f"untrusted {tag}")
        say(
            f"checkpoint {tag} in {self.ckpt_dir} is not complete: {why}; not loaded",
            self.rank,
            level=logging.WARNING,
            name=__name__,
        )

    def _is_origin(self, ckpt_dir: str, tag: str) -> bool:
        o = self.origin
        return o is not None and o.tag == tag and Path(o.ckpt_dir).resolve() == Path(ckpt_dir).resolve()

    def load_latest(self, engine: Any, at_most: int | None = None) -> int | None:
        """Load the newest checkpoint :meth:`latest` allows into ``engine``; returns its iterations
        done, or None."""
        found = self.latest(at_most)
        return None if found is None else self.load(engine, found)

    def load(self, engine: Any, found: tuple[int, str, str]) -> int:
        """Load the checkpoint :meth:`latest` found into ``engine``; returns its iterations done."""
        done, where, tag = found
        load_path, _ = engine.load_checkpoint(where, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {where}")
        if int(engine.global_steps) != done:
            # ds-swift saves a tag at the engine's own count, so DeepSpeed's files count other
            # iterations only where they are not what was saved there (copied over, another run's):
            # going on would train from another iteration's state as iteration ``done``.
            raise RuntimeError(
                f"checkpoint {tag} in {where}: DeepSpeed's files say global_steps={engine.global_steps}, its ds-swift "
                f"marker {done} iterations done: not the state of iteration {done}, not used"
            )
        self.last_saved = done
        return done
