"""Reversible patch: route torch.distributed's communication calls through a callable (CPU tests only).

The CPU stand-in for NCCL's semantics (ds_swift.testing.nccl_standin) needs to see every collective
and point-to-point call DeepSpeed, megatron-core and the example make, to give them NCCL's
behaviour on a gloo world. They all reach torch through the ``torch.distributed`` module's
attributes at call time (deepspeed/comm/torch.py's TorchBackend, 0.19.8; it caches
``all_gather_into_tensor`` and ``reduce_scatter_tensor`` when ``deepspeed.init_distributed`` makes
it, so install this first). Never used by a training job.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ds_swift.patches._base import PatchError, PatchHandle

__all__ = ["INTERCEPTED", "Call", "intercept_comm"]

#: The communication functions routed (those of them this torch has).
INTERCEPTED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)

_MARK = "_ds_swift_comm_intercepted"


class Call:
    """One intercepted call: ``name``, the original function, its bound arguments."""

    def __init__(self, name: str, fn: Callable[..., Any], args: inspect.BoundArguments) -> None:
        self.name, self.fn, self.bound = name, fn, args

    @property
    def group(self) -> Any:
        """The group named (None: the world; ``batch_isend_irecv``: its first op's)."""
        if self.name == "batch_isend_irecv":
            ops = self.bound.arguments.get("p2p_op_list") or []
            return getattr(ops[0], "group", None) if ops else None
        return self.bound.arguments.get("group")

    @property
    def async_op(self) -> bool:
        return self.name in ("isend", "irecv", "batch_isend_irecv") or bool(self.bound.arguments.get("async_op"))

    def run(self) -> Any:
        return self.fn(*self.bound.args, **self.bound.kwargs)


def intercept_comm(around: Callable[[Call], Any]) -> PatchHandle:
    """Make every function of :data:`INTERCEPTED` on ``torch.distributed`` call ``around(call)``
    instead (which may ``call.run()`` the original). ``remove()`` puts the originals back."""
    if getattr(dist, _MARK, False):
        raise PatchError("torch.distributed's communication calls are already intercepted by ds-swift")
    originals = {name: getattr(dist, name) for name in INTERCEPTED if hasattr(dist, name)}

    def routed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return around(Call(name, fn, signature.bind(*args, **kwargs)))

        return call

    for name, fn in originals.items():
        setattr(dist, name, routed(name, fn))
    setattr(dist, _MARK, True)

    def restore() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        delattr(dist, _MARK)

    return PatchHandle("torch.distributed communication intercepted", restore)
