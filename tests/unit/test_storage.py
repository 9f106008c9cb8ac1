"""The global store: checksummed upload/download on file://, memory://, s3:// (a real S3-compatible
server: moto's, started here) and hdfs:// (a fake WebHDFS client: no HDFS runs here)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ds_swift.storage import (
    ChecksumError,
    MissingObjectError,
    StorageError,
    StorageFullError,
    StorageUnreachableError,
    Store,
    local_path_of,
    open_store,
)
from ds_swift.storage.store import CRC_SUFFIX
from ds_swift.testing.procs import free_port
from ds_swift.testing.s3 import S3Server, s3_server


class FakeHdfsClient:
    """The subset of ``hdfs.Client`` that HdfsBackend uses, in memory (no HDFS is reachable here)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.down = False

    def _check(self) -> None:
        if self.down:
            import requests

            raise requests.exceptions.ConnectionError(
                "Max retries exceeded with url: /webhdfs/v1/ (Connection refused)"
            )

    def makedirs(self, path: str, permission: Any = None) -> None:
        self._check()
        self.dirs.add(path.rstrip("/"))

    def write(self, path: str, data: Any = None, overwrite: bool = False, **kw: Any) -> None:
        self._check()
        if path in self.files and not overwrite:
            raise RuntimeError(f"{path} exists")
        self.files[path] = data if isinstance(data, bytes) else data.read()
        self.dirs.add(os.path.dirname(path))

    @contextlib.contextmanager
    def read(self, path: str, **kw: Any) -> Iterator[io.BytesIO]:
        self._check()
        yield io.BytesIO(self.files[path])

    def status(self, path: str, strict: bool = True) -> dict[str, Any] | None:
        self._check()
        if path in self.files:
            return {"length": len(self.files[path]), "type": "FILE"}
        if path.rstrip("/") in self.dirs:
            return {"length": 0, "type": "DIRECTORY"}
        return None

    def list(self, path: str, status: bool = False) -> list[str]:
        self._check()
        prefix = path.rstrip("/") + "/"
        return sorted({p[len(prefix) :].split("/")[0] for p in self.files if p.startswith(prefix)})

    def delete(self, path: str, recursive: bool = False, skip_trash: bool = True) -> bool:
        self._check()
        return self.files.pop(path, None) is not None

    def rename(self, hdfs_src_path: str, hdfs_dst_path: str) -> None:
        self._check()
        if hdfs_dst_path in self.files or hdfs_src_path not in self.files:  # WebHDFS never renames over a file
            raise RuntimeError(f"Unable to rename {hdfs_src_path!r} to {hdfs_dst_path!r}")
        self.files[hdfs_dst_path] = self.files.pop(hdfs_src_path)


