"""A real process SIGKILLed in the middle of re-uploading a log chunk, to file:// and to a real S3
server (moto's): the previous upload of the chunk stays readable by the replay's feeder, nothing
of the torn one is trusted, and GC sweeps what it left.

The child writes a chunk with the real writer, uploads it (msglog.upload, as the logging handle
does), appends two more iterations and re-uploads; its copy loop stops half-way through the
chunk, after pushing those bytes to the store, and says so in a marker file. The test then kills
it: a kill that lands mid-upload every time, without timing.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ds_swift.msglog import LogReader, gc_before
from ds_swift.msglog.chunk_format import ChunkName
from ds_swift.msglog.edge import LogEdge
from ds_swift.recovery.replay.log import LogFeeder, LogUnavailable
from ds_swift.storage import open_store
from ds_swift.testing.procs import ProcessSet, worker_env
from ds_swift.testing.s3 import S3Server, s3_server

EDGE = LogEdge("act", 0, 1, 0, 0)
EDGE_CHUNK = ChunkName(EDGE, 0, 8)
GAS = 2
MIB = 1 << 20

CHILD = r"""
import shutil, sys, time
from pathlib import Path

import torch

from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.upload import upload_files
from ds_swift.msglog.writer import LogWriter, MessageMeta, PythonAppender
from ds_swift.storage import open_store

url, local, marker = sys.argv[1:4]
EDGE = LogEdge("act", 0, 1, 0, 0)


def tensor(it, mb):  # 1 MiB each: the grown chunk is 8 MiB, past an S3 multipart part
    return torch.full((256, 1024), float(10 * it + mb))


w = LogWriter(local, 8, PythonAppender())  # one chunk holds iterations 0-7
store = open_store(url)
if url.startswith("s3://"):
    store.backend.fs.default_block_size = 5 << 20  # S3's smallest part: a real multipart upload
uploaded = {}


def log(iterations):
    for it in iterations:
        for mb in range(2):
            w.write(MessageMeta(it, mb, EDGE, 0, 1), [tensor(it, mb)])
    w.sync()
    return [Path(local) / n for n in w.files]


upload_files(store, log(range(2)), uploaded)  # iterations 0-1, complete
files = log(range(2, 4))


def stop_half_way(src, dst, length=0):
    dst.write(src.read(6 << 20))
    dst.flush()  # to the server: S3 gets the first part of a multipart upload
    Path(marker).write_text(dst.__class__.__name__)
    while True:
        time.sleep(3600)  # SIGKILLed here


shutil.copyfileobj = stop_half_way
upload_files(store, files, uploaded)
raise SystemExit("the upload finished: the copy loop was not interrupted")
"""


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def _wait_for(marker: Path, ps: ProcessSet, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if ps.procs["uploader"].poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the uploader never reached the middle of its upload\n{ps.logs_tail()}")
        time.sleep(0.05)


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_kill_mid_upload_leaves_the_previous_chunk_readable(
    tmp_path: Path, scheme: str, request: pytest.FixtureRequest
) -> None:
    env = worker_env()
    if scheme == "s3":
        server: S3Server = request.getfixturevalue("s3")
        url = server.url()
        env.update(server.env)
    else:
        url = f"file://{tmp_path}/store"
    marker = tmp_path / "mid-upload"
    with ProcessSet(tmp_path / "procs") as ps:
        ps.spawn_python("uploader", ["-c", CHILD, url, str(tmp_path / "local"), str(marker)], env=env)
        _wait_for(marker, ps, timeout_s=180)
        os.kill(ps.procs["uploader"].pid, signal.SIGKILL)
        assert ps.wait("uploader", 30) == -signal.SIGKILL

    store = open_store(url)
    stored = store.backend.list()
    chunk = EDGE_CHUNK.chunk_file
    assert store.names() == sorted([chunk, EDGE_CHUNK.index_file])
    unpublished = [n for n in stored if n.startswith(chunk + "~") and n != store.current_object(chunk)]
    if scheme == "s3":
        # S3 shows no object until its upload completes; the torn upload's first part is on the
        # server, in a multipart upload nobody completed
        assert unpublished == [] and store.backend.fs.list_multipart_uploads(server.bucket)
    else:
        # half a chunk on disk, beside the published one, never named by a sidecar
        assert [os.path.getsize(tmp_path / "store" / n) for n in unpublished] == [6 * MIB]

    # the recovery's reader: the chunk as first uploaded (iterations 0-1), whole and verified
    reader = LogReader(url, cache_dir=str(tmp_path / "cache"))
    assert reader.verify().ok and reader.verify().records == 2 * GAS
    feeder = LogFeeder(reader, (EDGE,), 0, 3, GAS)
    try:
        for it in range(2):
            got = feeder.take(it)
            assert {k: torch.equal(v, torch.full((256, 1024), float(10 * it + k[1]))) for k, v in got.items()} == {
                ("act", mb): True for mb in range(GAS)
            }
        with pytest.raises(LogUnavailable):  # iterations 2-3 were only in the torn upload
            feeder.take(2)
    finally:
        feeder.close()

    # GC after a checkpoint past the chunk removes it with whatever the killed upload left
    assert gc_before(url, 8) == sorted([chunk, EDGE_CHUNK.index_file])
    assert store.backend.list() == []


class _Crash(BaseException):
    pass


def test_a_crash_between_a_chunk_and_its_index_leaves_a_clean_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk is published before its index: a crash between them leaves a new chunk with an old
    index, which the reader completes by scanning (no damage reported, every record there)."""
    from ds_swift.msglog.upload import upload_files
    from ds_swift.msglog.writer import LogWriter, MessageMeta, PythonAppender

    url = f"file://{tmp_path}/store"
    store = open_store(url)
    w = LogWriter(tmp_path / "local", 8, PythonAppender())
    uploaded: dict[str, tuple[int, int]] = {}

    def log(iterations: range) -> list[Path]:
        for it in iterations:
            for mb in range(GAS):
                w.write(MessageMeta(it, mb, EDGE, 0, 1), [torch.full((4,), float(10 * it + mb))])
        return [tmp_path / "local" / n for n in w.files]

    upload_files(store, log(range(2)), uploaded)
    real = store.backend.replace_bytes

    def crash_at_index(name: str, data: bytes) -> None:
        if name.startswith(EDGE_CHUNK.index_file):
            raise _Crash(name)
        real(name, data)

    monkeypatch.setattr(store.backend, "replace_bytes", crash_at_index)
    with pytest.raises(_Crash):
        upload_files(store, log(range(2, 4)), uploaded)
    w.close()
    reader = LogReader(url, cache_dir=str(tmp_path / "cache"))
    report = reader.verify()
    assert report.ok and report.records == 4 * GAS, report.errors
    assert torch.equal(reader.message(EDGE, 3, 1), torch.full((4,), 31.0))
