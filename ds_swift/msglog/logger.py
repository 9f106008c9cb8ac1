"""Bubble-time logging of a pipeline engine's cross-machine sends (SWIFT section 5.1).

``install_message_logging(engine, plan, cfg)`` hooks the engine (patches/pipe_logging.py) and
returns a :class:`MessageLogHandle`. Per logged send, on the training thread:

1. the send hook records the tensors DeepSpeed sent (references, see msglog.staging) with their
   timestamp in the *bubble queue* - nothing is copied or written yet;
2. at the next idle point (before a receive, after the optimizer step) the queue is drained:
   each message is staged (a D2H copy on a side stream with CUDA; nothing on CPU) and handed to
   the writer thread, which appends it to its chunk file (msglog.writer).

``bubble_only: false`` stages and hands over right at the send, for comparison. Nothing on the
training thread waits on disk; it waits only when the bytes queued for the writer exceed
``max_inflight_bytes`` (a disk slower than the pipeline), and that wait is counted in
``stats.stall_s``.

Timestamps: iteration ``t`` is the ``train_batch`` during which ``engine.global_steps == t``
(0-based); the micro-batch is the index of that send kind within the iteration (0..gas-1).
After a failure, the recovery runtime calls :meth:`MessageLogHandle.restart_iteration` before
re-running an iteration, so its sends are numbered from 0 again (the re-logged records then
supersede the partial ones: the reader keeps the later record).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_swift.msglog.edge import KINDS, LogEdge, pipeline_position
from ds_swift.msglog.gc import delete_chunks_before
from ds_swift.msglog.plan import LoggingPlan
from ds_swift.msglog.staging import CopyMode, Stager, make_stager
from ds_swift.msglog.upload import upload_files
from ds_swift.msglog.writer import LogWriter, MessageMeta, make_appender
from ds_swift.msglog.writer_thread import WriteItem, WriterThread

if TYPE_CHECKING:
    from ds_swift.config import SwiftConfig

__all__ = ["LogStats", "MessageLogError", "MessageLogHandle", "install_message_logging"]

_log = logging.getLogger(__name__)


class MessageLogError(RuntimeError):
    """Logging cannot guarantee the log (a failed write); raised on the training thread."""


@dataclass(frozen=True)
class LogStats:
    """Counters of one handle. ``records``/``bytes`` are on disk (headers included)."""

    messages_logged: int  # captured at send
    messages_written: int
    records: int
    bytes: int
    failed_messages: int
    pending: int  # in the bubble queue, not staged yet
    queued: int  # staged, not written yet
    stall_s: float  # training-thread time spent waiting for the writer (backpressure)
    max_inflight_bytes: int
    drains: int
    writer_cpu_s: float  # CPU time of the writer thread


@dataclass(frozen=True)
class _Pending:
    meta: MessageMeta
    tensors: list[torch.Tensor]
    nbytes: int


def resolve_log_dir(cfg: SwiftConfig, log_dir: str | os.PathLike[str] | None) -> Path:
    """``log_dir``, else ``logging.local_dir``, else the ``file://`` storage itself, else a temp dir."""
    from ds_swift.storage import local_path_of

    if log_dir is not None:
        return Path(log_dir)
    if cfg.logging.local_dir:
        return Path(cfg.logging.local_dir)
    local = local_path_of(cfg.logging.storage)
    if local is not None:
        return local
    return Path(tempfile.mkdtemp(prefix="ds-swift-log-"))


