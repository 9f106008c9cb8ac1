"""On-disk format of the message log, version 1. Pure ``struct`` code: no torch, no DeepSpeed.

A sender logs every tensor it sends across a logged (machine- or group-crossing) pipeline edge.
One **record** per tensor that DeepSpeed hands to ``p2p.send``; a multi-tensor activation (a
tuple) is ``num_parts`` records with ``part = 0..num_parts-1`` and the same timestamp.

Files
-----
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

    record header (RECORD_FIXED + 8 * ndim + 4 bytes):
      0  4s  magic b"SWLR"
      4  H   format version (1)
      6  H   header length in bytes (fixed part + shape + header crc)
      8  Q   iteration          (engine.global_steps during the send)
      16 I   micro-batch        (index of this send kind within the iteration, 0..gas-1)
      20 H   src stage          22 H  dst stage
      24 I   src rank           28 I  dst rank
      32 I   dp rank            36 H  tp rank
      38 B   kind (0 act, 1 grad)
      39 B   dtype code (DTYPE_CODES)
      40 B   part               41 B  num_parts
      42 B   ndim               43 x  reserved
      44 Q   payload byte length
      52 I   crc32c of the payload
      56 q*ndim  shape
      ..  I   crc32c of every header byte before it
    payload: the tensor's bytes, C-contiguous, native little-endian element order.

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

import crc32c as _crc32c

__all__ = [
    "CHUNK_SUFFIX",
    "DTYPE_CODES",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "INDEX_SUFFIX",
    "KIND_CODES",
    "ChunkHeader",
    "ChunkName",
    "FormatError",
    "IndexEntry",
    "RecordHeader",
    "crc32c",
]

FORMAT_VERSION = 1
CHUNK_SUFFIX = ".swlog"
INDEX_SUFFIX = ".swidx"

KIND_CODES: dict[str, int] = {"act": 0, "grad": 1}
KIND_NAMES: dict[int, str] = {v: k for k, v in KIND_CODES.items()}

#: dtype name (as in ``str(torch.float32)`` without the ``torch.`` prefix) -> code. Codes never change.
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int64": 5,
    "int32": 6,
    "int16": 7,
    "int8": 8,
    "uint8": 9,
    "bool": 10,
    "float8_e4m3fn": 11,
    "float8_e5m2": 12,
}
DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_FILE_HEADER = struct.Struct("<8sHHQQIIHHIHB13x")
_FILE_MAGIC = b"SWLOGCHK"
FILE_HEADER_SIZE = _FILE_HEADER.size + 4  # + crc

_RECORD_FIXED = struct.Struct("<4sHHQIHHIIIHBBBBBxQI")
_RECORD_MAGIC = b"SWLR"
#: offset of the payload crc inside the fixed record header (the native writer patches it there)
RECORD_PAYLOAD_CRC_OFFSET = _RECORD_FIXED.size - 4
RECORD_FIXED_SIZE = _RECORD_FIXED.size

_INDEX_HEADER = struct.Struct("<8sH6x")
_INDEX_MAGIC = b"SWLOGIDX"
INDEX_HEADER_SIZE = _INDEX_HEADER.size
_INDEX_ENTRY = struct.Struct("<QIBBBxQQI")
INDEX_ENTRY_SIZE = _INDEX_ENTRY.size + 4

_U32 = struct.Struct("<I")

assert _FILE_HEADER.size == 60 and _RECORD_FIXED.size == 56 and INDEX_ENTRY_SIZE == 40


class FormatError(ValueError):
    """Bytes that are not a valid message-log structure (bad magic, version, length or checksum)."""


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def _check_crc(what: str, body: bytes | memoryview, stored: int) -> None:
    actual = crc32c(body)
    if actual != stored:
        raise FormatError(f"{what}: checksum mismatch (stored {stored:#010x}, computed {actual:#010x})")


@dataclass(frozen=True)
class RecordHeader:
    """The header of one logged tensor (see the module docstring for the byte layout)."""

    iteration: int
    micro_batch: int
    src_stage: int
    dst_stage: int
    src_rank: int
    dst_rank: int
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    payload_crc: int = 0
    part: int = 0
    num_parts: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KIND_CODES:
            raise FormatError(f"record kind {self.kind!r} is not one of {sorted(KIND_CODES)}")
        if self.dtype not in DTYPE_CODES:
            raise FormatError(f"dtype {self.dtype!r} cannot be logged; supported: {sorted(DTYPE_CODES)}")
        if not 0 <= self.part < self.num_parts <= 255:
            raise FormatError(f"record part {self.part} of {self.num_parts} is out of range")
        if len(self.shape) > 255:
            raise FormatError(f"tensor rank {len(self.shape)} exceeds 255")
        expected = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            expected *= d
        if expected != self.nbytes:
            raise FormatError(f"record nbytes={self.nbytes} does not match {self.dtype}{list(self.shape)}")

    @property
    def header_size(self) -> int:
        return RECORD_FIXED_SIZE + 8 * len(self.shape) + 4

    @property
    def record_size(self) -> int:
        return self.header_size + self.nbytes

    @property
    def key(self) -> tuple[int, int, str, int]:
        """(iteration, micro-batch, kind, part): what the index maps to an offset."""
        return (self.iteration, self.micro_batch, self.kind, self.part)

    def pack(self, payload_crc: int | None = None) -> bytes:
        """The header bytes, header crc included. ``payload_crc`` overrides the stored one."""
        crc = self.payload_crc if payload_crc is None else payload_crc
        body = _RECORD_FIXED.pack(
            _RECORD_MAGIC,
            FORMAT_VERSION,
            self.header_size,
            self.iteration,
            self.micro_batch,
            self.src_stage,
            self.dst_stage,
            self.src_rank,
            self.dst_rank,
            self.dp_rank,
            self.tp_rank,
            KIND_CODES[self.kind],
            DTYPE_CODES[self.dtype],
            self.part,
            self.num_parts,
            len(self.shape),
            self.nbytes,
            crc,
        ) + struct.pack(f"<{len(self.shape)}q", *self.shape)
        return body + _U32.pack(crc32c(body))

    @classmethod
    def peek_size(cls, fixed: bytes | memoryview) -> int:
        """Header length from the first RECORD_FIXED_SIZE bytes (checks the magic and version)."""
        if len(fixed) < RECORD_FIXED_SIZE:
            raise FormatError(f"truncated record header ({len(fixed)} of {RECORD_FIXED_SIZE} bytes)")
        magic, version, header_len = struct.unpack_from("<4sHH", fixed)
        if magic != _RECORD_MAGIC:
            raise FormatError(f"bad record magic {bytes(magic)!r}")
        if version != FORMAT_VERSION:
            raise FormatError(f"record format version {version} is not supported (this reader: {FORMAT_VERSION})")
        if header_len < RECORD_FIXED_SIZE + 4 or (header_len - RECORD_FIXED_SIZE - 4) % 8:
            raise FormatError(f"bad record header length {header_len}")
        return int(header_len)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> RecordHeader:
        """Parse and verify (magic, version, header crc) a complete header."""
        size = cls.peek_size(data)
        if len(data) < size:
            raise FormatError(f"truncated record header ({len(data)} of {size} bytes)")
        (stored,) = _U32.unpack_from(data, size - 4)
        _check_crc("record header", memoryview(data)[: size - 4], stored)
        (
            _magic,
            version,
            _hlen,
            iteration,
            micro,
            src_stage,
            dst_stage,
            src_rank,
            dst_rank,
            dp_rank,
            tp_rank,
            kind,
            dtype,
            part,
            num_parts,
            ndim,
            nbytes,
            payload_crc,
        ) = _RECORD_FIXED.unpack_from(data)
        if RECORD_FIXED_SIZE + 8 * ndim + 4 != size:
            raise FormatError(f"record header length {size} does not match ndim={ndim}")
        if kind not in KIND_NAMES or dtype not in DTYPE_NAMES:
            raise FormatError(f"unknown kind code {kind} or dtype code {dtype}")
        shape = struct.unpack_from(f"<{ndim}q", data, RECORD_FIXED_SIZE)
        return cls(
            iteration=iteration,
            micro_batch=micro,
            src_stage=src_stage,
            dst_stage=dst_stage,
            src_rank=src_rank,
            dst_rank=dst_rank,
            kind=KIND_NAMES[kind],
            dtype=DTYPE_NAMES[dtype],
            shape=tuple(shape),
            nbytes=nbytes,
            payload_crc=payload_crc,
            part=part,
            num_parts=num_parts,
            dp_rank=dp_rank,
            tp_rank=tp_rank,
            version=version,
        )


@dataclass(frozen=True)
class ChunkName:
    """Which edge and iteration range a chunk file holds, parsed from / formatted to its name."""

    kind: str
    src_stage: int
    dst_stage: int
    dp_rank: int
    tp_rank: int
    first_iteration: int
    end_iteration: int

    _RE = re.compile(
        r"^(?P<kind>act|grad)_s(?P<src>\d+)-s(?P<dst>\d+)_dp(?P<dp>\d+)_tp(?P<tp>\d+)_it(?P<first>\d+)-(?P<end>\d+)$"
    )

    @property
    def stem(self) -> str:
        return (
            f"{self.kind}_s{self.src_stage:03d}-s{self.dst_stage:03d}_dp{self.dp_rank:04d}_tp{self.tp_rank:03d}"
            f"_it{self.first_iteration:010d}-{self.end_iteration:010d}"
        )

    @property
    def chunk_file(self) -> str:
        return self.stem + CHUNK_SUFFIX

    @property
    def index_file(self) -> str:
        return self.stem + INDEX_SUFFIX

    @property
    def edge(self) -> tuple[str, int, int, int, int]:
        return (self.kind, self.src_stage, self.dst_stage, self.dp_rank, self.tp_rank)

    @classmethod
    def for_iteration(
        cls, kind: str, src_stage: int, dst_stage: int, dp_rank: int, tp_rank: int, iteration: int, chunk_iterations: int
    ) -> ChunkName:
        first = iteration - iteration % chunk_iterations
        return cls(kind, src_stage, dst_stage, dp_rank, tp_rank, first, first + chunk_iterations)

    @classmethod
    def parse(cls, filename: str) -> ChunkName | None:
        """The ChunkName of a ``.swlog``/``.swidx`` file name (no directories), else None."""
        for suffix in (CHUNK_SUFFIX, INDEX_SUFFIX):
            if filename.endswith(suffix):
                m = cls._RE.match(filename[: -len(suffix)])
                if m is None:
                    return None
                return cls(
                    m["kind"], int(m["src"]), int(m["dst"]), int(m["dp"]), int(m["tp"]), int(m["first"]), int(m["end"])
                )
        return None


@dataclass(frozen=True)
class ChunkHeader:
    """The 64-byte header at the start of every chunk file."""

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
        _check_crc("chunk header", memoryview(data)[: _FILE_HEADER.size], stored)
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
        _check_crc("index entry", view[: _INDEX_ENTRY.size], stored)
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
