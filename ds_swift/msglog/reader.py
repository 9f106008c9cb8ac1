"""Reading message logs: chunk scan, index lookup, checksum verification, tensors back.

``LogReader(location)`` takes a local directory or a store URL (``file://``, ``hdfs://``,
``s3://``, ``memory://``); for a remote store, chunks are downloaded on first use into a cache
directory and verified against their upload checksums (ds_swift.storage). Every payload read is
checked against its record crc32c; a mismatch raises :class:`CorruptRecordError` naming the file,
the record number and its offset. A message that is not in the log raises
:class:`MissingRecordError`: replay must never run on data that is not what was sent.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ds_swift.msglog.chunk_format import CHUNK_SUFFIX, ChunkName, IndexEntry
from ds_swift.msglog.chunk_index import ChunkInfo, Key, load_chunk
from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.format import FormatError, RecordHeader, crc32c

if TYPE_CHECKING:
    import torch

    from ds_swift.storage import Store

__all__ = [
    "CorruptRecordError",
    "LogReader",
    "LogRecord",
    "MissingRecordError",
    "RecordError",
    "VerifyReport",
]


class CorruptRecordError(FormatError):
    """A record whose bytes do not match its checksum (or cannot be parsed)."""


class MissingRecordError(LookupError):
    """The requested message is not in the log."""


@dataclass(frozen=True)
class RecordError:
    """One problem found while verifying: which file, which record, what."""

    file: str
    record: int | None
    offset: int
    key: Key | None
    message: str

    def __str__(self) -> str:
        where = f"record #{self.record} at offset {self.offset}" if self.record is not None else f"offset {self.offset}"
        what = ""
        if self.key is not None:
            it, mb, kind, part = self.key
            what = f" (iteration {it}, micro-batch {mb}, {kind}, part {part})"
        return f"{self.file}: {where}{what}: {self.message}"


@dataclass(frozen=True)
class LogRecord:
    header: RecordHeader
    tensor: torch.Tensor
    file: str
    offset: int


@dataclass
class VerifyReport:
    chunks: int = 0
    records: int = 0
    bytes_on_disk: int = 0
    errors: list[RecordError] = field(default_factory=list)
    #: (kind, src_stage, dst_stage, dp_rank, tp_rank) -> iteration -> bytes (records, headers included)
    bytes_per_edge_iteration: dict[LogEdge, dict[int, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors


def _is_store(directory: Path) -> bool:
    """Whether a directory is a file:// store (uploads with checksum sidecars), not a writer's chunks."""
    from ds_swift.storage.store import CRC_SUFFIX

    return any(p.name.endswith(CHUNK_SUFFIX + CRC_SUFFIX) for p in directory.iterdir())


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"dtype {name!r} is not available in this torch")
    return dtype


def _to_tensor(header: RecordHeader, payload: bytes | bytearray) -> torch.Tensor:
    import torch

    dtype = _torch_dtype(header.dtype)
    if header.nbytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(header.shape)