@pytest.fixture
def fake_hdfs() -> FakeHdfsClient:
    return FakeHdfsClient()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(params=["file", "memory", "s3", "hdfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path, fake_hdfs: FakeHdfsClient) -> Store:
    return _open(request, request.param, tmp_path, fake_hdfs)


def _open(request: pytest.FixtureRequest, kind: str, tmp_path: Path, fake_hdfs: FakeHdfsClient) -> Store:
    if kind == "file":
        return open_store(f"file://{tmp_path}/store")
    if kind == "memory":
        return open_store(f"memory://ds-swift-test-{uuid.uuid4().hex}")
    if kind == "s3":
        return open_store(request.getfixturevalue("s3").url())
    return open_store("hdfs://namenode:9870/swift/logs", hdfs_client_factory=lambda endpoint: fake_hdfs)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def test_upload_download_round_trip_with_checksums(store: Store, tmp_path: Path) -> None:
    store.probe()
    src = _file(tmp_path, "a.swlog", os.urandom(10_000))
    obj = store.put_file(src)
    assert obj.size == 10_000 and store.names() == ["a.swlog"] and store.exists("a.swlog")
    out = store.get_file("a.swlog", tmp_path / "dl" / "a.swlog")
    assert out.read_bytes() == src.read_bytes()
    store.verify("a.swlog")
    store.delete("a.swlog")
    assert store.names() == [] and not store.exists("a.swlog")
    store.delete("a.swlog")  # missing_ok


def test_a_corrupt_object_is_refused_naming_the_url(store: Store, tmp_path: Path) -> None:
    src = _file(tmp_path, "c.swlog", b"x" * 1000)
    store.put_file(src)
    bad = bytearray(src.read_bytes())
    bad[500] ^= 1
    store.backend.write_bytes(store.current_object("c.swlog"), bytes(bad))  # bit rot in the store
    with pytest.raises(ChecksumError, match=rf"{store.url.rstrip('/')}/c.swlog is corrupt"):
        store.get_file("c.swlog", tmp_path / "dl" / "c.swlog")
    assert not (tmp_path / "dl" / "c.swlog").exists()  # never left behind half-verified
    assert list((tmp_path / "dl").iterdir()) == []


def test_missing_objects_and_sidecars_are_errors(store: Store, tmp_path: Path) -> None:
    with pytest.raises(MissingObjectError, match="nope.swlog"):
        store.get_file("nope.swlog", tmp_path / "x")
    store.backend.write_bytes("orphan.swlog", b"data")  # an upload interrupted before its sidecar
    with pytest.raises(MissingObjectError, match="no checksum sidecar"):
        store.get_file("orphan.swlog", tmp_path / "x")
    assert store.get_file("orphan.swlog", tmp_path / "x", verify=False).read_bytes() == b"data"


def test_unreachable_hdfs_is_named(tmp_path: Path, fake_hdfs: FakeHdfsClient) -> None:
    fake_hdfs.down = True
    s = open_store("hdfs://namenode:9870/swift", hdfs_client_factory=lambda e: fake_hdfs)
    with pytest.raises(StorageUnreachableError, match="hdfs://namenode:9870/swift is unreachable"):
        s.probe()
    with pytest.raises(StorageUnreachableError):
        s.put_file(_file(tmp_path, "a", b"1"))


def test_real_webhdfs_client_against_a_closed_port_is_unreachable() -> None:
    port = free_port()  # nobody listens there: connection refused at once
    s = open_store(f"webhdfs://127.0.0.1:{port}/logs")
    with pytest.raises(StorageUnreachableError, match=f"webhdfs://127.0.0.1:{port}/logs is unreachable"):
        s.names()


def test_full_disk_on_upload_is_a_storage_full_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(str(tmp_path / "store"))
    src = _file(tmp_path, "big.swlog", b"y" * 100)
    s.put_file(src)
    before = sorted(s.backend.list())

    def full(local_path: str, name: str) -> None:
        s.backend.write_bytes(name, b"y" * 10)  # as far as it got
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(s.backend, "put_file", full)
    with pytest.raises(StorageFullError, match=r"big.swlog: out of space"):
        s.put_file(_file(tmp_path, "big.swlog", b"y" * 200))
    # the part written is removed (a full disk gets no fuller per try); the last upload stands
    assert sorted(s.backend.list()) == before
    assert s.get_file("big.swlog", tmp_path / "dl").read_bytes() == b"y" * 100


def test_unwritable_local_store_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    s = open_store(f"file://{blocker}/sub")
    with pytest.raises(StorageError, match=str(blocker)):
        s.probe()


def test_urls() -> None:
    assert local_path_of("file:///abs/dir") == Path("/abs/dir")
    assert local_path_of("file://./rel") == Path("./rel")
    assert local_path_of("plain/dir") == Path("plain/dir")
    assert local_path_of("hdfs://nn:9870/x") is None
    with pytest.raises(StorageError, match="unsupported scheme"):
        open_store("ftp://x/y")
    with pytest.raises(StorageError, match="names no namenode"):
        open_store("hdfs:///x")


def test_s3_store_needs_s3fs(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed
    with pytest.raises(StorageUnreachableError, match="needs s3fs"):
        open_store("s3://bucket/logs")


class _Crash(BaseException):
    """The uploading process dies here (not an Exception: nothing on the way may handle it)."""


def _crash_at_sidecar(monkeypatch: pytest.MonkeyPatch, store: Store) -> None:
    """Make the next write of a checksum sidecar kill the upload: the crash between object and sidecar."""

    def crash(*args: Any, **kwargs: Any) -> None:
        raise _Crash(args[0])

    for method in ("write_bytes", "replace_bytes"):
        real = getattr(store.backend, method, None)
        if real is None:
            continue

        def write(name: str, data: bytes, _real: Any = real) -> None:
            if CRC_SUFFIX in name:
                crash(name)
            _real(name, data)

        monkeypatch.setattr(store.backend, method, write)


def test_a_crash_between_chunk_upload_and_sidecar_leaves_the_previous_chunk_readable(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _file(tmp_path, "c.swlog", os.urandom(3000))
    store.put_file(first)
    grown = _file(tmp_path / "new", "c.swlog", first.read_bytes() + os.urandom(2000))
    with monkeypatch.context() as m:
        _crash_at_sidecar(m, store)
        with pytest.raises(_Crash):
            store.put_file(grown)  # re-upload of a chunk that grew; dies before its sidecar
    # a reader (a replacement machine's) finds the previous chunk, whole and verified
    assert store.names() == ["c.swlog"]
    assert store.get_file("c.swlog", tmp_path / "dl" / "c.swlog").read_bytes() == first.read_bytes()
    # the next upload publishes the new one; GC sweeps it and what the crash left
    store.put_file(grown)
    assert store.get_file("c.swlog", tmp_path / "dl2" / "c.swlog").read_bytes() == grown.read_bytes()
    assert store.delete_where(lambda n: n == "c.swlog") == ["c.swlog"]
    assert store.backend.list() == []


def test_reuploads_never_overwrite_the_published_object(store: Store, tmp_path: Path) -> None:
    src = _file(tmp_path, "r.swlog", b"one")
    store.put_file(src)
    before = store.current_object("r.swlog")
    src.write_bytes(b"two two")
    store.put_file(src)
    after = store.current_object("r.swlog")
    assert after != before and after.startswith("r.swlog~")
    assert sorted(store.backend.list()) == sorted([after, "r.swlog" + CRC_SUFFIX])  # the superseded one is gone
    assert store.get_file("r.swlog", tmp_path / "dl").read_bytes() == b"two two"
    with pytest.raises(ValueError, match="may not contain"):
        store.put_file(src, "bad~name")


def test_a_file_store_upload_is_fsynced_before_it_is_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(f"file://{tmp_path}/store")
    root = str(tmp_path / "store")
    s.probe()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    s.put_file(_file(tmp_path, "f.swlog", b"z" * 100))
    obj = os.path.join(root, s.current_object("f.swlog"))
    sidecar = ("replace", os.path.join(root, "f.swlog" + CRC_SUFFIX))
    assert sidecar in events
    published = events.index(sidecar)
    # the object's bytes and its directory entry are durable before the sidecar names it ...
    assert ("fsync", obj) in events[:published] and ("fsync", root) in events[:published]
    # ... and the sidecar's rename is durable before put_file returns
    assert ("fsync", root) in events[published:]


def test_hdfs_sidecar_swap_interrupted_before_its_rename(
    tmp_path: Path, fake_hdfs: FakeHdfsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = open_store("hdfs://namenode:9870/swift/logs", hdfs_client_factory=lambda endpoint: fake_hdfs)
    s.put_file(_file(tmp_path, "h.swlog", b"old"))
    with monkeypatch.context() as m:

        def die(*a: Any, **k: Any) -> None:
            raise _Crash("between delete and rename")

        m.setattr(fake_hdfs, "rename", die)
        with pytest.raises(_Crash):
            s.put_file(_file(tmp_path, "h.swlog", b"new!"))
    assert "/swift/logs/h.swlog" + CRC_SUFFIX not in fake_hdfs.files  # deleted, the new one staged
    # a reader sees the staged sidecar, which was complete: the new upload, whole
    assert s.names() == ["h.swlog"] and s.exists("h.swlog")
    assert s.get_file("h.swlog", tmp_path / "dl").read_bytes() == b"new!"
    s.put_file(_file(tmp_path, "h.swlog", b"newer"))  # finishes the interrupted rename first
    assert s.get_file("h.swlog", tmp_path / "dl").read_bytes() == b"newer"
    assert s.delete_where(lambda n: True) == ["h.swlog"] and fake_hdfs.files == {}


def test_the_webhdfs_client_has_timeouts() -> None:
    # The hdfs package's default is none: a namenode that stopped answering hung the rank for good.
    from ds_swift.storage.store import HDFS_TIMEOUT_S, _default_hdfs_client

    client = _default_hdfs_client("http://127.0.0.1:9")
    assert client._timeout == HDFS_TIMEOUT_S and all(0 < t <= 120 for t in HDFS_TIMEOUT_S)
