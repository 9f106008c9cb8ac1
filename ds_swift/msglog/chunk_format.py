"""Chunk and index files of the message log, version 1 (records themselves: format.py).

Records go to **chunk files**, one per (edge, range of ``chunk_iterations`` iterations)::

    {kind}_s{src_stage:03d}-s{dst_stage:03d}_dp{dp_rank:04d}_tp{tp_rank:03d}_it{first:010d}-{end:010d}.swlog

holding iterations ``first <= t < end``. Beside each chunk, an **index** file with the same stem
and suffix ``.swidx``. All integers are little-endian.

Chunk file = file header, then records back to back::

    file header (64 bytes, FILE_HEADER):
      0  8s  magic b"SWLOGCHK"
      8  H   format version (1)
      10 H   header length (64)
      12 Q   first iteration (inclusive)
      20 Q   end iteration (exclusive)
      28 I   src rank      32 I  dst rank
      36 H   src stage     38 H  dst stage
      40 I   dp rank       44 H  tp rank
      46 B   kind (0 = activation, 1 = gradient)
      47 13x reserved (zero)
      60 I   crc32c of bytes 0..59

Index file = INDEX_HEADER (16 bytes: magic b"SWLOGIDX", version H, 6x reserved), then one
INDEX_ENTRY (40 bytes) per record, appended after the record itself is written::

      0 Q iteration   8 I micro-batch   12 B kind   13 B part   14 B num_parts   15 x
      16 Q record offset in the chunk   24 Q record length (header + payload)
      32 I payload crc32c               36 I crc32c of bytes 0..35 of this entry

The index is a cache: a writer killed mid-record leaves the index behind the chunk, and a reader
scans the chunk from the last indexed record on. A record's headers and payload each carry a
crc32c (Castagnoli, as the ``crc32c`` package computes it), so a flipped bit anywhere is caught
and reported with the file and the record's offset. When a chunk holds two records with the same
(iteration, micro-batch, kind, part) - a sender re-ran an iteration after recovery - the later
one wins.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.format import FORMAT_VERSION, KIND_CODES, KIND_NAMES, FormatError, RecordHeader, check_crc, crc32c

__all__ = [
    "CHUNK_SUFFIX",
    "FILE_HEADER_SIZE",
    "INDEX_ENTRY_SIZE",
    "INDEX_HEADER_SIZE",
    "INDEX_SUFFIX",
    "ChunkHeader",
    "ChunkName",
    "IndexEntry",
    "check_index_header",
    "pack_index_header",
]

CHUNK_SUFFIX = ".swlog"
INDEX_SUFFIX = ".swidx"

_FILE_HEADER = struct.Struct("<8sHHQQIIHHIHB13x")
_FILE_MAGIC = b"SWLOGCHK"
FILE_HEADER_SIZE = _FILE_HEADER.size + 4  # + crc

_INDEX_HEADER = struct.Struct("<8sH6x")
_INDEX_MAGIC = b"SWLOGIDX"
INDEX_HEADER_SIZE = _INDEX_HEADER.size
_INDEX_ENTRY = struct.Struct("<QIBBBxQQI")
INDEX_ENTRY_SIZE = _INDEX_ENTRY.size + 4

_U32 = struct.Struct("<I")

assert _FILE_HEADER.size == 60 and INDEX_ENTRY_SIZE == 40


@dataclass(frozen=True)
class ChunkName:
    """Which edge and iteration range a chunk file holds, parsed from / formatted to its name."""

    edge: LogEdge
    first_iteration: int
    end_iteration: int

    _RE = re.compile(
        r"^(?P<kind>act|grad)_s(?P<src>\d+)-s(?P<dst>\d+)_dp(?P<dp>\d+)_tp(?P<tp>\d+)_it(?P<first>\d+)-(?P<end>\d+)$"
    )

    @property
    def stem(self) -> str:
        e = self.edge
        return (
            f"{e.kind}_s{e.src_stage:03d}-s{e.dst_stage:03d}_dp{e.dp_rank:04d}_tp{e.tp_rank:03d}"
            f"_it{self.first_iteration:010d}-{self.end_iteration:010d}"
        )

    @property
    def chunk_file(self) -> str:
        return self.stem + CHUNK_SUFFIX

    @property
    def index_file(self) -> str:
        return self.stem + INDEX_SUFFIX

    @classmethod
    def for_iteration(cls, edge: LogEdge, iteration: int, chunk_iterations: int) -> ChunkName:
        first = iteration - iteration % chunk_iterations
        return cls(edge, first, first + chunk_iterations)

    @classmethod
    def parse(cls, filename: str) -> ChunkName | None:
        """The ChunkName of a ``.swlog``/``.swidx`` file name (no directories), else None."""
        for suffix in (CHUNK_SUFFIX, INDEX_SUFFIX):
            if filename.endswith(suffix):
                m = cls._RE.match(filename[: -len(suffix)])
                if m is None:
                    return None
                edge = LogEdge(m["kind"], int(m["src"]), int(m["dst"]), int(m["dp"]), int(m["tp"]))
                return cls(edge, int(m["first"]), int(m["end"]))
        return None


@dataclass(frozen=True)
class ChunkHeader:
    """The 64-byte header at the start of every chunk file (fields mirror the bytes, as RecordHeader's)."""

    first_iteration: int
    end_iteration: int
    src_rank: int
    dst_rank: int
    src_stage: int
    dst_stage: int
    dp_rank: int
    tp_rank: int
    kind: str
    version: int = FORMAT_VERSION

    @classmethod
    def for_chunk(cls, name: ChunkName, src_rank: int, dst_rank: int) -> ChunkHeader:
        e = name.edge
        return cls(
            name.first_iteration,
            name.end_iteration,
            src_rank,
            dst_rank,
            e.src_stage,
            e.dst_stage,
            e.dp_rank,
            e.tp_rank,
            e.kind,
        )

    @property
    def edge(self) -> LogEdge:
        return LogEdge(self.kind, self.src_stage, self.dst_stage, self.dp_rank, self.tp_rank)

    def pack(self) -> bytes:
        body = _FILE_HEADER.pack(
            _FILE_MAGIC,
            FORMAT_VERSION,
            FILE_HEADER_SIZE,
            self.first_iteration,
            self.end_iteration,
            self.src_rank,
            self.dst_rank,
            self.src_stage,
            self.dst_stage,
            self.dp_rank,
            self.tp_rank,
            KIND_CODES[self.kind],
        )
        return body + _U32.pack(crc32c(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> ChunkHeader:
        if len(data) < FILE_HEADER_SIZE:
            raise FormatError(f"truncated chunk header ({len(data)} of {FILE_HEADER_SIZE} bytes)")
        fields = _FILE_HEADER.unpack_from(data)
        if fields[0] != _FILE_MAGIC:
            raise FormatError(f"not a ds-swift log chunk (magic {bytes(fields[0])!r})")
        if fields[1] != FORMAT_VERSION:
            raise FormatError(f"chunk format version {fields[1]} is not supported (this reader: {FORMAT_VERSION})")
        (stored,) = _U32.unpack_from(data, _FILE_HEADER.size)
        check_crc("chunk header", memoryview(data)[: _FILE_HEADER.size], stored)
        if fields[11] not in KIND_NAMES:
            raise FormatError(f"unknown kind code {fields[11]} in chunk header")
        return cls(
            first_iteration=fields[3],
            end_iteration=fields[4],
            src_rank=fields[5],
            dst_rank=fields[6],
            src_stage=fields[7],
            dst_stage=fields[8],
            dp_rank=fields[9],
            tp_rank=fields[10],
            kind=KIND_NAMES[fields[11]],
            version=fields[1],
        )


def pack_index_header() -> bytes:
    return _INDEX_HEADER.pack(_INDEX_MAGIC, FORMAT_VERSION)


def check_index_header(data: bytes | memoryview) -> None:
    if len(data) < INDEX_HEADER_SIZE:
        raise FormatError("truncated index header")
    magic, version = _INDEX_HEADER.unpack_from(data)
    if magic != _INDEX_MAGIC:
        raise FormatError(f"not a ds-swift log index (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise FormatError(f"index format version {version} is not supported (this reader: {FORMAT_VERSION})")


@dataclass(frozen=True)
class IndexEntry:
    """Where one record sits in its chunk."""

    iteration: int
    micro_batch: int
    kind: str
    part: int
    num_parts: int
    offset: int
    length: int
    payload_crc: int

    @property
    def key(self) -> tuple[int, int, str, int]:
        return (self.iteration, self.micro_batch, self.kind, self.part)

    def pack(self) -> bytes:
        body = _INDEX_ENTRY.pack(
            self.iteration,
            self.micro_batch,
            KIND_CODES[self.kind],
            self.part,
            self.num_parts,
            self.offset,
            self.length,
            self.payload_crc,
        )
        return body + _U32.pack(crc32c(body))

    @classmethod
    def unpack(cls, data: bytes | memoryview, offset: int = 0) -> IndexEntry:
        view = memoryview(data)[offset : offset + INDEX_ENTRY_SIZE]
        if len(view) < INDEX_ENTRY_SIZE:
            raise FormatError("truncated index entry")
        (stored,) = _U32.unpack_from(view, _INDEX_ENTRY.size)
        check_crc("index entry", view[: _INDEX_ENTRY.size], stored)
        it, mb, kind, part, num_parts, off, length, pcrc = _INDEX_ENTRY.unpack_from(view)
        if kind not in KIND_NAMES:
            raise FormatError(f"unknown kind code {kind} in index entry")
        return cls(it, mb, KIND_NAMES[kind], part, num_parts, off, length, pcrc)

    @classmethod
    def for_record(cls, header: RecordHeader, offset: int) -> IndexEntry:
        return cls(
            header.iteration,
            header.micro_batch,
            header.kind,
            header.part,
            header.num_parts,
            offset,
            header.record_size,
            header.payload_crc,
        )
