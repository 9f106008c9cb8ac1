"""The global store: checksummed upload/download on file://, memory://, hdfs:// (fake WebHDFS client)."""

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
from ds_swift.testing.procs import free_port


class FakeHdfsClient:
    """The subset of ``hdfs.Client`` that HdfsBackend uses, in memory (no HDFS is reachable here)."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = set()
        self.down = False

    def _check(self) -> None:
        if self.down:
            import requests

            raise requests.exceptions.ConnectionError("Max retries exceeded with url: /webhdfs/v1/ (Connection refused)")

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


@pytest.fixture
def fake_hdfs() -> FakeHdfsClient:
    return FakeHdfsClient()


@pytest.fixture(params=["file", "memory", "hdfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path, fake_hdfs: FakeHdfsClient) -> Store:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/store")
    if request.param == "memory":
        return open_store(f"memory://ds-swift-test-{uuid.uuid4().hex}")
    return open_store("hdfs://namenode:9870/swift/logs", hdfs_client_factory=lambda endpoint: fake_hdfs)


def _file(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
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
    store.backend.write_bytes("c.swlog", bytes(bad))  # bit rot in the store
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

    def full(*a: Any, **k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(s.backend, "put_file", full)
    with pytest.raises(StorageFullError, match=r"big.swlog: out of space"):
        s.put_file(src)


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


def test_s3_store_needs_s3fs() -> None:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        with pytest.raises(StorageUnreachableError, match="needs s3fs"):
            open_store("s3://bucket/logs")
        return
    pytest.skip("s3fs is installed but no S3 endpoint is reachable from the test machine")
