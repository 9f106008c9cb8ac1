"""ds-swift's op timeout, applied only around ds-swift's own calls (issue 30 item 5).

ds-swift needs a short op timeout while it trains and recovers: on gloo nothing else wakes a rank
blocked on a peer whose machine vanished without closing its sockets. The job's own timeout (the
one the script gave ``init_process_group``: Megatron's ``--distributed-timeout-minutes``, else
torch's default) must hold everywhere else: a rank-0 dataset index build or an evaluation between
``train_batch`` calls can take longer than the op timeout without being a failure.

:func:`op_timeout_scope` sets the op timeout on every live process group for the duration of a
ds-swift call and gives every group its own back afterwards; a group created inside the call (a
rebuilt engine's, a new generation's world) gets the job's timeout, except ds-swift's own
transport groups (``group_desc`` ``ds_swift_*``), which keep theirs.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ds_swift.patches._base import PatchHandle
from ds_swift.patches.deepspeed_rebuild import _backends, _check_versions, _device_backends, _live_groups

__all__ = ["job_timeout_after_connect", "op_timeout_scope"]


def _own(group: Any) -> bool:
    """ds-swift's transport groups: their op timeout is theirs at all times."""
    return str(getattr(group, "group_desc", "") or "").startswith("ds_swift_")


def op_timeout_scope(
    op_timeout_s: float, outside: datetime.timedelta | None, generation: Callable[[], int] | None = None
) -> PatchHandle:
    """Every live process group gets ``op_timeout_s`` until the handle is removed; then each its own
    back, and one created meanwhile ``outside`` (the job's timeout; None: torch's default for new
    groups, ``distributed_c10d.default_pg_timeout``).

    Args:
        op_timeout_s: ds-swift's op timeout (``watchdog.op_timeout_s``, ``--op-timeout``).
        outside: the timeout the job gave its process groups.
        generation: the generation in force; where it moved on inside the call every group is new.
            Groups are remembered by name, never by reference: a reference would keep a failed
            generation's sockets open through its teardown (see ``release_process_groups``).
    """
    _check_versions()
    c10d = dist.distributed_c10d
    if not dist.is_initialized():
        return PatchHandle("op_timeout_scope", lambda: None)
    start = generation() if generation is not None else None
    groups = _live_groups()
    before = {c10d._world.pg_names[g]: [b.options._timeout for b in _backends(g)] for g in groups}
    op = datetime.timedelta(seconds=op_timeout_s)
    for g in groups:
        c10d._set_pg_timeout(op, g)
    del groups

    def restore() -> None:
        if not dist.is_initialized():
            return  # torn down inside the call (a failed generation): nothing left to give back
        job = outside if outside is not None else c10d.default_pg_timeout
        same = generation is None or generation() == start
        for g in _live_groups():
            timeouts = before.get(c10d._world.pg_names[g]) if same else None
            if timeouts is not None:
                for backend, timeout in zip(_backends(g), timeouts, strict=False):
                    backend._set_default_timeout(timeout)
            elif not _own(g):
                c10d._set_pg_timeout(job, g)

    return PatchHandle("op_timeout_scope", restore)


def job_timeout_after_connect(outside: datetime.timedelta | None) -> None:
    """Give the world, created with the join timeout, the job's own op timeout.

    Gloo connects every pair of ranks when the world is created, each waiting for its peer's address
    for the group's timeout: a rank killed between the generation's join and that exchange (a
    second failure during a recovery) left every other rank there for the job's timeout (torch's
    default: 30 min). The world is therefore created with the join timeout (ds_swift.runtime.context
    .join_generation) and gets the job's afterwards: ``outside``, or torch's default for each backend
    (``default_pg_timeout``; NCCL's ``default_pg_nccl_timeout``), as ``init_process_group`` would have.
    """
    _check_versions()
    c10d = dist.distributed_c10d
    defaults = {
        "cpu": c10d.default_pg_timeout,
        "cuda": getattr(c10d, "default_pg_nccl_timeout", None) or c10d.default_pg_timeout,
    }
    for device, backend in _device_backends(c10d._get_default_group()):
        backend._set_default_timeout(outside if outside is not None else defaults[device])
