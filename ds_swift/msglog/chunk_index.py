"""One chunk file of the message log, indexed: trust its index where consistent, scan the rest.

A writer killed mid-record leaves the index behind the chunk (or a torn record at its end), so
:func:`load_chunk` reads the index entries that point at consecutive records inside the file and
scans the chunk from the last of them on, stopping at the first record that does not parse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ds_swift.msglog.chunk_format import (
    FILE_HEADER_SIZE,
    INDEX_ENTRY_SIZE,
    INDEX_HEADER_SIZE,
    ChunkHeader,
    ChunkName,
    IndexEntry,
    check_index_header,
)
from ds_swift.msglog.format import RECORD_FIXED_SIZE, FormatError, RecordHeader, crc32c

__all__ = ["ChunkInfo", "Key", "ScanResult", "load_chunk", "scan_chunk"]

Key = tuple[int, int, str, int]  # (iteration, micro-batch, kind, part)


@dataclass
class ScanResult:
    records: list[tuple[RecordHeader, int]]
    end: int  # offset after the last valid record
    size: int
    error: str | None = None


def scan_chunk(
    path: str | os.PathLike[str], start: int = FILE_HEADER_SIZE, verify_payload: bool = False, first_record: int = 0
) -> ScanResult:
    """Walk a chunk's records from ``start`` (record number ``first_record``), stopping at the first bad one."""
    records: list[tuple[RecordHeader, int]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if start == FILE_HEADER_SIZE:
            try:
                ChunkHeader.unpack(f.read(FILE_HEADER_SIZE))
            except FormatError as exc:
                return ScanResult(records, 0, size, str(exc))
        offset = start
        f.seek(offset)
        while offset < size:
            try:
                fixed = f.read(RECORD_FIXED_SIZE)
                hsize = RecordHeader.peek_size(fixed)
                header = RecordHeader.unpack(fixed + f.read(hsize - RECORD_FIXED_SIZE))
            except FormatError as exc:
                return ScanResult(
                    records, offset, size, f"record #{first_record + len(records)} at offset {offset}: {exc}"
                )
            if offset + header.record_size > size:
                return ScanResult(
                    records,
                    offset,
                    size,
                    f"record #{first_record + len(records)} at offset {offset}: truncated payload",
                )
            if verify_payload:
                if crc32c(f.read(header.nbytes)) != header.payload_crc:
                    return ScanResult(
                        records,
                        offset,
                        size,
                        f"record #{first_record + len(records)} at offset {offset}: payload checksum mismatch",
                    )
            else:
                f.seek(header.nbytes, os.SEEK_CUR)
            records.append((header, offset))
            offset += header.record_size
        return ScanResult(records, offset, size)


@dataclass
class ChunkInfo:
    """A chunk's name, header and index (from the index file, completed by a scan of the tail)."""

    name: ChunkName
    path: Path
    header: ChunkHeader | None
    entries: dict[Key, IndexEntry]
    order: list[IndexEntry]  # file order, duplicates included
    size: int
    problems: list[str] = field(default_factory=list)

    @property
    def record_numbers(self) -> dict[int, int]:
        """Offset -> position of the record in the file (for error messages)."""
        if len(self._numbers) != len(self.order):
            self._numbers = {e.offset: n for n, e in enumerate(self.order)}
        return self._numbers

    _numbers: dict[int, int] = field(default_factory=dict, repr=False)


def _read_index(idx_path: Path, chunk_size: int) -> tuple[list[IndexEntry], str | None]:
    if not idx_path.exists():
        return [], "index file missing"
    data = idx_path.read_bytes()
    try:
        check_index_header(data)
    except FormatError as exc:
        return [], str(exc)
    entries: list[IndexEntry] = []
    expected = FILE_HEADER_SIZE
    for off in range(INDEX_HEADER_SIZE, len(data) - INDEX_ENTRY_SIZE + 1, INDEX_ENTRY_SIZE):
        try:
            e = IndexEntry.unpack(data, off)
        except FormatError as exc:
            return entries, f"index entry #{len(entries)}: {exc}"
        # Entries are appended after their record, in file order: anything else is not ours.
        if e.offset != expected or e.offset + e.length > chunk_size:
            return entries, f"index entry #{len(entries)} points outside the chunk"
        entries.append(e)
        expected = e.offset + e.length
    return entries, None


def load_chunk(path: str | os.PathLike[str]) -> ChunkInfo:
    """Index a chunk: trust the index where it is consistent, scan the rest of the file."""
    path = Path(path)
    name = ChunkName.parse(path.name)
    if name is None:
        raise FormatError(f"{path}: not a log chunk file name")
    size = path.stat().st_size
    problems: list[str] = []
    header: ChunkHeader | None = None
    with open(path, "rb") as f:
        try:
            header = ChunkHeader.unpack(f.read(FILE_HEADER_SIZE))
        except FormatError as exc:
            problems.append(f"{path}: chunk header: {exc}")
    order: list[IndexEntry] = []
    if header is not None:
        order, idx_problem = _read_index(path.with_name(name.index_file), size)
        if idx_problem and idx_problem != "index file missing":
            problems.append(f"{path.with_name(name.index_file)}: {idx_problem}; rebuilt by scanning the chunk")
        start = order[-1].offset + order[-1].length if order else FILE_HEADER_SIZE
        if start < size:
            scan = scan_chunk(path, start, first_record=len(order))
            order.extend(IndexEntry.for_record(h, off) for h, off in scan.records)
            if scan.error:
                problems.append(f"{path}: {scan.error}")
    entries = {e.key: e for e in order}  # later records win (an iteration re-run after recovery)
    return ChunkInfo(name, path, header, entries, order, size, problems)
