"""Appending records to chunk files (the writer thread that calls this is msglog.writer_thread).

Layers, bottom up:

- an *appender* writes one record (header + payload) to a file descriptor and returns the
  payload's crc32c: :class:`PythonAppender` (``crc32c`` package + ``os.writev``, both release the
  GIL for large buffers) or :class:`NativeAppender` (cuda_ext: crc32c + writev in C++ with the
  GIL released). Both write identical bytes.
- :class:`ChunkWriter` owns one chunk file and its index, appends records, and on open *recovers*
  an existing chunk (a writer killed mid-record leaves a torn tail: it is truncated away).
- :class:`LogWriter` routes messages to the chunk of their (edge, iteration range), rotating
  files every ``chunk_iterations`` iterations.

A write that fails (ENOSPC, EIO, ...) raises a :class:`LogWriteError` naming the file.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from ds_swift.msglog.chunk_format import FILE_HEADER_SIZE, ChunkHeader, ChunkName, IndexEntry, pack_index_header
from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.format import RECORD_PAYLOAD_CRC_OFFSET, RecordHeader, crc32c

__all__ = [
    "Appender",
    "ChunkWriter",
    "LogWriteError",
    "LogWriter",
    "MessageMeta",
    "NativeAppender",
    "PythonAppender",
    "make_appender",
    "payload_bytes",
    "record_header",
    "write_all",
]

_log = logging.getLogger(__name__)


class LogWriteError(OSError):
    """Writing a log record failed; the message names the chunk file."""


@dataclass(frozen=True)
class MessageMeta:
    """Everything about one logged send but its tensors: its timestamp, edge and the two global ranks."""

    iteration: int
    micro_batch: int
    edge: LogEdge
    src_rank: int
    dst_rank: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def payload_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D contiguous uint8 CPU tensor (no copy when already contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def record_header(meta: MessageMeta, t: torch.Tensor, part: int, num_parts: int) -> RecordHeader:
    edge = meta.edge
    return RecordHeader(
        iteration=meta.iteration,
        micro_batch=meta.micro_batch,
        src_stage=edge.src_stage,
        dst_stage=edge.dst_stage,
        src_rank=meta.src_rank,
        dst_rank=meta.dst_rank,
        kind=edge.kind,
        dtype=dtype_name(t.dtype),
        shape=tuple(int(d) for d in t.shape),
        nbytes=t.numel() * t.element_size(),
        part=part,
        num_parts=num_parts,
        dp_rank=edge.dp_rank,
        tp_rank=edge.tp_rank,
    )


# --------------------------------------------------------------------------- appenders
class Appender(Protocol):
    name: str

    def append(self, fd: int, header: RecordHeader, payload: torch.Tensor) -> int:
        """Write header (with crcs filled in) + payload at fd's position; return the payload crc."""
        ...


def write_all(fd: int, buffers: list[Any]) -> None:
    """``os.writev`` until every byte of ``buffers`` is written (it may write part of them)."""
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
        write_all(fd, [header.pack(crc), data])
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
            write_all(self.fd, [header.pack()])
            write_all(self.index_fd, [pack_index_header()])
        except OSError as exc:
            self.close()
            raise LogWriteError(exc.errno, f"cannot create log chunk {self.path}: {_describe(exc)}") from exc
        self.offset = FILE_HEADER_SIZE

    def _recover(self) -> None:
        # Appending to a chunk that exists: a previous writer (killed, or this process before a
        # recovery re-ran an iteration) may have left a torn last record. Keep the valid prefix.
        from ds_swift.msglog.chunk_index import scan_chunk

        scan = scan_chunk(self.path)
        if scan.error:
            _log.warning(
                "log chunk %s: dropping a torn/corrupt tail at offset %d (%s)", self.path, scan.end, scan.error
            )
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
            write_all(self.index_fd, [IndexEntry.for_record(written, start).pack()])
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
        self._open: dict[LogEdge, ChunkWriter] = {}
        self.files: set[str] = set()

    def write(self, meta: MessageMeta, tensors: list[torch.Tensor]) -> int:
        """Append one message (one record per tensor); return the bytes written."""
        name = ChunkName.for_iteration(meta.edge, meta.iteration, self.chunk_iterations)
        cw = self._open.get(name.edge)
        if cw is None or cw.name != name:
            if cw is not None:
                cw.close()
                del self._open[name.edge]
            header = ChunkHeader.for_chunk(name, meta.src_rank, meta.dst_rank)
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
