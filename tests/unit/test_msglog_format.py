"""Record format: headers round-trip, every flipped bit is caught, names parse back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.msglog.chunk_format import INDEX_ENTRY_SIZE, ChunkHeader, ChunkName, IndexEntry
from ds_swift.msglog.edge import LogEdge, PipelinePosition
from ds_swift.msglog.format import DTYPE_CODES, DTYPE_SIZES, RECORD_FIXED_SIZE, FormatError, RecordHeader, crc32c


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
    cn = ChunkName.for_iteration(LogEdge(kind, s, d, dp, tp), it, chunk)
    assert cn.first_iteration <= it < cn.end_iteration == cn.first_iteration + chunk
    assert cn.first_iteration % chunk == 0
    assert ChunkName.parse(cn.chunk_file) == cn
    assert ChunkName.parse(cn.index_file) == cn
    assert ChunkName.parse(cn.stem + ".txt") is None
    assert ChunkName.parse("act_s1-s2.swlog") is None


def test_chunk_file_names_are_pinned() -> None:
    cn = ChunkName.for_iteration(LogEdge("grad", 3, 2, 1, 4), 25, 10)
    assert cn.chunk_file == "grad_s003-s002_dp0001_tp004_it0000000020-0000000030.swlog"
    assert cn.index_file == "grad_s003-s002_dp0001_tp004_it0000000020-0000000030.swidx"
    assert cn.edge == ("grad", 3, 2, 1, 4)


def test_log_edges_follow_the_pipeline_direction() -> None:
    assert LogEdge.out_of("act", 2, 1, 0) == LogEdge("act", 2, 3, 1, 0) == LogEdge.into("act", 3, 1, 0)
    assert LogEdge.out_of("grad", 2) == LogEdge("grad", 2, 1) == LogEdge.into("grad", 1)
    assert str(LogEdge("act", 1, 2, 0, 3)) == "act s1->s2 dp0 tp3"
    with pytest.raises(ValueError, match="kind"):
        LogEdge.out_of("weights", 0)
    pos = PipelinePosition(rank=5, stage=1, num_stages=3, dp_rank=1, tp_rank=0, next_rank=9, prev_rank=1)
    assert (pos.out_edge("act"), pos.receiver("act"), pos.sender("act")) == (LogEdge("act", 1, 2, 1, 0), 9, 1)
    assert (pos.in_edge("grad"), pos.receiver("grad"), pos.sender("grad")) == (LogEdge("grad", 2, 1, 1, 0), 1, 9)
    header = RecordHeader(0, 0, 1, 2, 5, 9, "act", "float32", (1,), nbytes=4, dp_rank=1)
    assert header.edge == LogEdge("act", 1, 2, 1, 0)
    name = ChunkName.for_iteration(header.edge, 0, 4)
    assert ChunkHeader.for_chunk(name, 5, 9).edge == header.edge


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
