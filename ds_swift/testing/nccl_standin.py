"""A CPU stand-in for NCCL's semantics, for the multi-process tests (one GPU cannot host an NCCL world).

On a gloo world, every collective and point-to-point call of DeepSpeed's (and the example's) groups
is given what NCCL does when a peer is lost, instead of gloo's immediate error:

- **the host is not told.** A call whose peer is gone returns (``wait()`` too) as if it completed;
  what it was to write never lands: the buffer holds whatever part gloo wrote, usually this rank's
  own contribution, not the reduced value. Nothing raises before the step.
- **the device is stuck until an abort.** Every later call on the generation's groups is enqueued
  behind the stuck one and does nothing; a wait for the device (:meth:`synchronize`, what
  ``torch.cuda`` synchronisation is on a GPU) blocks until the communicators are aborted.
- **an abort ends it.** :meth:`abort` (ds-swift's, through ds_swift.transport.communicators) frees
  the waits, a blocking send or receive from a peer that is alive but never comes too; every later
  call on the generation's groups raises, as NCCL's aborted communicators do (``DistBackendError``). Unaborted, a stuck wait ends after the op timeout the way torch's own
  watchdog ends it under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: an error recorded (:meth:`errors`,
  ``ProcessGroupNCCL::getError``), then the abort.
- **its own errors:** once a call is stuck, torch's watchdog would record a communicator error:
  :meth:`errors` says so.
- **creation waits for every member.** A group's communicator is created at its first collective
  (NCCL's lazy creation): every member must arrive (a count in the world's store) before any goes
  on. In non-blocking mode (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``) an abort ends the wait with an
  error, and so does ``TORCH_NCCL_NONBLOCKING_TIMEOUT``; in blocking mode nothing does, as nothing
  reaches a blocking ``ncclCommInitRank`` waiting in NCCL's bootstrap.

Calls on ds-swift's own transport groups (gloo on a GPU cluster too) pass through unchanged. A new
world (the next generation) starts afresh. What it does not model: a successful call's data
landing after ``wait()`` (on a CPU the host is the device, so the next computation would read it
unlanded; on a GPU stream order protects it), eager creation (at ``init_process_group`` with a
``device_id``: here every group creates at its first collective, which a failure during the
rebuild's first collectives meets the same way), and point-to-point communicators' creation.

``SWIFT_TEST_STANDIN_DIE_CREATING=1``: the replacement that joins generation 1 SIGKILLs itself as
it starts creating its first communicator (a peer lost while a generation creates its
communicators).

Install it in a worker before DeepSpeed starts (:func:`install`); ``tests/dist/workers/
nccl_standin_worker.py`` runs the example so.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from ds_swift.logs import say_here
from ds_swift.patches.comm_intercept import Call, intercept_comm
from ds_swift.transport.communicators import use_device_communicators

__all__ = ["NcclStandIn", "StandInAborted", "install"]

#: Group descriptions of ds-swift's own transport groups (gloo on a GPU cluster too).
_OWN = "ds_swift_"


class StandInAborted(dist.DistBackendError):
    """A call on a communicator the stand-in aborted (NCCL: "NCCL communicator was aborted")."""


class _Done:
    """The work of a call the stuck device swallowed: complete, no error (NCCL's non-blocking wait)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None


class _Work:
    """A gloo work whose failure is swallowed (the device gets stuck) instead of raised."""

    def __init__(self, standin: NcclStandIn, name: str, work: Any) -> None:
        self._standin, self._name, self._work = standin, name, work

    def wait(self, timeout: Any = None) -> bool:
        try:
            self._work.wait()
        except RuntimeError as exc:
            self._standin.stick(self._name, exc)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None


class NcclStandIn:
    """NCCL's host-side semantics over gloo (see the module's docstring); ds-swift's device
    communicators (:class:`ds_swift.transport.communicators.DeviceCommunicators`).

    Args:
        op_timeout_s: after this long stuck and not aborted, the wait for the device ends as torch's
            watchdog ends it (error recorded, communicators aborted).
        rank: named in what it says.
    """

    def __init__(self, op_timeout_s: float, rank: int = -1) -> None:
        self.op_timeout_s = op_timeout_s
        self.rank = rank
        self._cond = threading.Condition()
        self._world: Any = None
        self.stuck: str | None = None
        """The call the device is stuck in (None: it is not)."""
        self.aborted = False
        self.error: str | None = None
        #: the calls the stuck device swallowed since it got stuck
        self.swallowed = 0
        #: the groups whose communicator this world created (by torch's group name)
        self.created: set[str] = set()

    # ------------------------------------------------------------------ the calls
    def _fresh(self) -> None:
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        if world is not self._world:  # the next generation: new communicators
            self._world, self.stuck, self.aborted, self.error, self.swallowed = world, None, False, None, 0
            self.created = set()

    def around(self, call: Call) -> Any:
        group = call.group
        if group is not None and str(getattr(group, "group_desc", "")).startswith(_OWN):
            return call.run()
        with self._cond:
            self._fresh()
            if self.aborted:
                raise StandInAborted(f"NCCL communicator was aborted ({call.name}; stand-in for NCCL)")
            if self.stuck is not None:
                self.swallowed += 1
                return _Done() if call.async_op else None
        if call.name not in _P2P:
            self._create(group)
        elif call.name in _BLOCKING_P2P:
            return self._blocking_p2p(call)
        try:
            out = call.run()
        except RuntimeError as exc:
            self.stick(call.name, exc)
            return _Done() if call.async_op else None
        if call.async_op and out is not None:
            return [_Work(self, call.name, w) for w in out] if isinstance(out, list) else _Work(self, call.name, out)
        return out

    def _blocking_p2p(self, call: Call) -> Any:
        """A blocking send or receive, whose host wait an abort ends (NCCL: the kernel waiting on a
        peer that never comes dies with this rank's communicators). Gloo's blocking call is ended by
        nothing but its peer: a survivor's receive from a neighbour that left for the next generation
        (alive, so never an error) waited forever although the rank's watchdog had aborted. The gloo
        call runs on a thread of its own; an abort ends the wait with NCCL's error; unaborted, the op
        timeout ends it as torch's watchdog would (:meth:`synchronize`). The abandoned call ends when
        its group is destroyed."""
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(("ok", call.run()))
            except RuntimeError as exc:
                result.append(("error", exc))
            with self._cond:
                self._cond.notify_all()

        threading.Thread(target=run, name=f"nccl-standin-{call.name}", daemon=True).start()
        deadline = time.monotonic() + self.op_timeout_s
        with self._cond:
            while not result and not self.aborted:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stuck = self.stuck or call.name
                    self._time_out(call.name)
                    break
                self._cond.wait(left)
            if not result:
                raise StandInAborted(f"NCCL communicator was aborted ({call.name} pending; stand-in for NCCL)")
        kind, value = result[0]
        if kind == "error":
            self.stick(call.name, value)
            return None
        return value

    def _create(self, group: Any) -> None:
        """Create ``group``'s communicator if this world has not yet: wait for every member."""
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        name = str(pg.group_name)
        if name in self.created:
            return
        nonblocking = os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "").strip().lower() in _TRUE
        limit = float(os.environ.get("TORCH_NCCL_NONBLOCKING_TIMEOUT", "1800")) if nonblocking else math.inf
        deadline = time.monotonic() + limit
        _die_if_asked()
        store, key, size = dist.distributed_c10d._get_default_store(), f"nccl_standin/created/{name}", pg.size()
        store.add(key, 1)
        while store.add(key, 0) < size:
            with self._cond:
                if self.aborted and nonblocking:
                    raise StandInAborted(f"NCCL communicator creation of group {name} aborted (stand-in for NCCL)")
                self._cond.wait(0.02)
            if time.monotonic() > deadline:
                raise dist.DistBackendError(
                    f"NCCL communicator creation of group {name} not done within TORCH_NCCL_NONBLOCKING_TIMEOUT="
                    f"{limit:g} s (stand-in for NCCL)"
                )
        self.created.add(name)

    def stick(self, name: str, exc: BaseException) -> None:
        """Call ``name`` lost its peer (gloo raised ``exc``): the device is stuck in it."""
        with self._cond:
            if self.stuck is None and not self.aborted:
                self.stuck = name
                self.error = f"COMM_ERROR (stand-in: {name} lost its peer)"
                say_here(f"NCCL stand-in: {name} lost its peer ({str(exc)[:80]}); the device is stuck until an abort")

    # ------------------------------------------------------------------ DeviceCommunicators
    def present(self) -> bool:
        return dist.is_initialized()

    def abort(self) -> int:
        with self._cond:
            self._fresh()
            self.aborted = True
            self._cond.notify_all()
        return 1

    def errors(self) -> list[str]:
        with self._cond:
            self._fresh()
            return [self.error] if self.error is not None else []

    def synchronize(self) -> None:
        """The host waits for the device: at once unless it is stuck; then until an abort (or the op
        timeout, as torch's watchdog would end it)."""
        deadline = time.monotonic() + self.op_timeout_s
        with self._cond:
            self._fresh()
            while self.stuck is not None and not self.aborted:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._time_out(self.stuck)
                    break
                self._cond.wait(left)

    def _time_out(self, call: str) -> None:
        """``call`` waited the op timeout unaborted: torch's watchdog records the error and aborts
        (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``). Holding ``_cond``."""
        self.error = f"TIMEOUT (stand-in: {call} for {self.op_timeout_s:g} s)"
        self.aborted = True


_P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_BLOCKING_P2P = ("send", "recv")
_TRUE = ("1", "true", "yes", "on", "y")


def _die_if_asked() -> None:
    if (
        os.environ.get("SWIFT_TEST_STANDIN_DIE_CREATING") == "1"
        and os.environ.get("SWIFT_REPLACEMENT") == "1"
        and os.environ.get("SWIFT_GENERATION") == "1"
    ):
        print("[test] NCCL stand-in: this replacement dies as it creates its first communicator", file=sys.stderr)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def install(op_timeout_s: float | None = None) -> NcclStandIn:
    """Give this process NCCL's semantics on its gloo world: intercept torch.distributed's calls and
    make the stand-in ds-swift's device communicators. Before ``deepspeed.init_distributed``."""
    timeout = op_timeout_s if op_timeout_s is not None else float(os.environ.get("SWIFT_OP_TIMEOUT_S", "15"))
    standin = NcclStandIn(timeout, int(os.environ.get("RANK", "-1")))
    intercept_comm(standin.around)
    use_device_communicators(standin)
    return standin
