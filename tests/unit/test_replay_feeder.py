"""The replay's log prefetcher on logs written by the real writer: order, bounds, and loud failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_swift.msglog import LogReader
from ds_swift.msglog.chunk_format import ChunkName
from ds_swift.msglog.chunk_index import load_chunk
from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.writer import LogWriter, MessageMeta, PythonAppender
from ds_swift.recovery.replay.log import LogFeeder, LogUnavailable
from ds_swift.testing.s3 import S3Server, s3_server

GAS = 3
ACT = LogEdge("act", 1, 2, 0, 0)
GRAD = LogEdge("grad", 3, 2, 0, 0)


def tensors_for(kind: str, it: int, mb: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + 10 * mb + (kind == "grad"))
    if kind == "act":  # a tuple with an int64 part, as DeepSpeed sends it
        return [torch.randn(4, 5, generator=g), torch.arange(4, dtype=torch.long) + it]
    return [torch.randn(4, 5, generator=g)]


def write_log(d: Path, iterations: range, chunk: int = 2, skip: set[tuple[str, int, int]] = frozenset()) -> Path:  # type: ignore[assignment]
    w = LogWriter(d, chunk, PythonAppender())
    for it in iterations:
        for mb in range(GAS):
            for edge in (ACT, GRAD):
                if (edge.kind, it, mb) in skip:
                    continue
                src_rank, dst_rank = edge.src_stage, edge.dst_stage
                meta = MessageMeta(it, mb, edge, src_rank, dst_rank)
                w.write(meta, tensors_for(edge.kind, it, mb))
    w.close()
    return d


def test_delivers_every_message_of_every_iteration_in_order(tmp_path: Path) -> None:
    reader = LogReader(write_log(tmp_path / "log", range(0, 7)))
    feeder = LogFeeder(reader, (ACT, GRAD), 2, 6, GAS)
    try:
        payload = 0
        for it in range(2, 7):
            got = feeder.take(it)
            assert set(got) == {(k, mb) for k in ("act", "grad") for mb in range(GAS)}
            for (kind, mb), msg in got.items():
                want = tensors_for(kind, it, mb)
                parts = msg if isinstance(msg, tuple) else (msg,)
                assert len(parts) == len(want)
                for a, b in zip(parts, want):
                    assert a.dtype == b.dtype and torch.equal(a, b)
                    payload += b.numel() * b.element_size()
        assert feeder.bytes_read == payload
        assert feeder.chunks_total == 2 * 3  # iterations 2..6 over chunks [2,4) [4,6) [6,8), two edges
    finally:
        feeder.close()
    assert feeder.chunks_loaded == 6
    assert not feeder._thread.is_alive()


def test_missing_chunk_fails_before_anything_is_read(tmp_path: Path) -> None:
    d = write_log(tmp_path / "log", range(0, 6))
    for p in d.glob("grad_*_it0000000002-0000000004.*"):
        p.unlink()
    with pytest.raises(LogUnavailable) as err:
        LogFeeder(LogReader(d), (ACT, GRAD), 0, 5, GAS)
    assert err.value.iteration == 2 and err.value.edge == GRAD
    assert "grad s3->s2 dp0 tp0" in str(err.value) and "(0, 2), (4, 6)" in str(err.value)


def test_missing_record_names_iteration_micro_batch_and_file(tmp_path: Path) -> None:
    d = write_log(tmp_path / "log", range(0, 4), skip={("act", 3, 1)})
    feeder = LogFeeder(LogReader(d), (ACT,), 0, 3, GAS)
    try:
        for it in range(3):
            feeder.take(it)
        with pytest.raises(LogUnavailable) as err:
            feeder.take(3)
        with pytest.raises(LogUnavailable):  # and again: the replay cannot go on past it
            feeder.take(3)
    finally:
        feeder.close()
    e = err.value
    assert (e.iteration, e.micro_batch, e.edge) == (3, 1, ACT)
    chunk = ChunkName.for_iteration(LogEdge("act", 1, 2, 0, 0), 3, 2).chunk_file
    assert e.file is not None and e.file.endswith(chunk) and chunk in str(e)


def test_corrupt_payload_names_file_and_record(tmp_path: Path) -> None:
    d = write_log(tmp_path / "log", range(0, 4))
    cn = ChunkName.for_iteration(LogEdge("act", 1, 2, 0, 0), 2, 2)
    info = load_chunk(d / cn.chunk_file)
    entry = info.entries[(2, 2, "act", 1)]  # the int64 part of iteration 2, micro-batch 2
    data = bytearray((d / cn.chunk_file).read_bytes())
    data[entry.offset + entry.length - 3] ^= 0x80
    (d / cn.chunk_file).write_bytes(bytes(data))
    feeder = LogFeeder(LogReader(d), (ACT, GRAD), 0, 3, GAS)
    try:
        feeder.take(0)
        feeder.take(1)
        with pytest.raises(LogUnavailable) as err:
            feeder.take(2)
    finally:
        feeder.close()
    msg = str(err.value)
    assert cn.chunk_file in msg and f"record #{info.record_numbers[entry.offset]}" in msg and "checksum" in msg
    assert (err.value.iteration, err.value.micro_batch) == (2, 2)


class CountingReader:
    """A LogReader stand-in that records how far ahead of the replay the feeder reads."""

    def __init__(self, inner: LogReader, ahead: int) -> None:
        self.inner = inner
        self.location, self.directory = inner.location, inner.directory
        self.ahead = ahead
        self.taking = -1  # set by the test *before* each take
        self.violations: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def chunk_names(self) -> Any:
        return self.inner.chunk_names()

    def chunk(self, cn: Any) -> Any:
        return self.inner.chunk(cn)

    def message(self, edge: LogEdge, iteration: int, micro_batch: int) -> Any:
        with self.lock:
            # queue of `ahead` + the one being put: never further than that past the iteration being taken
            if iteration > max(self.taking, 0) + self.ahead + 1:
                self.violations.append((iteration, self.taking))
        return self.inner.message(edge, iteration, micro_batch)


@pytest.mark.parametrize("ahead", [1, 3])
def test_reads_at_most_ahead_iterations_in_advance(tmp_path: Path, ahead: int) -> None:
    reader = CountingReader(LogReader(write_log(tmp_path / "log", range(0, 10))), ahead)
    feeder = LogFeeder(reader, (ACT, GRAD), 0, 9, GAS, ahead=ahead)
    try:
        assert feeder.ahead == ahead
        for it in range(10):
            with reader.lock:
                reader.taking = it
            feeder.take(it)
    finally:
        feeder.close()
    assert reader.violations == []


def test_default_prefetch_spans_a_whole_chunk(tmp_path: Path) -> None:
    feeder = LogFeeder(LogReader(write_log(tmp_path / "log", range(0, 8), chunk=4)), (ACT,), 0, 7, GAS)
    try:
        # chunk k+1 is read while chunk k is replayed: the queue holds one chunk span and one more
        assert feeder.ahead == 5
    finally:
        feeder.close()


def test_close_stops_a_feeder_blocked_on_a_full_queue(tmp_path: Path) -> None:
    feeder = LogFeeder(LogReader(write_log(tmp_path / "log", range(0, 10))), (ACT, GRAD), 0, 9, GAS, ahead=1)
    feeder.take(0)
    feeder.close(timeout_s=10)
    assert not feeder._thread.is_alive()


def test_progress_helpers_show_iterations_and_log_bytes() -> None:
    import io

    from ds_swift.recovery.replay.log import ReplayProgress, rich_progress, text_progress

    steps = [ReplayProgress(2, done, 4, 8 + done, done * 2_500_000, done, 4, 0.5 * done) for done in range(5)]
    assert steps[0].eta_s is None and steps[2].eta_s == pytest.approx(1.0)
    out = io.StringIO()
    show = text_progress(out, every=2)
    for p in steps:
        show(p)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # 0, 2 and the last
    assert "rank 2: replay 2/4 iterations, 5.0 MB of log, chunks 2/4, eta 1.0 s" in lines[1]
    with rich_progress("test") as update:
        for p in steps:
            update(p)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.mark.parametrize("scheme", ["memory", "s3"])
def test_remote_store_chunks_are_downloaded_verified_and_counted(
    tmp_path: Path, scheme: str, request: pytest.FixtureRequest
) -> None:
    import uuid

    from ds_swift.storage import open_store

    d = write_log(tmp_path / "log", range(0, 4))
    url = request.getfixturevalue("s3").url() if scheme == "s3" else f"memory://replay-{uuid.uuid4().hex}"
    store = open_store(url)
    for f in sorted(d.iterdir()):
        store.put_file(f, f.name)
    feeder = LogFeeder(LogReader(url, cache_dir=str(tmp_path / "cache")), (ACT, GRAD), 0, 3, GAS)
    try:
        for it in range(4):
            got = feeder.take(it)
            for (kind, mb), msg in got.items():  # the bytes the writer wrote, back through the store
                parts = msg if isinstance(msg, tuple) else (msg,)
                assert all(torch.equal(a, b) for a, b in zip(parts, tensors_for(kind, it, mb), strict=True))
    finally:
        feeder.close()
    assert feeder.chunks_loaded == 4
    assert feeder.chunk_bytes == sum(f.stat().st_size for f in d.glob("*.swlog"))

    # a chunk damaged in the store fails its download checksum: loud, naming the chunk
    victim = ChunkName.for_iteration(LogEdge("grad", 3, 2, 0, 0), 2, 2).chunk_file
    obj = store.current_object(victim)
    data = bytearray(store.backend.read_bytes(obj))
    data[-1] ^= 1
    store.backend.write_bytes(obj, bytes(data))
    feeder = LogFeeder(LogReader(url, cache_dir=str(tmp_path / "cache2")), (ACT, GRAD), 0, 3, GAS)
    try:
        feeder.take(0)
        feeder.take(1)
        with pytest.raises(LogUnavailable) as err:
            feeder.take(2)
    finally:
        feeder.close()
    assert victim in str(err.value) and err.value.edge == GRAD
