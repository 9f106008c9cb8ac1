"""Appending records to chunk files, and the writer thread that does it off the training thread.

Layers, bottom up:

- an *appender* writes one record (header + payload) to a file descriptor and returns the
  payload's crc32c: :class:`PythonAppender` (``crc32c`` package + ``os.writev``, both release the
  GIL for large buffers) or :class:`NativeAppender` (cuda_ext: crc32c + writev in C++ with the
  GIL released). Both write identical bytes.
- :class:`ChunkWriter` owns one chunk file and its index, appends records, and on open *recovers*
  an existing chunk (a writer killed mid-record leaves a torn tail: it is truncated away).
- :class:`LogWriter` routes messages to the chunk of their (edge, iteration range), rotating
  files every ``chunk_iterations`` iterations.
- :class:`WriterThread` drains a FIFO of :class:`WriteItem` into a LogWriter. The training thread
  only enqueues; a bound on the bytes in flight keeps a slow disk from exhausting host memory
  (the training thread then waits, and the wait is counted in the stats, never hidden).

A write that fails (ENOSPC, EIO, ...) is recorded as a :class:`LogWriteError` naming the file; it
is raised by the next :meth:`WriterThread.check`/``flush`` on the training side. Records are never
dropped silently.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from ds_swift.msglog.format import (
    FILE_HEADER_SIZE,
    RECORD_PAYLOAD_CRC_OFFSET,
    ChunkHeader,
    ChunkName,
    IndexEntry,
    RecordHeader,
    crc32c,
    pack_index_header,
)

__all__ = [
    "Appender",
    "ChunkWriter",
    "LogWriteError",
    "LogWriter",
    "MessageMeta",
    "NativeAppender",
    "PythonAppender",
    "WriteItem",
    "WriterThread",
    "make_appender",
    "payload_bytes",
]

_log = logging.getLogger(__name__)


class LogWriteError(OSError):
    """Writing a log record failed; the message names the chunk file."""


@dataclass(frozen=True)
class MessageMeta:
    """Everything about one logged send but its tensors."""

    iteration: int
    micro_batch: int
    kind: str
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    dp_rank: int = 0
    tp_rank: int = 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def payload_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D contiguous uint8 CPU tensor (no copy when already contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def record_header(meta: MessageMeta, t: torch.Tensor, part: int, num_parts: int) -> RecordHeader:
    return RecordHeader(
        iteration=meta.iteration,
        micro_batch=meta.micro_batch,
        src_stage=meta.src_stage,
        dst_stage=meta.dst_stage,
        src_rank=meta.src_rank,
        dst_rank=meta.dst_rank,
        kind=meta.kind,
        dtype=dtype_name(t.dtype),
        shape=tuple(int(d) for d in t.shape),
        nbytes=t.numel() * t.element_size(),
        part=part,
        num_parts=num_parts,
        dp_rank=meta.dp_rank,
        tp_rank=meta.tp_rank,
    )


# --------------------------------------------------------------------------- appenders
class Appender(Protocol):
    name: str

    def append(self, fd: int, header: RecordHeader, payload: torch.Tensor) -> int:
        """Write header (with crcs filled in) + payload at fd's position; return the payload crc."""
        ...


