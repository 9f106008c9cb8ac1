"""Writer and reader without DeepSpeed: round trips, torn tails, corrupt indexes, full disks."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_swift.msglog import LogReader, gc_before
from ds_swift.msglog.chunk_format import FILE_HEADER_SIZE, ChunkName
from ds_swift.msglog.chunk_index import load_chunk, scan_chunk
from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.reader import CorruptRecordError, MissingRecordError
from ds_swift.msglog.writer import LogWriteError, LogWriter, MessageMeta, PythonAppender
from ds_swift.msglog.writer_thread import HostStaged, WriteItem, WriterThread

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def meta(it: int, mb: int, kind: str = "act", src: int = 1, dst: int = 2, dp: int = 0) -> MessageMeta:
    return MessageMeta(it, mb, LogEdge(kind, src, dst, dp, 0), src, dst)


def rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


message = st.lists(
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple), st.integers(0, 2**16)),
    min_size=1,
    max_size=3,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(message, min_size=1, max_size=8), st.integers(1, 3))
def test_round_trip_any_dtype_shape_and_tuple(tmp_path: Path, messages: list, chunk: int) -> None:
    d = tmp_path / f"log{abs(hash((str(messages), chunk)))}"
    w = LogWriter(d, chunk, PythonAppender())
    sent = {}
    for n, parts in enumerate(messages):
        it, mb = n // 3, n % 3
        tensors = [rand(shape, dtype, seed) for dtype, shape, seed in parts]
        sent[(it, mb)] = tensors
        w.write(meta(it, mb), tensors)
    w.close()
    r = LogReader(d)
    for (it, mb), tensors in sent.items():
        got = r.get(it, mb, "act", 1, 2)
        got_t = got if isinstance(got, tuple) else (got,)
        assert isinstance(got, tuple) == (len(tensors) > 1)
        assert len(got_t) == len(tensors)
        for a, b in zip(got_t, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()
    assert r.verify().ok
    assert [rec.header.key[:2] for rec in r.iter_records()] == sorted(
        (it, mb) for (it, mb), ts in sent.items() for _ in ts
    )


def test_non_contiguous_tensors_are_logged_by_value(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 5, PythonAppender())
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    w.write(meta(0, 0), [t])
    w.close()
    assert torch.equal(LogReader(tmp_path).get(0, 0, "act", 1, 2), t)  # type: ignore[arg-type]


def test_missing_records_and_edges_raise_naming_what_is_missing(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 2, PythonAppender())
    w.write(meta(0, 0), [torch.ones(2)])
    w.close()
    r = LogReader(tmp_path)
    with pytest.raises(MissingRecordError, match="micro-batch 1"):
        r.get(0, 1, "act", 1, 2)
    with pytest.raises(MissingRecordError, match=r"iteration 7 .*cover \[\(0, 2\)\]"):
        r.get(7, 0, "act", 1, 2)
    with pytest.raises(MissingRecordError, match="grad s2->s1"):
        r.get(0, 0, "grad", 2, 1)
    with pytest.raises(FileNotFoundError):
        LogReader(tmp_path / "nope")


def test_a_chunk_cut_short_names_what_its_index_and_scan_found(tmp_path: Path) -> None:
    """A chunk truncated in the middle of a record (a write or a copy that did not finish): the
    records before the cut read back, the cut one is missing, and the error says why."""
    w = LogWriter(tmp_path, 10, PythonAppender())
    for mb in range(3):
        w.write(meta(0, mb), [torch.full((64,), float(mb))])
    w.close()
    (chunk,) = tmp_path.glob("*.swlog")
    e = load_chunk(chunk).order[1]
    os.truncate(chunk, e.offset + e.length // 2)
    r = LogReader(tmp_path)
    assert torch.equal(r.get(0, 0, "act", 1, 2), torch.zeros(64))  # type: ignore[arg-type]
    with pytest.raises(
        MissingRecordError,
        match=r"no act record for iteration 0 micro-batch 1 \(.*points outside "
        r"the chunk.*truncated",
    ):
        r.get(0, 1, "act", 1, 2)


def test_flipped_payload_byte_names_file_and_record(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    for mb in range(3):
        w.write(meta(0, mb), [torch.full((64,), float(mb))])
    w.close()
    (chunk,) = tmp_path.glob("*.swlog")
    info = load_chunk(chunk)
    e = info.order[1]
    data = bytearray(chunk.read_bytes())
    data[e.offset + e.length - 1] ^= 0x01
    chunk.write_bytes(bytes(data))
    r = LogReader(tmp_path)
    assert torch.equal(r.get(0, 0, "act", 1, 2), torch.zeros(64))  # type: ignore[arg-type]
    with pytest.raises(
        CorruptRecordError, match=rf"{chunk.name}: record #1 at offset {e.offset} .*micro-batch 1.*checksum"
    ):
        r.get(0, 1, "act", 1, 2)
    report = r.verify()
    assert not report.ok and report.records == 2
    assert len(report.errors) == 1 and report.errors[0].record == 1 and report.errors[0].offset == e.offset


def test_torn_tail_is_ignored_by_readers_and_truncated_by_the_next_writer(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    for mb in range(3):
        w.write(meta(0, mb), [torch.full((100,), float(mb))])
    w.close()
    (chunk,) = tmp_path.glob("*.swlog")
    full = chunk.stat().st_size
    os.truncate(chunk, full - 50)  # a writer killed mid-record
    info = load_chunk(chunk)
    assert len(info.entries) == 2  # the index entry of the torn record is not trusted
    assert any("record #2 at offset" in p and "truncated payload" in p for p in info.problems), info.problems
    with pytest.raises(MissingRecordError):
        LogReader(tmp_path).get(0, 2, "act", 1, 2)
    # the same edge re-opened (a restarted writer): torn record cut off, appending continues
    w2 = LogWriter(tmp_path, 10, PythonAppender())
    w2.write(meta(0, 2), [torch.full((100,), 2.0)])
    w2.close()
    assert chunk.stat().st_size == full
    r = LogReader(tmp_path)
    assert torch.equal(r.get(0, 2, "act", 1, 2), torch.full((100,), 2.0))  # type: ignore[arg-type]
    assert r.verify().ok


def test_a_rerun_iteration_supersedes_the_partial_one(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    w.write(meta(3, 0), [torch.zeros(4)])
    w.write(meta(3, 0), [torch.ones(4)])
    w.close()
    assert torch.equal(LogReader(tmp_path).get(3, 0, "act", 1, 2), torch.ones(4))  # type: ignore[arg-type]


def test_missing_or_corrupt_index_falls_back_to_scanning(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    for mb in range(4):
        w.write(meta(0, mb), [torch.full((8,), float(mb))])
    w.close()
    (idx,) = tmp_path.glob("*.swidx")
    raw = bytearray(idx.read_bytes())
    raw[16 + 40 + 3] ^= 0xFF  # second entry
    idx.write_bytes(bytes(raw))
    r = LogReader(tmp_path)
    for mb in range(4):
        assert torch.equal(r.get(0, mb, "act", 1, 2), torch.full((8,), float(mb)))  # type: ignore[arg-type]
    assert any("index entry #1" in str(e) for e in r.verify().errors)  # reported, yet nothing lost
    idx.unlink()
    r = LogReader(tmp_path)
    assert torch.equal(r.get(0, 3, "act", 1, 2), torch.full((8,), 3.0))  # type: ignore[arg-type]
    assert r.verify().ok


def test_scan_stops_at_a_corrupt_header(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    for mb in range(3):
        w.write(meta(0, mb), [torch.zeros(8)])
    w.close()
    (chunk,) = tmp_path.glob("*.swlog")
    data = bytearray(chunk.read_bytes())
    second = FILE_HEADER_SIZE + (len(data) - FILE_HEADER_SIZE) // 3
    data[second + 10] ^= 1
    chunk.write_bytes(bytes(data))
    scan = scan_chunk(chunk)
    assert len(scan.records) == 1 and scan.end == second and "record #1" in (scan.error or "")


def test_disk_full_raises_naming_the_chunk_and_keeps_the_chunk_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = LogWriter(tmp_path, 10, PythonAppender())
    w.write(meta(0, 0), [torch.zeros(1000)])
    real = os.writev
    calls = {"n": 0}

    def full(fd: int, buffers: list) -> int:
        calls["n"] += 1
        real(fd, [memoryview(buffers[0])[:10]])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(
        LogWriteError, match=r"act_s001-s002.*\.swlog: writing record \(iteration 0, micro-batch 1.*disk full"
    ) as ei:
        w.write(meta(0, 1), [torch.ones(1000)])
    assert ei.value.errno == errno.ENOSPC and calls["n"] == 1
    monkeypatch.setattr(os, "writev", real)
    w.write(meta(0, 2), [torch.full((1000,), 2.0)])
    w.close()
    r = LogReader(tmp_path)
    assert r.verify().ok
    assert torch.equal(r.get(0, 2, "act", 1, 2), torch.full((1000,), 2.0))  # type: ignore[arg-type]
    with pytest.raises(MissingRecordError):
        r.get(0, 1, "act", 1, 2)


def test_writer_thread_reports_failures_on_flush_and_keeps_going(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wt = WriterThread(LogWriter(tmp_path, 10, PythonAppender()))
    real = os.writev
    fail = threading.Event()
    fail.set()

    def maybe_full(fd: int, buffers: list) -> int:
        if fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", maybe_full)
    wt.submit(WriteItem(meta(0, 0), HostStaged([torch.zeros(4)]), 16))
    with pytest.raises(LogWriteError, match="disk full"):
        wt.flush(10)
    wt.flush(10)  # an error is raised once
    fail.clear()
    wt.submit(WriteItem(meta(0, 1), HostStaged([torch.ones(4)]), 16))
    wt.flush(10)
    assert wt.stats.failed_messages == 1 and wt.stats.messages == 1
    wt.close()


def test_writer_thread_backpressure_bounds_bytes_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()

    class Slow(HostStaged):
        def ready(self) -> bool:
            return gate.wait(10)

    wt = WriterThread(LogWriter(tmp_path, 10, PythonAppender()), max_inflight_bytes=100)
    wt.submit(WriteItem(meta(0, 0), Slow([torch.zeros(20)]), 80))
    done = threading.Event()

    def second() -> None:
        wt.submit(WriteItem(meta(0, 1), HostStaged([torch.zeros(20)]), 80))
        done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not done.wait(0.2)  # over the bound: the producer waits for the writer
    assert wt.inflight_bytes() == 80
    gate.set()
    assert done.wait(10)
    t.join(10)
    wt.flush(10)
    assert wt.stats.stall_s > 0 and wt.stats.max_inflight_bytes <= 100
    wt.close()


def test_gc_deletes_only_chunks_wholly_before_the_checkpoint(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, 5, PythonAppender())
    for it in range(17):
        w.write(meta(it, 0), [torch.zeros(2)])
        w.write(meta(it, 0, "grad", 2, 1), [torch.zeros(2)])
    w.close()
    deleted = gc_before(tmp_path, 12)  # checkpoint after iterations 0..11
    firsts = sorted({ChunkName.parse(n).first_iteration for n in deleted})  # type: ignore[union-attr]
    assert firsts == [0, 5]
    assert len(deleted) == 2 * 2 * 2  # 2 ranges x 2 edges x (chunk + index)
    r = LogReader(tmp_path)
    assert {c.first_iteration for c in r.chunk_names()} == {10, 15}
    assert r.get(10, 0, "act", 1, 2) is not None  # the straddling chunk is kept whole
    assert gc_before(tmp_path, 12) == []
