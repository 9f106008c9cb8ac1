"""Asynchronous global checkpoints: the training thread pays for a host snapshot only.

DeepSpeed's ``save_checkpoint`` hands each file's state dict to its checkpoint engine
(``engine.checkpoint_engine.save(state_dict, path)``: model states, every layer of a pipeline,
each rank's ZeRO partition). :class:`SnapshotCheckpointEngine` copies the tensors of that state
dict to host memory there and then (the *snapshot*: the only part the training thread waits for)
and queues the file; :class:`AsyncWriter`'s thread *persists* it (``torch.save`` to a temporary
name, fsync, then a rename and an fsync of the directory, so no file is ever torn, nor lost in a
crash after its marker says it is written). On a GPU the snapshot goes into pinned host buffers
(kept from one save to the next: pinning is slow, the copy at PCIe speed is not), queued on a side
stream after the training stream's work so far; the training thread waits for the copy once, at
the end of the save (ds_swift.checkpoint.snapshot).

A checkpoint counts only once complete on storage (:mod:`ds_swift.checkpoint.periodic`'s
``swift_complete`` marker). Each rank, once its files are written, writes
``swift_persisted.<save>.rank<r>`` (``<save>``: the job and generation of this save, so that
markers of an earlier save of the same tag never count); rank 0's writer waits until every rank's
marker is there and only then writes ``swift_complete`` and DeepSpeed's ``latest`` (every marker
durably: :func:`ds_swift.checkpoint.durable.write_atomic`). A machine that
dies mid-persist leaves the tag incomplete, and recovery loads the one before; a rank whose
persist fails says so in ``swift_failed.<save>.rank<r>``, and rank 0 gives that tag up.

At most one snapshot per rank is in host memory: a save that finds this rank's previous one still
persisting waits for it, and the wait is counted as a stall. A persist
that fails (full disk, storage gone) is said loudly on the next save or poll, and that tag never
counts; training goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ds_swift.background_thread import BackgroundThread
from ds_swift.checkpoint.durable import COMPLETE_MARKER, fsync_dir, fsync_file, fsync_tree, write_atomic
from ds_swift.checkpoint.snapshot import PinnedCopier, snapshot
from ds_swift.logs import say

__all__ = [
    "AsyncWriter",
    "PinnedCopier",
    "SaveStats",
    "SnapshotCheckpointEngine",
    "failed_marker",
    "persisted_marker",
    "snapshot",
]

_POLL_S = 0.05


def persisted_marker(save_id: str, rank: int) -> str:
    return f"swift_persisted.{save_id}.rank{rank}"


def failed_marker(save_id: str, rank: int) -> str:
    return f"swift_failed.{save_id}.rank{rank}"


@dataclass
class SaveStats:
    """What one asynchronous checkpoint cost (seconds)."""

    tag: str
    snapshot_s: float = 0.0
    """The training thread's copy of the state to host memory."""
    stall_s: float = 0.0
    """The training thread's wait for the previous checkpoint's persist."""
    persist_s: float = 0.0
    """This rank's writes, in the background."""
    bytes: int = 0
    complete: bool = False


@dataclass
class _Save:
    stats: SaveStats
    ckpt_dir: str
    save_id: str
    marker_text: str
    files: list[tuple[Any, str]] = field(default_factory=list)


class SnapshotCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """DeepSpeed checkpoint engine that snapshots on ``save`` and leaves the write to :class:`AsyncWriter`."""

    def __init__(self, writer: AsyncWriter) -> None:
        super().__init__(None)
        self.name = "ds-swift snapshot"
        self.writer = writer

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.writer.add_file(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        # DeepSpeed's TorchCheckpointEngine contract: its files pickle non-tensor objects (enums,
        # argparse namespaces, client state) that weights_only=True refuses. This engine is installed
        # only while a save runs (saving_through), so nothing loads through it in practice.
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        # True: DeepSpeed skips its own clone of views (on the device); the snapshot copies each
        # tensor compactly to host memory anyway.
        return True


class AsyncWriter:
    """A background thread that persists snapshots; on rank 0 a second one completes checkpoints."""

    def __init__(self, rank: int, world_size: int, complete_timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.complete_timeout_s = complete_timeout_s
        self.errors: list[str] = []
        self._reported = 0
        self.history: list[SaveStats] = []
        self._current: _Save | None = None
        self._abandon = threading.Event()
        self.copier = PinnedCopier()
        # A failed persist or completion is reported on the training thread (report_errors) and the
        # next checkpoint is tried: each handler records its own error, the workers go on.
        self._writer: BackgroundThread[_Save] = BackgroundThread("ds-swift-ckpt-writer", self._write)
        self._completer: BackgroundThread[_Save] | None = (
            BackgroundThread("ds-swift-ckpt-complete", self._completion) if rank == 0 else None
        )
        self._writer.start()
        if self._completer is not None:
            self._completer.start()

    # ------------------------------------------------------------------ training thread
    def begin(self, tag: str, ckpt_dir: str, save_id: str, marker_text: str) -> SaveStats:
        """Start a checkpoint: waits for this rank's previous persist first (one snapshot in host
        memory at most). ``marker_text`` goes into ``swift_complete`` once every rank persisted."""
        t0 = time.perf_counter()
        self.wait_idle()
        self.report_errors()
        stats = SaveStats(tag, stall_s=time.perf_counter() - t0)
        self._current = _Save(stats, ckpt_dir, save_id, marker_text)
        return stats

    def add_file(self, state_dict: Any, path: str) -> None:
        assert self._current is not None, "SnapshotCheckpointEngine.save outside AsyncWriter.begin/end"
        t0 = time.perf_counter()
        snap = snapshot(state_dict, self.copier)
        self._current.stats.snapshot_s += time.perf_counter() - t0
        self._current.files.append((snap, path))

    def end(self) -> SaveStats:
        """Wait for the snapshot's copies to land, then hand it to the writer thread."""
        save, self._current = self._current, None
        assert save is not None
        t0 = time.perf_counter()
        self.copier.finish()
        self.copier.drop_unused()
        save.stats.snapshot_s += time.perf_counter() - t0
        self._abandon.clear()
        self.history.append(save.stats)
        self._writer.submit(save)
        return save.stats

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait for this rank's own persist (not for the other ranks')."""
        return self._writer.wait_idle(timeout_s)

    def wait_complete(self, timeout_s: float | None = None) -> bool:
        """Rank 0: wait until every checkpoint handed over was completed or given up."""
        if self._completer is None:
            return True
        # The writer hands a persisted save to the completer before it counts as idle itself.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._writer.wait_idle(timeout_s):
            return False
        return self._completer.wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def abandon(self) -> None:
        """A failure: rank 0 stops waiting for the other ranks' markers of checkpoints in flight."""
        self._abandon.set()

    def report_errors(self) -> None:
        """Say, once each, every persist or completion that failed since the last call."""
        for msg in self.errors[self._reported :]:
            say(msg, self.rank, level=logging.WARNING, name=__name__)
        self._reported = len(self.errors)

    def close(self, timeout_s: float) -> bool:
        """Finish what is queued (the last checkpoint of a job must land) and stop; False if it could not."""
        deadline = time.monotonic() + timeout_s
        done = self.wait_idle(timeout_s) and self.wait_complete(max(0.0, deadline - time.monotonic()))
        for w in (self._writer, self._completer):
            if w is not None:
                w.stop(timeout_s=1.0 if done else 0.1)
        self.report_errors()
        return done

    # ------------------------------------------------------------------ writer threads
    def _write(self, save: _Save) -> None:
        try:
            self._persist(save)
            if self._completer is not None:
                self._completer.submit(save)
        except Exception as exc:  # noqa: BLE001 - reported on the training thread, never silent
            self.errors.append(
                f"checkpoint {save.stats.tag} could not be written ({type(exc).__name__}: {exc}); it does not "
                "count: a recovery loads the last complete one"
            )
            try:
                self._mark(save, failed_marker(save.save_id, self.rank))
            except OSError:
                pass  # a full disk may refuse even this: rank 0 then waits until complete_timeout_s

    def _mark(self, save: _Save, name: str) -> None:
        tag_dir = Path(save.ckpt_dir) / save.stats.tag
        tag_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(tag_dir / name, "ok\n")

    def _persist(self, save: _Save) -> None:
        t0 = time.perf_counter()
        try:
            for snap, path in save.files:
                tmp = f"{path}.swift-tmp"
                torch.save(snap, tmp)
                fsync_file(tmp)  # the persisted marker below must not reach the disk before these bytes
                save.stats.bytes += os.path.getsize(tmp)
                os.replace(tmp, path)
            for directory in {os.path.dirname(os.path.abspath(path)) for _, path in save.files}:
                fsync_dir(directory)
        finally:
            for snap, _ in save.files:
                self.copier.give_back(snap)
            save.files.clear()
        self._mark(save, persisted_marker(save.save_id, self.rank))
        save.stats.persist_s = time.perf_counter() - t0

    def _completion(self, save: _Save) -> None:
        try:
            self._complete(save)
        except Exception as exc:  # noqa: BLE001 - reported on the training thread
            self.errors.append(f"checkpoint {save.stats.tag} does not count: {exc}")

    def _complete(self, save: _Save) -> None:
        tag_dir = Path(save.ckpt_dir) / save.stats.tag
        wanted = {persisted_marker(save.save_id, r) for r in range(self.world_size)}
        failed = {r: failed_marker(save.save_id, r) for r in range(self.world_size)}
        deadline = time.monotonic() + self.complete_timeout_s
        while True:
            names = set(os.listdir(tag_dir))
            if wanted <= names:
                break
            bad = [r for r, name in failed.items() if name in names]
            if bad:
                raise RuntimeError(f"{', '.join(f'rank{r}' for r in bad)} could not write it")
            if self._abandon.is_set():
                return  # a failure: its recovery decides; this tag stays incomplete
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every rank persisted it within {self.complete_timeout_s:.0f} s")
            time.sleep(_POLL_S)
        write_atomic(tag_dir / COMPLETE_MARKER, save.marker_text)
        # DeepSpeed's own pointer, for tools that read it; ds-swift trusts the marker above only.
        write_atomic(Path(save.ckpt_dir) / "latest", save.stats.tag)
        save.stats.complete = True


@contextmanager
def durable_saves(engine: Any, tag_dir: Path) -> Iterator[None]:
    """A synchronous DeepSpeed save whose files are on disk when the block ends: each fsynced by the
    rank that wrote it, then the tag's directory and its parent (the new names). An engine whose
    files cannot be followed (a decoupled checkpoint engine) has the tag's directory synced whole,
    once its writer process has written them."""
    from ds_swift.patches._base import PatchError
    from ds_swift.patches.async_checkpoint import commit_decoupled, fsyncing_saves

    try:
        handle = fsyncing_saves(engine, fsync_file)
    except PatchError:
        handle = None
    with handle if handle is not None else nullcontext():
        yield
    if handle is None:
        # A decoupled writer may still be writing: synced, and then marked complete, before its files
        # exist, the tag would let the logs older than it go.
        commit_decoupled(engine)
        fsync_tree(tag_dir)
    else:
        fsync_dir(tag_dir)
    fsync_dir(tag_dir.parent)
