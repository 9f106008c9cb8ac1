"""Record format: headers round-trip, every flipped bit is caught, names parse back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.msglog.format import (
    DTYPE_CODES,
    DTYPE_SIZES,
    INDEX_ENTRY_SIZE,
    RECORD_FIXED_SIZE,
    ChunkHeader,
    ChunkName,
    FormatError,
    IndexEntry,
    RecordHeader,
    crc32c,
)


@st.composite
def headers(draw: st.DrawFn) -> RecordHeader:
    dtype = draw(st.sampled_from(sorted(DTYPE_CODES)))
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=4)))
    nbytes = DTYPE_SIZES[dtype]
    for d in shape:
        nbytes *= d
    num_parts = draw(st.integers(1, 4))
    return RecordHeader(
        iteration=draw(st.integers(0, 2**63 - 1)),
        micro_batch=draw(st.integers(0, 2**32 - 1)),
        src_stage=draw(st.integers(0, 2**16 - 1)),
        dst_stage=draw(st.integers(0, 2**16 - 1)),
        src_rank=draw(st.integers(0, 2**32 - 1)),
        dst_rank=draw(st.integers(0, 2**32 - 1)),
        kind=draw(st.sampled_from(["act", "grad"])),
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        payload_crc=draw(st.integers(0, 2**32 - 1)),
        part=draw(st.integers(0, num_parts - 1)),
        num_parts=num_parts,
        dp_rank=draw(st.integers(0, 2**32 - 1)),
        tp_rank=draw(st.integers(0, 2**16 - 1)),
    )


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283


@given(headers())
def test_record_header_round_trips(h: RecordHeader) -> None:
    packed = h.pack()
    assert len(packed) == h.header_size == RECORD_FIXED_SIZE + 8 * len(h.shape) + 4
    assert RecordHeader.peek_size(packed[:RECORD_FIXED_SIZE]) == h.header_size
    assert RecordHeader.unpack(packed) == h


@settings(max_examples=60)
@given(headers(), st.data())
def test_any_flipped_bit_in_a_header_is_detected(h: RecordHeader, data: st.DataObject) -> None:
    packed = bytearray(h.pack())
    bit = data.draw(st.integers(0, 8 * len(packed) - 1))
    packed[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FormatError):
        RecordHeader.unpack(bytes(packed))


def test_header_rejects_inconsistent_sizes_and_unknown_values() -> None:
    with pytest.raises(FormatError, match="nbytes"):
        RecordHeader(0, 0, 1, 2, 1, 2, "act", "float32", (2, 3), nbytes=23)
    with pytest.raises(FormatError, match="kind"):
        RecordHeader(0, 0, 1, 2, 1, 2, "weights", "float32", (1,), nbytes=4)
    with pytest.raises(FormatError, match="dtype"):
        RecordHeader(0, 0, 1, 2, 1, 2, "act", "complex64", (1,), nbytes=8)
    with pytest.raises(FormatError, match="part"):
        RecordHeader(0, 0, 1, 2, 1, 2, "act", "float32", (1,), nbytes=4, part=2, num_parts=2)


def test_newer_version_is_refused_with_a_clear_message() -> None:
    packed = bytearray(RecordHeader(0, 0, 1, 2, 1, 2, "act", "float32", (1,), nbytes=4).pack())
    packed[4] = 9  # version field
    with pytest.raises(FormatError, match="version 9 is not supported"):
        RecordHeader.unpack(bytes(packed))


@given(
    st.sampled_from(["act", "grad"]),
    st.integers(0, 999),
    st.integers(0, 999),
    st.integers(0, 9999),
    st.integers(0, 999),
    st.integers(0, 10**9),
    st.integers(1, 1000),
)
def test_chunk_names_round_trip(kind: str, s: int, d: int, dp: int, tp: int, it: int, chunk: int) -> None:
    cn = ChunkName.for_iteration(kind, s, d, dp, tp, it, chunk)
    assert cn.first_iteration <= it < cn.end_iteration == cn.first_iteration + chunk
    assert cn.first_iteration % chunk == 0
    assert ChunkName.parse(cn.chunk_file) == cn
    assert ChunkName.parse(cn.index_file) == cn
    assert ChunkName.parse(cn.stem + ".txt") is None
    assert ChunkName.parse("act_s1-s2.swlog") is None


def test_chunk_header_and_index_entry_round_trip_and_detect_corruption() -> None:
    ch = ChunkHeader(10, 15, 3, 4, 1, 2, 0, 0, "grad")
    packed = ch.pack()
    assert len(packed) == 64 and ChunkHeader.unpack(packed) == ch
    with pytest.raises(FormatError, match="checksum"):
        ChunkHeader.unpack(packed[:20] + bytes([packed[20] ^ 1]) + packed[21:])
    with pytest.raises(FormatError, match="not a ds-swift log chunk"):
        ChunkHeader.unpack(b"X" * 64)
    e = IndexEntry(7, 3, "act", 1, 2, 1234, 5678, 0xDEADBEEF)
    raw = e.pack()
    assert len(raw) == INDEX_ENTRY_SIZE and IndexEntry.unpack(raw) == e
    with pytest.raises(FormatError):
        IndexEntry.unpack(raw[:-1] + bytes([raw[-1] ^ 4]))
