"""Storage backends: byte-level put/get/list/delete/size on one store root (fsspec, WebHDFS).

Backends raise FileNotFoundError for missing objects and let other errors through;
ds_swift.storage.store.Store adds the checksums and turns errors into StorageErrors.
"""

from __future__ import annotations

import posixpath
import shutil
from abc import ABC, abstractmethod
from typing import Any

__all__ = ["BLOCK_SIZE", "FsspecBackend", "HdfsBackend", "StorageBackend"]

#: bytes per read/write when streaming objects and checksumming files
BLOCK_SIZE = 4 << 20


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


class FsspecBackend(StorageBackend):
    """Any fsspec filesystem: local files, memory, s3 (s3fs)."""

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
    """WebHDFS through the ``hdfs`` package's ``Client`` (or anything with the same methods)."""

    def __init__(self, client: Any, root: str) -> None:
        self.client = client
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def probe(self) -> None:
        self.client.makedirs(self.root)
        self.list()

    def put_file(self, local_path: str, name: str) -> None:
        with open(local_path, "rb") as src:
            self.client.write(self._p(name), data=src, overwrite=True)

    def get_file(self, name: str, local_path: str) -> None:
        if self.client.status(self._p(name), strict=False) is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(name)) as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, BLOCK_SIZE)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.client.write(self._p(name), data=data, overwrite=True)

    def read_bytes(self, name: str) -> bytes:
        if self.client.status(self._p(name), strict=False) is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(name)) as src:
            return bytes(src.read())

    def list(self) -> list[str]:
        if self.client.status(self.root, strict=False) is None:
            return []
        return sorted(self.client.list(self.root))

    def delete(self, name: str) -> None:
        if not self.client.delete(self._p(name)):
            raise FileNotFoundError(name)

    def size(self, name: str) -> int | None:
        status = self.client.status(self._p(name), strict=False)
        return None if status is None else int(status["length"])
