"""Copying a writer's chunk and index files to the global store (ds_swift.storage).

Each file is uploaded whole and published atomically (Store.put_file: a new object, then its
sidecar), so a reader sees every file either as it was at the previous upload or as it is now.
Between two files there is still a moment (or, after a crash, a state) where one of a chunk's
pair is new and the other old; the order makes that harmless: the **chunk goes first, its index
after**, and the reader fetches the index first (msglog.reader). A reader can then only pair an
index with a chunk at least as long as it, and an index shorter than its chunk is the normal case
that the reader completes by scanning the chunk's tail (msglog.chunk_index). The other order
would pair a new index with an old chunk: entries pointing past its end, reported as damage.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from ds_swift.msglog.chunk_format import INDEX_SUFFIX

if TYPE_CHECKING:
    from ds_swift.storage import Store

__all__ = ["upload_files"]


def upload_files(store: Store, files: Iterable[Path], uploaded: MutableMapping[str, tuple[int, int]]) -> list[str]:
    """Upload the files that changed since ``uploaded`` recorded them (size, mtime); chunk before index.

    ``uploaded`` is updated as each file is published, so a failure part-way leaves it exact.
    Returns the names uploaded.
    """
    done = []
    for path in sorted(files, key=lambda p: (p.stem, p.suffix == INDEX_SUFFIX)):
        st = path.stat()
        sig = (st.st_size, st.st_mtime_ns)
        if uploaded.get(path.name) == sig:
            continue
        store.put_file(path, path.name)
        uploaded[path.name] = sig
        done.append(path.name)
    return done
