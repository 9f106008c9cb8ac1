"""Garbage collection of log chunks after a global checkpoint (SWIFT section 5.1).

A global checkpoint at iteration ``c`` holds the state after iterations ``0..c-1``; a recovery
loads it and replays from iteration ``c`` on, so chunks whose every iteration is ``< c`` (their
exclusive end ``<= c``) are garbage. A chunk straddling ``c`` is kept whole. Log bytes on disk
are therefore bounded by ``checkpoint.interval + chunk_iterations`` iterations' worth.
"""

from __future__ import annotations

import os
from pathlib import Path

from ds_swift.msglog.chunk_format import ChunkName

__all__ = ["delete_chunks_before", "gc_before"]


def delete_chunks_before(location: str | os.PathLike[str], iteration: int) -> list[str]:
    """Delete chunk and index files (and store sidecars) holding only iterations ``< iteration``.

    Args:
        location: a local directory or a store URL (ds_swift.storage).
        iteration: the iteration of a *completed* global checkpoint.

    Returns the names deleted.
    """
    from ds_swift.storage import local_path_of, open_store

    local = local_path_of(str(location))
    deleted: list[str] = []
    if local is not None:
        directory = Path(local)
        if not directory.is_dir():
            return []
        for p in sorted(directory.iterdir()):
            cn = ChunkName.parse(p.name)
            if cn is not None and cn.end_iteration <= iteration:
                p.unlink(missing_ok=True)
                deleted.append(p.name)
        return deleted
    store = open_store(str(location))
    for name in store.names():
        cn = ChunkName.parse(name)
        if cn is not None and cn.end_iteration <= iteration:
            store.delete(name)
            deleted.append(name)
    return deleted


def gc_before(log_dir_or_url: str | os.PathLike[str], iteration: int) -> list[str]:
    """Delete chunks wholly before a completed global checkpoint at ``iteration`` (see module docstring)."""
    return delete_chunks_before(log_dir_or_url, iteration)
