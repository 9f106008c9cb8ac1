"""The message-log faults of tests/dist/workers/gpt_fault_worker.py (``SWIFT_TEST_CORRUPT_LOG``,
``SWIFT_TEST_PERTURB_LOG``, ``SWIFT_TEST_TRUNCATE_LOG``, ``SWIFT_TEST_MISSING_LOG``): each changes the
chunk holding one logged activation (iteration, micro-batch) of a file:// log store, and returns
False if no chunk holds it yet. The worker imports this module from its own directory.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["corrupt", "delete", "logged_activations", "perturb", "truncate"]


def corrupt(storage: str, iteration: int, micro_batch: int, src_stage: int | None) -> bool:
    """Flip a payload byte of the logged activation (iteration, micro-batch) sent by ``src_stage``
    (any stage if None) in the file:// log store; False if no chunk holds it yet."""
    done = False
    for path, entry in list(logged_activations(storage, iteration, micro_batch, src_stage)):
        data = bytearray(path.read_bytes())
        data[entry.offset + entry.length - 7] ^= 0x04
        path.write_bytes(bytes(data))
        done = True
        print(
            f"[test] corrupted the record of iteration {iteration} micro-batch {micro_batch} in {path.name}",
            file=sys.stderr,
            flush=True,
        )
    return done


def truncate(storage: str, iteration: int, micro_batch: int, src_stage: int | None) -> bool:
    """Cut the chunk holding the logged activation (iteration, micro-batch) in the middle of its record."""
    done = False
    for path, entry in list(logged_activations(storage, iteration, micro_batch, src_stage)):
        with open(path, "r+b") as f:
            f.truncate(entry.offset + entry.length // 2)
        done = True
        print(
            f"[test] truncated {path.name} in the record of iteration {iteration} micro-batch {micro_batch}",
            file=sys.stderr,
            flush=True,
        )
    return done


def delete(storage: str, iteration: int, micro_batch: int, src_stage: int | None) -> bool:
    """Delete the chunk holding the logged activation (iteration, micro-batch), and its index."""
    from ds_swift.msglog.chunk_format import ChunkName

    done = False
    for path, _ in list(logged_activations(storage, iteration, micro_batch, src_stage)):
        index = path.with_name(ChunkName.parse(path.name).index_file)  # type: ignore[union-attr]
        path.unlink()
        index.unlink(missing_ok=True)
        done = True
        print(
            f"[test] deleted {path.name} and its index (iteration {iteration} micro-batch {micro_batch})",
            file=sys.stderr,
            flush=True,
        )
    return done


def logged_activations(storage: str, iteration: int, micro_batch: int, src_stage: int | None) -> Any:
    """(chunk path, index entry) of each logged activation (iteration, micro-batch) sent by
    ``src_stage`` (any stage if None) in the file:// log store."""
    from ds_swift.msglog.chunk_format import ChunkName
    from ds_swift.msglog.chunk_index import load_chunk
    from ds_swift.storage import local_path_of

    root = local_path_of(storage)
    assert root is not None, "SWIFT_TEST_CORRUPT_LOG / SWIFT_TEST_PERTURB_LOG need a file:// log store"
    for path in sorted(root.iterdir()):
        cn = ChunkName.parse(path.name)
        if cn is None or path.name != cn.chunk_file or cn.edge[0] != "act":
            continue
        if not cn.first_iteration <= iteration < cn.end_iteration or src_stage not in (None, cn.edge[1]):
            continue
        entry = load_chunk(path).entries.get((iteration, micro_batch, "act", 0))
        if entry is not None:
            yield path, entry


def perturb(storage: str, iteration: int, micro_batch: int, src_stage: int | None) -> bool:
    """Add 1 to the first element of the logged activation (iteration, micro-batch) and write its
    checksums again, so that the log reader accepts it; False if no chunk holds it yet."""
    import dataclasses

    import torch

    from ds_swift.msglog.chunk_format import INDEX_ENTRY_SIZE, INDEX_HEADER_SIZE, ChunkName, IndexEntry
    from ds_swift.msglog.format import RecordHeader, crc32c

    done = False
    for path, entry in list(logged_activations(storage, iteration, micro_batch, src_stage)):
        data = bytearray(path.read_bytes())
        header = RecordHeader.unpack(bytes(data[entry.offset : entry.offset + entry.length]))
        start = entry.offset + header.header_size
        dtype = getattr(torch, header.dtype)
        size = torch.empty(0, dtype=dtype).element_size()
        first = torch.frombuffer(bytearray(data[start : start + size]), dtype=dtype) + 1
        data[start : start + size] = first.view(torch.uint8).numpy().tobytes()
        crc = crc32c(bytes(data[start : start + header.nbytes]))
        data[entry.offset : start] = header.pack(payload_crc=crc)
        path.write_bytes(bytes(data))
        index = path.with_name(ChunkName.parse(path.name).index_file)  # type: ignore[union-attr]
        if index.exists():
            idx = bytearray(index.read_bytes())
            for off in range(INDEX_HEADER_SIZE, len(idx) - INDEX_ENTRY_SIZE + 1, INDEX_ENTRY_SIZE):
                e = IndexEntry.unpack(idx, off)
                if e.offset == entry.offset:
                    idx[off : off + INDEX_ENTRY_SIZE] = dataclasses.replace(e, payload_crc=crc).pack()
            index.write_bytes(bytes(idx))
        done = True
        print(
            f"[test] perturbed the record of iteration {iteration} micro-batch {micro_batch} in {path.name} "
            "(checksums recomputed)",
            file=sys.stderr,
            flush=True,
        )
    return done
