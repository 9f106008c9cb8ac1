"""Process groups for ``benchmarks/scale.py``: the job-store requests of ds-swift's transport groups.

Every generation opens ds-swift's transport (ds_swift.transport.core ``Transport.create``): one gloo
group per channel over the whole world, its pairs of ranks connected lazily
(ds_swift.transport.core ``lazy_gloo``). Here N ranks on threads each create those groups as
``new_group(backend="gloo")`` does (a ``ProcessGroupGloo`` on the generation's store prefix) over a
counting store, then run what a buddy job's generation start runs on them (the buddy placement's
all-gather, the copies to buddies: ring neighbours), and the store requests are counted. (Created eagerly, before issue 48, a
group was a full mesh: per group N writes, N^2 waits and N^2 reads of two requests each.)
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist
from scale_common import StoreSet, quiet

from ds_swift.transport.core import CHANNELS, lazy_gloo

__all__ = ["MAX_RANKS", "group_costs"]

#: the most ranks whose groups are measured here (each rank's two groups start gloo threads)
MAX_RANKS = 256


def _groups(stores: StoreSet, n: int) -> dict[str, int]:
    counting = stores.counting("groups")
    errors: list[BaseException] = []
    timeout = datetime.timedelta(seconds=120)
    backends: dict[int, list[Any]] = {}

    def rank_main(rank: int) -> None:
        try:
            backends[rank] = [
                dist.ProcessGroupGloo(dist.PrefixStore(f"gen1/pg/{name}", counting), rank, n, timeout)
                for name in CHANNELS
            ]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def use(rank: int) -> None:
        """What a buddy job's generation start runs on them: the buddy placement's all-gather on
        the host channel (gloo's ring: two neighbours a rank), the copies on the copier's (a rank
        and its buddies: played here by a ring too)."""
        try:
            for pg in backends[rank]:
                out = [[torch.zeros(2) for _ in range(n)]]
                pg.allgather(out, [torch.ones(2)]).wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with lazy_gloo():  # as Transport.create makes them
        created = _threads(rank_main, n, counting)
    used = _threads(use, n, counting)
    if errors:
        raise RuntimeError(f"gloo groups failed: {errors[0]!r}")
    return {
        "create_requests": created.total_requests,
        "create_bytes": created.total_bytes,
        "use_requests": used.total_requests,
        "use_bytes": used.total_bytes,
    }


def _threads(fn: Any, n: int, counting: Any) -> Any:
    threads = [threading.Thread(target=fn, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return counting.take()


def group_costs(n: int) -> dict[str, Any] | None:
    """Requests and bytes to create the transport's groups (and first use them) for ``n`` ranks,
    as ds_swift.transport.core creates them (pairs connected lazily: no full mesh); None past
    :data:`MAX_RANKS` (thousands of gloo threads on a few cores: fitted from the smaller ones)."""
    if n > MAX_RANKS:
        return None
    with quiet():
        return {"measured": True, **_groups(StoreSet(), n)}