class MessageLogHandle:
    """Owns the hooks, the bubble queue and the writer thread of one engine. Use as a context manager."""

    HOOK_NAME = "ds_swift.msglog"

    def __init__(
        self,
        engine: Any,
        plan: LoggingPlan,
        cfg: SwiftConfig,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        native: bool | None = None,
        copy_mode: CopyMode = "ref",
        max_inflight_bytes: int = 1 << 30,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        from ds_swift.patches import pipe_logging

        self.engine = engine
        self.cfg = cfg
        self.log_dir = resolve_log_dir(cfg, log_dir)
        self.bubble_only = cfg.logging.bubble_only
        self.copy_mode = copy_mode
        pos = pipeline_position(engine)
        self.position = pos
        #: kind -> (edge, receiving rank) of the sends this rank logs
        self.edges: dict[str, tuple[LogEdge, int]] = {}
        for kind in KINDS:
            receiver = pos.receiver(kind)
            if receiver is not None and plan.is_logged(pos.rank, receiver):
                self.edges[kind] = (pos.out_edge(kind), receiver)

        self._lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._iteration = -1
        self._counters = {"act": 0, "grad": 0}
        self._logged = 0
        self._drains = 0
        self._stager: Stager | None = None
        self._native_module: Any = None
        appender = make_appender(native) if self.edges else None
        self.appender_name = appender.name if appender else "none"
        self._writer: WriterThread | None = None
        self._patch = None
        if self.edges:
            assert appender is not None
            self._native_module = getattr(appender, "_m", None)
            # A disk that takes no message for op_timeout_s stops logging here (loudly, below) before
            # the hang detector (hang_timeout_s > op_timeout_s) would take this healthy machine.
            self._writer = WriterThread(
                LogWriter(self.log_dir, cfg.logging.chunk_iterations, appender),
                max_inflight_bytes=max_inflight_bytes,
                stuck_after_s=cfg.watchdog.op_timeout_s,
            )
            self._patch = pipe_logging.install(
                engine, self.HOOK_NAME, self._on_send, self._on_idle, kinds=frozenset(self.edges)
            )
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._on_error = on_error
        #: why this handle stopped logging (a write error, with ``on_error`` given), or None
        self.lost: str | None = None

    # ------------------------------------------------------------ training thread
    def _on_send(self, kind: str, tensors: list[torch.Tensor]) -> None:
        entry = self.edges.get(kind)
        if self.lost is not None or entry is None:
            return  # degraded (what it would log cannot make a replay exact any more), or narrowed
        edge, receiver = entry
        it = int(self.engine.global_steps)
        with self._lock:
            if it != self._iteration:
                self._iteration = it
                self._counters = {"act": 0, "grad": 0}
            mb = self._counters[kind]
            self._counters[kind] += 1
            self._logged += 1
        if self.copy_mode == "clone":
            tensors = [t.clone() for t in tensors]
        meta = MessageMeta(it, mb, edge, self.position.rank, receiver)
        msg = _Pending(meta, tensors, sum(t.numel() * t.element_size() for t in tensors))
        if self.bubble_only:
            with self._lock:
                self._pending.append(msg)
        else:
            try:
                self._stage_and_submit([msg])
            except Exception as exc:  # noqa: BLE001 - the log's own error (see _LOG_ERRORS)
                self._lose(exc)

    def _on_idle(self, where: str) -> None:
        assert self._writer is not None
        if self.lost is not None:
            return
        try:
            self._writer.check()
            self.drain()  # a stopped writer thread raises here (LogWriteError)
        except Exception as exc:  # noqa: BLE001 - the log's own error (see _LOG_ERRORS)
            self._lose(exc)

    # _LOG_ERRORS: what the send and idle hooks catch is every Exception (not KeyboardInterrupt or
    # SystemExit). Nothing they run talks to a peer: they stage the tensors DeepSpeed already sent
    # (a host or pinned buffer: MemoryError, or torch's RuntimeError "CUDA error: out of memory" when
    # pinned memory runs out), queue them, and raise what the writer thread recorded (OSError and
    # its LogWriteError). So any error there is the log's own, a disk, host memory or a bug in the
    # logger, never a failure of the generation, and the log is a protection: it stops, loudly, and
    # every recovery hears that this rank's sends are not logged (RankReport.log_lost). Catching
    # only OSError let the others escape into DeepSpeed's p2p send, where they ended a healthy job
    # as its own error. A device fault that breaks the copy (a sticky CUDA error) surfaces again at
    # the training thread's next kernel, where it is judged like any other.
    def _lose(self, exc: Exception) -> None:
        """A write failed or the writer stopped: this log has a hole from here on."""
        what = f"message log on rank {self.position.rank} lost records: {exc}"
        if self._on_error is None:
            raise MessageLogError(what) from exc
        # Logging serves recovery and must never stop training: stop logging, say so.
        self.lost = what
        with self._lock:
            self._pending = []
        self._on_error(what)

    def drain(self) -> int:
        """Stage every queued message and hand it to the writer; returns how many. Any thread."""
        # One drainer at a time, taking the queue under the same lock (a watchdog's flush may race
        # the training thread's drain): each edge's records then reach the file in send order.
        with self._submit_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if batch:
                self._drains += 1
                self._submit(batch)
        return len(batch)

    def _stage_and_submit(self, batch: list[_Pending]) -> None:
        with self._submit_lock:
            self._submit(batch)

    def _submit(self, batch: list[_Pending]) -> None:
        assert self._writer is not None
        for msg in batch:
            if self._stager is None:
                self._stager = make_stager(msg.tensors[0].device, self._native_module)
            self._writer.submit(WriteItem(msg.meta, self._stager.stage(msg.tensors), msg.nbytes))

    def narrow(self, plan: LoggingPlan) -> None:
        """Stop logging the sends ``plan`` no longer selects (a storage budget's plan, made after the
        first iteration, only removes sends). The hook stays where it is (other hooks may wrap it:
        removing it would take them along) and passes the sends it no longer logs through."""
        rank = self.position.rank
        with self._lock:
            self.edges = {kind: e for kind, e in self.edges.items() if plan.is_logged(rank, e[1])}

    def restart_iteration(self) -> None:
        """Number the next sends from micro-batch 0 again (an iteration re-run after a failure)."""
        with self._lock:
            self._iteration = -1

    # ------------------------------------------------------------ any thread
    @property
    def active(self) -> bool:
        return self._patch is not None and self._patch.active

    @property
    def stats(self) -> LogStats:
        w = self._writer
        ws = w.stats if w else None
        return LogStats(
            messages_logged=self._logged,
            messages_written=ws.messages if ws else 0,
            records=ws.records if ws else 0,
            bytes=ws.bytes if ws else 0,
            failed_messages=ws.failed_messages if ws else 0,
            pending=len(self._pending),
            queued=w.pending() if w else 0,
            stall_s=ws.stall_s if ws else 0.0,
            max_inflight_bytes=ws.max_inflight_bytes if ws else 0,
            drains=self._drains,
            writer_cpu_s=ws.cpu_s if ws else 0.0,
        )

    def flush(self, timeout_s: float = 60.0, sync: bool = True) -> None:
        """Drain the bubble queue and wait until every logged message is on disk (failure path).

        Raises TimeoutError if the writer does not finish in time, LogWriteError for failed writes.
        """
        if self._writer is None:
            return
        self.drain()
        self._writer.flush(timeout_s, sync=sync)

    def files(self) -> list[Path]:
        """Chunk and index files this handle wrote that still exist."""
        if self._writer is None:
            return []
        return sorted(p for p in (self.log_dir / n for n in self._writer.writer.files) if p.exists())

    def upload(self, store_url: str | None = None, timeout_s: float = 600.0) -> list[str]:
        """Flush, then copy this handle's chunks (changed since the last upload) to the global store.

        Runs on the writer thread, so each chunk is uploaded whole (no half-written record) while
        training waits for nothing but the queue bound. Returns the uploaded names.
        """
        from ds_swift.storage import local_path_of, open_store

        url = store_url or self.cfg.logging.storage
        local = local_path_of(url)
        if self._writer is None or (local is not None and local.resolve() == self.log_dir.resolve()):
            self.flush(timeout_s)
            return []
        self.flush(timeout_s)
        store = open_store(url)

        def do_upload(_w: LogWriter) -> list[str]:
            return upload_files(store, self.files(), self._uploaded)

        t0 = time.perf_counter()
        names: list[str] = self._writer.call(do_upload, timeout_s)
        _log.debug("uploaded %d log files to %s in %.2f s", len(names), url, time.perf_counter() - t0)
        return names

    def gc_before(self, iteration: int, store_url: str | None = None, timeout_s: float = 60.0) -> list[str]:
        """A global checkpoint at ``iteration`` completed: delete chunks wholly before it, here and in the store."""
        deleted: list[str] = []
        if self._writer is not None:

            def do_gc(w: LogWriter) -> list[str]:
                w.close_before(iteration)
                return delete_chunks_before(str(self.log_dir), iteration)

            deleted += self._writer.call(do_gc, timeout_s)
        if store_url is not None:
            deleted += delete_chunks_before(store_url, iteration)
        return deleted

    def remove(self, timeout_s: float = 60.0) -> None:
        """Flush what is queued, stop the writer, unhook the engine. Idempotent."""
        if self._patch is not None and self._patch.active:
            self._patch.remove()
        if self._writer is not None:
            try:
                if self.lost is None:  # a lost log was said when it was lost: nothing left to flush
                    self.flush(timeout_s)
            finally:
                self._writer.close(timeout_s)

    def __enter__(self) -> MessageLogHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install_message_logging(
    engine: Any,
    plan: LoggingPlan,
    cfg: SwiftConfig,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    native: bool | None = None,
    copy_mode: CopyMode = "ref",
    max_inflight_bytes: int = 1 << 30,
    on_error: Callable[[str], None] | None = None,
) -> MessageLogHandle:
    """Log ``engine``'s sends that ``plan.is_logged(src_rank, dst_rank)`` selects.

    Args:
        engine: a DeepSpeed ``PipelineEngine``.
        plan: anything with ``is_logged(src_rank, dst_rank) -> bool`` (ds_swift.plan's Plan).
        cfg: the swift config (``logging.chunk_iterations``, ``bubble_only``, ``local_dir``, ``storage``).
        log_dir: where chunks are written; default: ``logging.local_dir``, else the ``file://``
            storage, else a temporary directory.
        native: True: cuda_ext's writer (its D2H stager too, with CUDA); False: the Python writer;
            None: Python unless ``DS_SWIFT_NATIVE_WRITER=1`` asks for native (then: when it builds).
        copy_mode: ``ref`` (hold the sent tensor) or ``clone`` (copy it at send time).
        max_inflight_bytes: bytes staged for the writer before the training thread waits.
        on_error: called once with the reason when a write fails (full disk, unreachable storage);
            the handle then stops logging instead of raising on the training thread.
    """
    return MessageLogHandle(
        engine,
        plan,
        cfg,
        log_dir,
        native=native,
        copy_mode=copy_mode,
        max_inflight_bytes=max_inflight_bytes,
        on_error=on_error,
    )