class LogReader:
    """Random and sequential access to the records under a directory or store URL.

    Args:
        location: a directory of chunk files, or a store URL (see ds_swift.storage.open_store).
        cache_dir: where a remote store's chunks are downloaded (a temporary directory if None).
        store: an already opened Store (tests pass one with a fake client).
    """

    def __init__(
        self, location: str | os.PathLike[str], cache_dir: str | None = None, store: Store | None = None
    ) -> None:
        from ds_swift.storage import local_path_of, open_store

        self.location = str(location)
        self._store: Store | None = None
        local = local_path_of(self.location) if store is None else None
        if local is not None and not local.is_dir():
            what = "is a file, not a directory" if local.exists() else "does not exist"
            raise FileNotFoundError(f"message log directory {local} {what}")
        if local is not None and not _is_store(local):
            # chunks as the writer wrote them (no checksum sidecars): read in place
            self.directory = local
            names = sorted(p.name for p in self.directory.iterdir() if p.name.endswith(CHUNK_SUFFIX))
        else:
            # a store: file:// holds the uploads' objects (NAME~TOKEN) and sidecars, like any other
            self._store = store or open_store(self.location)
            self._tmp = None if cache_dir else tempfile.TemporaryDirectory(prefix="ds-swift-logs-")
            self.directory = Path(cache_dir or self._tmp.name)  # type: ignore[union-attr]
            self.directory.mkdir(parents=True, exist_ok=True)
            names = sorted(n for n in self._store.names() if n.endswith(CHUNK_SUFFIX))
        self._names: dict[str, ChunkName] = {}
        for n in names:
            cn = ChunkName.parse(n)
            if cn is not None:
                self._names[n] = cn
        self._chunks: dict[str, ChunkInfo] = {}

    # ------------------------------------------------------------ chunks
    def chunk_names(self) -> list[ChunkName]:
        return sorted(self._names.values(), key=lambda c: (c.edge, c.first_iteration))

    def _local(self, filename: str) -> Path:
        path = self.directory / filename
        if self._store is not None and not path.exists():
            # the index before its chunk: uploads go the other way round (msglog.upload), so the
            # index can only be older than the chunk, a gap the chunk scan fills
            idx = self._names[filename].index_file
            if self._store.exists(idx):
                self._store.get_file(idx, self.directory / idx)
            self._store.get_file(filename, path)
        return path

    def chunk(self, cn: ChunkName) -> ChunkInfo:
        info = self._chunks.get(cn.chunk_file)
        if info is None:
            info = load_chunk(self._local(cn.chunk_file))
            self._chunks[cn.chunk_file] = info
        return info

    def _find(self, edge: LogEdge, iteration: int) -> ChunkName:
        for cn in self._names.values():
            if cn.edge == edge and cn.first_iteration <= iteration < cn.end_iteration:
                return cn
        have = sorted((c.first_iteration, c.end_iteration) for c in self._names.values() if c.edge == edge)
        raise MissingRecordError(
            f"message log {self.location}: no chunk holds {edge} iteration {iteration} "
            f"(chunks of this edge cover {have or 'nothing'})"
        )

    # ------------------------------------------------------------ records
    def _read(self, info: ChunkInfo, entry: IndexEntry) -> tuple[RecordHeader, bytes]:
        record_no = info.record_numbers.get(entry.offset)
        where = RecordError(str(info.path), record_no, entry.offset, entry.key, "")
        with open(info.path, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.length)
        try:
            header = RecordHeader.unpack(data)
        except FormatError as exc:
            raise CorruptRecordError(
                str(RecordError(where.file, record_no, entry.offset, entry.key, str(exc)))
            ) from exc
        if header.key != entry.key or header.record_size != entry.length:
            raise CorruptRecordError(
                str(
                    RecordError(where.file, record_no, entry.offset, entry.key, "record does not match its index entry")
                )
            )
        payload = data[header.header_size :]
        if len(payload) != header.nbytes:
            raise CorruptRecordError(
                str(RecordError(where.file, record_no, entry.offset, entry.key, "truncated payload"))
            )
        if crc32c(payload) != header.payload_crc:
            raise CorruptRecordError(
                str(RecordError(where.file, record_no, entry.offset, entry.key, "payload checksum mismatch"))
            )
        return header, payload

    def get(
        self,
        iteration: int,
        micro_batch: int,
        kind: str,
        src_stage: int,
        dst_stage: int,
        dp_rank: int = 0,
        tp_rank: int = 0,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The tensor (or the tuple of tensors) sent at that timestamp on that edge."""
        return self.message(LogEdge(kind, src_stage, dst_stage, dp_rank, tp_rank), iteration, micro_batch)

    def message(self, edge: LogEdge, iteration: int, micro_batch: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The tensor (or the tuple of tensors) sent on ``edge`` at (iteration, micro-batch)."""
        info = self.chunk(self._find(edge, iteration))
        kind = edge.kind
        first = info.entries.get((iteration, micro_batch, kind, 0))
        if first is None:
            # A chunk cut short (a write or a copy that did not finish) shows as records missing at
            # its end: say what its index and scan found.
            found = f" ({'; '.join(info.problems)})" if info.problems else ""
            raise MissingRecordError(
                f"message log {self.location}: {info.path.name} has no {kind} record for iteration {iteration} "
                f"micro-batch {micro_batch}{found}"
            )
        tensors = []
        for part in range(first.num_parts):
            entry = info.entries.get((iteration, micro_batch, kind, part))
            if entry is None:
                raise MissingRecordError(
                    f"message log {self.location}: {info.path.name}: iteration {iteration} micro-batch {micro_batch} "
                    f"{kind} has part 0 of {first.num_parts} but not part {part}"
                )
            header, payload = self._read(info, entry)
            tensors.append(_to_tensor(header, payload))
        return tensors[0] if first.num_parts == 1 else tuple(tensors)

    def iter_records(
        self,
        kind: str | None = None,
        src_stage: int | None = None,
        dst_stage: int | None = None,
        dp_rank: int | None = None,
        tp_rank: int | None = None,
        start_iteration: int = 0,
        end_iteration: int | None = None,
    ) -> Iterator[LogRecord]:
        """Records in timestamp order: (iteration, micro-batch, kind, src stage, part); filters are ANDed."""
        selected: list[tuple[tuple[int, int, str, int, int], ChunkInfo, IndexEntry]] = []
        for cn in self.chunk_names():
            wanted = (kind, src_stage, dst_stage, dp_rank, tp_rank)
            if any(w is not None and w != have for w, have in zip(wanted, cn.edge)):
                continue
            if cn.end_iteration <= start_iteration or (
                end_iteration is not None and cn.first_iteration >= end_iteration
            ):
                continue
            info = self.chunk(cn)
            for e in info.entries.values():
                if e.iteration >= start_iteration and (end_iteration is None or e.iteration < end_iteration):
                    selected.append(((e.iteration, e.micro_batch, e.kind, cn.edge.src_stage, e.part), info, e))
        selected.sort(key=lambda x: (x[0], x[1].name.edge.dp_rank, x[1].name.edge.tp_rank))
        for _, info, e in selected:
            header, payload = self._read(info, e)
            yield LogRecord(header, _to_tensor(header, payload), str(info.path), e.offset)

    # ------------------------------------------------------------ verification
    def verify(self) -> VerifyReport:
        """Read every record of every chunk and check every checksum; never raises for bad data."""
        report = VerifyReport()
        for cn in self.chunk_names():
            try:
                info = self.chunk(cn)
            except OSError as exc:  # a download that failed its checksum, a missing object
                report.errors.append(RecordError(cn.chunk_file, None, 0, None, str(exc)))
                continue
            report.chunks += 1
            report.bytes_on_disk += info.size
            idx = info.path.with_name(cn.index_file)
            if idx.exists():
                report.bytes_on_disk += idx.stat().st_size
            for problem in info.problems:
                report.errors.append(RecordError(str(info.path), None, 0, None, problem))
            per_it = report.bytes_per_edge_iteration.setdefault(cn.edge, {})
            for n, e in enumerate(info.order):
                try:
                    self._read(info, e)
                except CorruptRecordError as exc:
                    report.errors.append(RecordError(str(info.path), n, e.offset, e.key, str(exc).rsplit(": ", 1)[-1]))
                    continue
                report.records += 1
                per_it[e.iteration] = per_it.get(e.iteration, 0) + e.length
        return report