def _write_all(fd: int, buffers: list[Any]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class PythonAppender:
    """The reference appender: ``crc32c`` package + ``os.writev``."""

    name = "python"

    def append(self, fd: int, header: RecordHeader, payload: torch.Tensor) -> int:
        data = payload.numpy().data if payload.numel() else memoryview(b"")
        crc = crc32c(data)
        _write_all(fd, [header.pack(crc), data])
        return crc


class NativeAppender:
    """cuda_ext's ``append_record``: checksums and writes with the GIL released."""

    name = "native"

    def __init__(self, module: ModuleType) -> None:
        self._m = module

    def append(self, fd: int, header: RecordHeader, payload: torch.Tensor) -> int:
        crc, err = self._m.append_record(fd, header.pack(0), payload, RECORD_PAYLOAD_CRC_OFFSET)
        if err:
            raise OSError(err, os.strerror(err))
        return int(crc)


def make_appender(native: bool | None = None) -> Appender:
    """The record appender.

    Args:
        native: True: cuda_ext's (raise if it cannot be built); False: Python's; None: Python's
            unless ``DS_SWIFT_NATIVE_WRITER=1``. Python's is the default because on these CPU
            machines it is as fast (the ``crc32c`` package checksums at ~13 GB/s with the GIL
            released; benchmarks/logging_overhead.py compares both) and because a first JIT build
            (~45 s of compiler on the training start-up path) must be asked for, not imposed.
    """
    if native is False or (native is None and os.environ.get("DS_SWIFT_NATIVE_WRITER", "0") != "1"):
        return PythonAppender()
    from ds_swift.cuda_ext import native_writer, native_writer_error

    module = native_writer()
    if module is None:
        if native:
            raise RuntimeError(f"the native log writer is unavailable: {native_writer_error()}")
        return PythonAppender()
    return NativeAppender(module)


# --------------------------------------------------------------------------- files
def _describe(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({exc.strerror})"
    return exc.strerror or str(exc)


def _open_fd(path: Path, create: bool) -> int:
    flags = os.O_WRONLY | (os.O_CREAT | os.O_TRUNC if create else 0)
    return os.open(path, flags, 0o644)


class ChunkWriter:
    """One open chunk file and its index."""

    def __init__(self, directory: Path, name: ChunkName, header: ChunkHeader, appender: Appender) -> None:
        self.name = name
        self.path = directory / name.chunk_file
        self.index_path = directory / name.index_file
        self.appender = appender
        self.records = 0
        if self.path.exists() and self.path.stat().st_size >= FILE_HEADER_SIZE:
            self._recover()
        else:
            self._create(header)

    def _create(self, header: ChunkHeader) -> None:
        self.fd = _open_fd(self.path, create=True)
        self.index_fd = _open_fd(self.index_path, create=True)
        try:
            _write_all(self.fd, [header.pack()])
            _write_all(self.index_fd, [pack_index_header()])
        except OSError as exc:
            self.close()
            raise LogWriteError(exc.errno, f"cannot create log chunk {self.path}: {_describe(exc)}") from exc
        self.offset = FILE_HEADER_SIZE

    def _recover(self) -> None:
        # Appending to a chunk that exists: a previous writer (killed, or this process before a
        # recovery re-ran an iteration) may have left a torn last record. Keep the valid prefix.
        from ds_swift.msglog.reader import scan_chunk

        scan = scan_chunk(self.path)
        if scan.error:
            _log.warning("log chunk %s: dropping a torn/corrupt tail at offset %d (%s)", self.path, scan.end, scan.error)
        os.truncate(self.path, scan.end)
        tmp = self.index_path.with_suffix(self.index_path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            f.write(pack_index_header())
            for header, offset in scan.records:
                f.write(IndexEntry.for_record(header, offset).pack())
        os.replace(tmp, self.index_path)
        self.fd = _open_fd(self.path, create=False)
        self.index_fd = _open_fd(self.index_path, create=False)
        self.offset = os.lseek(self.fd, 0, os.SEEK_END)
        os.lseek(self.index_fd, 0, os.SEEK_END)
        self.records = len(scan.records)

    def append(self, header: RecordHeader, payload: torch.Tensor) -> RecordHeader:
        start = self.offset
        try:
            crc = self.appender.append(self.fd, header, payload)
        except OSError as exc:
            # Cut the torn record off so the chunk stays valid for the records already in it.
            try:
                os.ftruncate(self.fd, start)
                os.lseek(self.fd, start, os.SEEK_SET)
            except OSError:
                pass
            what = _describe(exc)
            raise LogWriteError(
                exc.errno,
                f"log chunk {self.path}: writing record (iteration {header.iteration}, micro-batch "
                f"{header.micro_batch}, {header.kind}, part {header.part}) failed: {what}",
            ) from exc
        written = dataclasses.replace(header, payload_crc=crc)
        self.offset = start + written.record_size
        self.records += 1
        try:
            _write_all(self.index_fd, [IndexEntry.for_record(written, start).pack()])
        except OSError as exc:
            raise LogWriteError(exc.errno, f"log index {self.index_path}: {_describe(exc)}") from exc
        return written

    def sync(self) -> None:
        os.fsync(self.fd)
        os.fsync(self.index_fd)

    def close(self) -> None:
        for attr in ("fd", "index_fd"):
            fd = getattr(self, attr, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, None)


class LogWriter:
    """Routes messages to chunk files by (edge, iteration range). Single-threaded."""

    def __init__(self, directory: str | os.PathLike[str], chunk_iterations: int, appender: Appender) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.chunk_iterations = chunk_iterations
        self.appender = appender
        self._open: dict[tuple[str, int, int, int, int], ChunkWriter] = {}
        self.files: set[str] = set()

    def write(self, meta: MessageMeta, tensors: list[torch.Tensor]) -> int:
        """Append one message (one record per tensor); return the bytes written."""
        name = ChunkName.for_iteration(
            meta.kind, meta.src_stage, meta.dst_stage, meta.dp_rank, meta.tp_rank, meta.iteration, self.chunk_iterations
        )
        cw = self._open.get(name.edge)
        if cw is None or cw.name != name:
            if cw is not None:
                cw.close()
                del self._open[name.edge]
            header = ChunkHeader(
                first_iteration=name.first_iteration,
                end_iteration=name.end_iteration,
                src_rank=meta.src_rank,
                dst_rank=meta.dst_rank,
                src_stage=meta.src_stage,
                dst_stage=meta.dst_stage,
                dp_rank=meta.dp_rank,
                tp_rank=meta.tp_rank,
                kind=meta.kind,
            )
            cw = ChunkWriter(self.directory, name, header, self.appender)
            self._open[name.edge] = cw
            self.files.update((name.chunk_file, name.index_file))
        start = cw.offset
        for part, t in enumerate(tensors):
            cw.append(record_header(meta, t, part, len(tensors)), payload_bytes(t))
        return cw.offset - start

    def open_chunks(self) -> list[ChunkName]:
        return [cw.name for cw in self._open.values()]

    def close_before(self, iteration: int) -> None:
        """Close chunks that hold only iterations before ``iteration``."""
        for edge, cw in list(self._open.items()):
            if cw.name.end_iteration <= iteration:
                cw.close()
                del self._open[edge]

    def sync(self) -> None:
        for cw in self._open.values():
            cw.sync()

    def close(self) -> None:
        for cw in self._open.values():
            cw.close()
        self._open.clear()


# --------------------------------------------------------------------------- the thread
class Staged(Protocol):
    """Host copies of a message's tensors that may still be in flight (a CUDA copy)."""

    def ready(self) -> bool: ...

    def take(self) -> list[torch.Tensor]: ...

    def release(self, tensors: list[torch.Tensor]) -> None: ...


@dataclass
class HostStaged:
    """Tensors already in host memory."""

    tensors: list[torch.Tensor]

    def ready(self) -> bool:
        return True

    def take(self) -> list[torch.Tensor]:
        out, self.tensors = self.tensors, []
        return out

    def release(self, tensors: list[torch.Tensor]) -> None:
        pass


@dataclass
class WriteItem:
    meta: MessageMeta
    staged: Staged
    nbytes: int


@dataclass
class _Call:
    fn: Callable[[LogWriter], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


_STOP = object()


@dataclass
class WriterStats:
    records: int = 0
    messages: int = 0
    bytes: int = 0
    failed_messages: int = 0
    stall_s: float = 0.0
    max_inflight_bytes: int = 0
    cpu_s: float = 0.0  # CPU time the writer thread spent writing (checksums, syscalls)


class WriterThread:
    """A daemon thread that appends queued messages; the only thread touching the LogWriter."""

    #: how often a not-yet-complete CUDA copy at the head of the queue is polled
    POLL_S = 0.0005

    def __init__(
        self,
        writer: LogWriter,
        max_inflight_bytes: int = 1 << 30,
        name: str = "ds-swift-log-writer",
        nice: int | None = 19,
    ) -> None:
        """
        Args:
            writer: the LogWriter this thread owns.
            max_inflight_bytes: queued bytes beyond which :meth:`submit` waits.
            nice: the writer thread's nice value (Linux: per thread), None to leave it. Without
                a copy engine (CPU training) the "bubble-time copy" is CPU work; at nice 19 the
                kernel gives the writer the cores the training ranks leave idle (their bubbles)
                and only a small share while they compute, and it is never starved outright
                (SCHED_IDLE could be: then backpressure would stall training).
        """
        self.writer = writer
        self.max_inflight_bytes = max_inflight_bytes
        self.nice = nice
        self.stats = WriterStats()
        self._q: deque[Any] = deque()
        self._cv = threading.Condition()
        self._inflight = 0
        self._errors: list[LogWriteError] = []
        self._raised = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A daemon thread dies silently at interpreter exit; write out what is queued first.
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self._thread.is_alive() and self.pending():
            try:
                self.call(lambda w: None, 60.0)
            except Exception as exc:  # at exit there is nobody left to raise to
                _log.error("message log: %d items not written at exit: %s", self.pending(), exc)

    # ------------------------------------------------------------ producer side
    def submit(self, item: WriteItem) -> None:
        with self._cv:
            if not self._thread.is_alive():
                raise LogWriteError(errno.EPIPE, "the message-log writer thread has stopped")
            if self._inflight and self._inflight + item.nbytes > self.max_inflight_bytes:
                t0 = time.perf_counter()
                while self._inflight and self._inflight + item.nbytes > self.max_inflight_bytes:
                    self._cv.wait(1.0)
                self.stats.stall_s += time.perf_counter() - t0
            self._inflight += item.nbytes
            self.stats.max_inflight_bytes = max(self.stats.max_inflight_bytes, self._inflight)
            self._q.append(item)
            self._cv.notify_all()

    def call(self, fn: Callable[[LogWriter], Any], timeout_s: float) -> Any:
        """Run ``fn(writer)`` on the writer thread after everything queued before it."""
        c = _Call(fn)
        with self._cv:
            self._q.append(c)
            self._cv.notify_all()
        if not c.done.wait(timeout_s):
            raise TimeoutError(f"message-log writer: {self.pending()} items still queued after {timeout_s:.1f} s")
        if c.error is not None:
            raise c.error
        return c.result

    def flush(self, timeout_s: float, sync: bool = False) -> None:
        """Wait until everything queued so far is on disk (fsync'd with ``sync``); raise any write error."""
        self.call((lambda w: w.sync()) if sync else (lambda w: None), timeout_s)
        self.check()

    def check(self) -> None:
        """Raise the first write error not raised yet."""
        with self._cv:
            if self._raised < len(self._errors):
                err = self._errors[self._raised]
                self._raised = len(self._errors)
                more = len(self._errors) - 1
                text = err.strerror or str(err)
                raise LogWriteError(err.errno, text + (f" (and {more} more failed writes)" if more > 0 else ""))

    @property
    def errors(self) -> list[LogWriteError]:
        with self._cv:
            return list(self._errors)

    def pending(self) -> int:
        with self._cv:
            return len(self._q)

    def inflight_bytes(self) -> int:
        with self._cv:
            return self._inflight

    def close(self, timeout_s: float = 60.0) -> None:
        atexit.unregister(self._at_exit)
        if self._thread.is_alive():
            try:
                self.call(lambda w: None, timeout_s)
            finally:
                with self._cv:
                    self._q.append(_STOP)
                    self._cv.notify_all()
                self._thread.join(timeout_s)
        self.writer.close()

    # ------------------------------------------------------------ consumer side
    def _run(self) -> None:
        if self.nice is not None and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError as exc:  # not permitted in some containers: run at normal priority
                _log.info("message-log writer keeps its priority: %s", exc)
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                item = self._q[0]
            if item is _STOP:
                with self._cv:
                    self._q.popleft()
                return
            if isinstance(item, _Call):
                try:
                    item.result = item.fn(self.writer)
                except BaseException as exc:  # handed to the caller, who raises it
                    item.error = exc
                with self._cv:
                    self._q.popleft()
                item.done.set()
                continue
            # One side stream: copies complete in order, so polling the head is enough.
            while not item.staged.ready():
                time.sleep(self.POLL_S)
            self._write(item)
            with self._cv:
                self._q.popleft()
                self._inflight -= item.nbytes
                self._cv.notify_all()

    def _write(self, item: WriteItem) -> None:
        cpu0 = time.thread_time()
        tensors = item.staged.take()
        try:
            n = self.writer.write(item.meta, tensors)
            self.stats.records += len(tensors)
            self.stats.messages += 1
            self.stats.bytes += n
        except LogWriteError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(LogWriteError(exc.errno, f"message log {self.writer.directory}: {exc}"))
        except Exception as exc:  # a bug must not kill the thread and leave flush() hanging
            self._fail(LogWriteError(errno.EIO, f"message log {self.writer.directory}: {type(exc).__name__}: {exc}"))
        finally:
            item.staged.release(tensors)
            self.stats.cpu_s += time.thread_time() - cpu0

    def _fail(self, exc: LogWriteError) -> None:
        _log.error("%s", exc)
        with self._cv:
            self._errors.append(exc)
            self.stats.failed_messages += 1
