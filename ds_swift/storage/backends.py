"""Storage backends: byte-level put/get/list/delete/size on one store root (local files, fsspec, WebHDFS).

Backends raise FileNotFoundError for missing objects and let other errors through;
ds_swift.storage.store.Store adds the checksums and turns errors into StorageErrors.

Store publishes an upload by replacing one small object (the sidecar) with
:meth:`StorageBackend.replace_bytes`, which must never show a reader a torn or missing object:
an object store's PUT is atomic (S3, memory); local files are renamed into place after an fsync;
WebHDFS cannot rename over a file, so :class:`HdfsBackend` stages the new one beside it.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shutil
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["BLOCK_SIZE", "STAGED_SEP", "FsspecBackend", "HdfsBackend", "LocalBackend", "StorageBackend"]

#: bytes per read/write when streaming objects and checksumming files
BLOCK_SIZE = 4 << 20

#: ``NAME~TOKEN`` is a file staged for ``NAME`` (an upload's new version, a sidecar not renamed yet)
STAGED_SEP = "~"


def staged_name(name: str) -> str:
    """A fresh name beside ``name`` that no other upload uses."""
    return f"{name}{STAGED_SEP}{secrets.token_hex(6)}"


class StorageBackend(ABC):
    """Byte-level access to one store root. Names are '/'-separated, relative to the root.

    Implementations raise FileNotFoundError for missing objects and let other errors through;
    :class:`Store` turns them into StorageErrors that name the URL.
    """

    @abstractmethod
    def put_file(self, local_path: str, name: str) -> None:
        """Upload a local file to ``name`` (overwriting)."""

    @abstractmethod
    def get_file(self, name: str, local_path: str) -> None:
        """Download ``name`` to a local file."""

    @abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def read_bytes(self, name: str) -> bytes: ...

    def replace_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` so that a reader sees its old content or the new one, whole, never neither.

        This default is a plain write: right where one PUT is atomic (S3, memory://).
        """
        self.write_bytes(name, data)

    @abstractmethod
    def list(self) -> list[str]:
        """Names of all objects directly under the root."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size in bytes, None when the object does not exist."""

    def probe(self) -> None:
        """Contact the store (creating the root if needed); raise when it is unreachable."""
        self.list()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBackend(StorageBackend):
    """A directory (``file://``, a shared file system): every write is fsync'd with its directory
    before it returns, so an upload that returned survives a crash of this machine too."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return os.path.join(self.root, name)

    def probe(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self.list()

    def _write(self, name: str, fill: Any) -> None:
        os.makedirs(self.root, exist_ok=True)
        with open(self._p(name), "wb") as dst:
            fill(dst)
            dst.flush()
            os.fsync(dst.fileno())
        _fsync_dir(self.root)

    def put_file(self, local_path: str, name: str) -> None:
        with open(local_path, "rb") as src:
            self._write(name, lambda dst: shutil.copyfileobj(src, dst, BLOCK_SIZE))

    def get_file(self, name: str, local_path: str) -> None:
        shutil.copyfile(self._p(name), local_path)

    def write_bytes(self, name: str, data: bytes) -> None:
        self._write(name, lambda dst: dst.write(data))

    def replace_bytes(self, name: str, data: bytes) -> None:
        # rename is atomic; the fsyncs order it after the data and make it durable
        tmp = staged_name(name)
        self.write_bytes(tmp, data)
        os.replace(self._p(tmp), self._p(name))
        _fsync_dir(self.root)

    def read_bytes(self, name: str) -> bytes:
        with open(self._p(name), "rb") as f:
            return f.read()

    def list(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        return sorted(os.listdir(self.root))

    def delete(self, name: str) -> None:
        os.unlink(self._p(name))

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self._p(name)).st_size
        except FileNotFoundError:
            return None


class FsspecBackend(StorageBackend):
    """Any fsspec filesystem: memory, s3 (s3fs); one write is one PUT, atomic (see replace_bytes)."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def probe(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self.list()

    def put_file(self, local_path: str, name: str) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with open(local_path, "rb") as src, self.fs.open(self._p(name), "wb") as dst:
            shutil.copyfileobj(src, dst, BLOCK_SIZE)

    def get_file(self, name: str, local_path: str) -> None:
        with self.fs.open(self._p(name), "rb") as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, BLOCK_SIZE)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(self._p(name), "wb") as f:
            f.write(data)

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open(self._p(name), "rb") as f:
            return bytes(f.read())

    def list(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))

    def delete(self, name: str) -> None:
        self.fs.rm(self._p(name))

    def size(self, name: str) -> int | None:
        path = self._p(name)
        if not self.fs.exists(path):
            return None
        return int(self.fs.size(path))


class HdfsBackend(StorageBackend):
    """WebHDFS through the ``hdfs`` package's ``Client`` (or anything with the same methods).

    WebHDFS has no rename over an existing file, so :meth:`replace_bytes` writes ``NAME~next``,
    deletes ``NAME`` and renames: between the last two (or after a crash there) ``NAME`` reads,
    sizes and lists as ``NAME~next``, and the next replace finishes the rename first.
    """

    def __init__(self, client: Any, root: str) -> None:
        self.client = client
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return posixpath.join(self.root, name)

    @staticmethod
    def _next(name: str) -> str:
        return f"{name}{STAGED_SEP}next"

    def _status(self, name: str) -> Any:
        return self.client.status(self._p(name), strict=False)

    def _resolve(self, name: str) -> str | None:
        """The file holding ``name``'s content: itself, its staged replacement, or None."""
        if self._status(name) is not None:
            return name
        return self._next(name) if self._status(self._next(name)) is not None else None

    def probe(self) -> None:
        self.client.makedirs(self.root)
        self.list()

    def put_file(self, local_path: str, name: str) -> None:
        with open(local_path, "rb") as src:
            self.client.write(self._p(name), data=src, overwrite=True)

    def get_file(self, name: str, local_path: str) -> None:
        path = self._resolve(name)
        if path is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(path)) as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, BLOCK_SIZE)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.client.write(self._p(name), data=data, overwrite=True)

    def replace_bytes(self, name: str, data: bytes) -> None:
        staged = self._next(name)
        if self._status(name) is None and self._status(staged) is not None:
            self.client.rename(self._p(staged), self._p(name))  # finish an interrupted replace
        self.client.write(self._p(staged), data=data, overwrite=True)
        self.client.delete(self._p(name))
        self.client.rename(self._p(staged), self._p(name))

    def read_bytes(self, name: str) -> bytes:
        path = self._resolve(name)
        if path is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(path)) as src:
            return bytes(src.read())

    def list(self) -> list[str]:
        if self.client.status(self.root, strict=False) is None:
            return []
        names = set(self.client.list(self.root))
        suffix = self._next("")
        staged = {n for n in names if n.endswith(suffix) and n[: -len(suffix)] not in names}
        return sorted((names - staged) | {n[: -len(suffix)] for n in staged})

    def delete(self, name: str) -> None:
        deleted = self.client.delete(self._p(name))
        if self.client.delete(self._p(self._next(name))):
            deleted = True
        if not deleted:
            raise FileNotFoundError(name)

    def size(self, name: str) -> int | None:
        path = self._resolve(name)
        status = None if path is None else self._status(path)
        return None if status is None else int(status["length"])
