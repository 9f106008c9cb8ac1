"""On-disk format of the message log, version 1. Pure ``struct`` code: no torch, no DeepSpeed.

A sender logs every tensor it sends across a logged (machine- or group-crossing) pipeline edge.
One **record** per tensor that DeepSpeed hands to ``p2p.send``; a multi-tensor activation (a
tuple) is ``num_parts`` records with ``part = 0..num_parts-1`` and the same timestamp.

Records are grouped into chunk files with an index beside each; chunk_format.py describes
those. All integers are little-endian. A record is a header, then the payload::

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

A record's headers and payload each carry a crc32c (Castagnoli, as the ``crc32c`` package
computes it), so a flipped bit anywhere is caught and reported with the file and the record's
offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c

from ds_swift.msglog.edge import LogEdge

__all__ = [
    "DTYPE_CODES",
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "KIND_CODES",
    "FormatError",
    "RecordHeader",
    "check_crc",
    "crc32c",
]

FORMAT_VERSION = 1

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

_RECORD_FIXED = struct.Struct("<4sHHQIHHIIIHBBBBBxQI")
_RECORD_MAGIC = b"SWLR"
#: offset of the payload crc inside the fixed record header (the native writer patches it there)
RECORD_PAYLOAD_CRC_OFFSET = _RECORD_FIXED.size - 4
RECORD_FIXED_SIZE = _RECORD_FIXED.size

_U32 = struct.Struct("<I")

assert _RECORD_FIXED.size == 56


class FormatError(ValueError):
    """Bytes that are not a valid message-log structure (bad magic, version, length or checksum)."""


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def check_crc(what: str, body: bytes | memoryview, stored: int) -> None:
    """Raise FormatError naming ``what`` unless ``body``'s crc32c equals ``stored``."""
    actual = crc32c(body)
    if actual != stored:
        raise FormatError(f"{what}: checksum mismatch (stored {stored:#010x}, computed {actual:#010x})")


@dataclass(frozen=True)
class RecordHeader:
    """The header of one logged tensor (see the module docstring for the byte layout).

    The fields mirror the bytes one to one; :attr:`edge` is the :class:`LogEdge` they encode.
    """

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
    def edge(self) -> LogEdge:
        return LogEdge(self.kind, self.src_stage, self.dst_stage, self.dp_rank, self.tp_rank)

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
        check_crc("record header", memoryview(data)[: size - 4], stored)
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
