"""Every tensor ds-swift itself moves between ranks, and the process groups it moves them on.

State transfers, buddy copies, erasure-coded chunks, elastic resharding, the wake-up of pipeline
neighbours and the small agreements (checkpoint written everywhere, CheckFreq's interval, the
logging budget's sizes) go through this package; no other ds-swift module calls
``torch.distributed``'s communication functions (``scripts/check_transport.py`` checks it).
DeepSpeed's own pipeline p2p and collectives are not ds-swift's traffic and stay as DeepSpeed
makes them.

Life of a transport: :func:`open_generation` on every rank right after the world of a generation
is initialised (``ds_swift.runtime.context`` does it: before DeepSpeed creates any group, so every
rank creates its groups in the same order), :func:`current` wherever a call is made, and
:func:`teardown_world` when the generation ends (``patches/deepspeed_rebuild.py``). Routing and
strict mode: :mod:`ds_swift.transport.core`; ending a generation on gloo and on NCCL:
:mod:`ds_swift.transport.shutdown`; the device communicators, their abort and what a step trusts
(:func:`step_taint`): :mod:`ds_swift.transport.communicators`; torch's NCCL settings and the
versions ds-swift needs: :mod:`ds_swift.transport.nccl`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.transport.communicators import (
    Taint,
    abort_device_communicators,
    device_communicators,
    live_groups,
    use_device_communicators,
)
from ds_swift.transport.core import (
    COPIER,
    HOST,
    STRICT_ENV,
    Call,
    StrictTransportError,
    Transport,
    TransportError,
    set_strict,
    strict_enabled,
)
from ds_swift.transport.nccl import NcclSettingError, check_nccl_versions, nccl_environment
from ds_swift.transport.shutdown import (
    backends_of,
    carries_poison,
    current_plan,
    execute,
    poison,
    wake_action,
)

__all__ = [
    "COPIER",
    "HOST",
    "STRICT_ENV",
    "Call",
    "NcclSettingError",
    "StrictTransportError",
    "Taint",
    "Transport",
    "TransportError",
    "all_gather_json",
    "barrier",
    "carries_poison",
    "check_nccl_versions",
    "close",
    "current",
    "device_communicators",
    "irecv",
    "isend",
    "nccl_environment",
    "on_generation_failed",
    "open_generation",
    "recv",
    "send",
    "set_strict",
    "step_taint",
    "strict_enabled",
    "synchronize_device",
    "teardown_world",
    "use_device_communicators",
    "wake_neighbours",
]


class _Registry:
    """The transport of the generation in force in this process (one world at a time, as torch has)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.transport: Transport | None = None


_REGISTRY = _Registry()


def open_generation(timeout_s: float | None = None, generation: int = -1) -> Transport:
    """Create the transport of ``generation``: collective, on every rank, right after the world is
    initialised and before any other ``new_group`` (see :meth:`Transport.create`)."""
    transport = Transport.create(timeout_s)
    transport.generation = generation
    with _REGISTRY.lock:
        _REGISTRY.transport = transport
    return transport


def current() -> Transport:
    """The transport of the world in force. Raises TransportError where none was opened for it: a
    transport made lazily here could create its groups in another order on each rank."""
    if not dist.is_initialized():
        raise TransportError(
            "ds-swift transport: torch.distributed is not initialised (call ds_swift.init_distributed)"
        )
    world = dist.distributed_c10d._get_default_group()
    with _REGISTRY.lock:
        t = _REGISTRY.transport
        if t is not None and t.world is world and t.open:
            return t
        if dist.get_world_size() == 1:
            # One rank has nobody to disagree with on the order of its groups (unit tests that
            # initialise a one-rank world themselves); made under the lock: two threads may ask.
            _REGISTRY.transport = Transport.create()
            return _REGISTRY.transport
    raise TransportError(
        "ds-swift transport: not open for this process group; call ds_swift.transport.open_generation() on every rank "
        "right after init_process_group, before DeepSpeed creates its groups (ds_swift.init_distributed does)"
    )


def close() -> list[Any]:
    """Forget the transport of the generation in force; returns its groups (for the teardown)."""
    with _REGISTRY.lock:
        t, _REGISTRY.transport = _REGISTRY.transport, None
    return t.release() if t is not None else []


# ----------------------------------------------------------------------------- calls on the current transport
def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    current().send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> None:
    current().recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
    return current().isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
    return current().irecv(tensor, src, group=group, tag=tag)


def barrier() -> None:
    current().barrier()


def all_gather_json(value: Any) -> list[Any]:
    return current().all_gather_json(value)


# ----------------------------------------------------------------------------- end of a generation
def wake_neighbours(peers: Iterable[int], wait_s: float = 0.02) -> str:
    """Wake ``peers`` (pipeline neighbours) blocked in a receive from this rank before it leaves a
    failed generation; returns how: "poison" (gloo) or "abort" (NCCL; see
    :mod:`ds_swift.transport.shutdown`). A no-op where torch.distributed is gone already."""
    if not dist.is_initialized():
        return "none"
    how = wake_action(backends_of())
    if how == "abort":
        _mark(_REGISTRY.transport, "this rank left the failed generation")
        abort_device_communicators()
        return how
    # Gloo completes a send only once the peer receives: do not wait long; a neighbour that is
    # not receiving gets "connection closed" from the teardown that follows instead.
    works = poison(peers)
    deadline = time.monotonic() + wait_s
    for w in works:
        try:
            while not w.is_completed() and time.monotonic() < deadline:
                time.sleep(0.001)
        except Exception:  # noqa: BLE001, S110 - a failed poison send needs nothing more
            pass
    return how


def on_generation_failed(generation: int, why: str = "the generation failed") -> int:
    """The watchdog thread saw ``generation`` fail: mark it aborted, then abort this rank's device
    communicators at once, so a training thread blocked behind a kernel waiting on a dead peer is
    released (on gloo there is nothing to abort: no gloo op can be interrupted from another thread;
    the training thread's teardown wakes its neighbours). Returns how many communicators were
    aborted.

    The mark comes first: an abort ends kernels with partial buffers and no error the host sees, so
    a step that passes :func:`step_taint` after the host waited for the device is one whose
    collectives landed before any abort (ds_swift.patches.step_guard).

    Only ``generation``'s: under the registry's lock, and only while its transport is the one in
    force (the teardown forgets the transport under that lock before it ends the world, and the next
    generation's transport is registered only after), so a late hook never aborts the next world."""
    with _REGISTRY.lock:
        t = _REGISTRY.transport
        if t is None or t.generation != generation or not device_communicators().present():
            return 0
        _mark(t, why)
        return abort_device_communicators()


def _mark(t: Transport | None, why: str) -> None:
    if t is not None and t.aborted is None:
        t.aborted = why


def step_taint() -> Taint | None:
    """Why a step computed now must not be applied (None: it may): ds-swift marked the generation
    in force aborted, or torch's own NCCL watchdog recorded an error or timeout on one of this
    rank's communicators (it aborts them itself under ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, after
    recording). Meaningful after :func:`synchronize_device`: the collectives the step follows have
    then landed, unless an abort (marked first) cut them."""
    t = _REGISTRY.transport  # one attribute read; the watchdog thread writes the mark before it aborts
    if t is not None and t.aborted is not None:
        return Taint(f"ds-swift aborted the generation's communicators ({t.aborted})", declared=True)
    errors = device_communicators().errors()
    if errors:
        return Taint("torch's NCCL watchdog recorded " + "; ".join(errors), declared=False)
    return None


def synchronize_device() -> None:
    """Wait until the device finished everything enqueued so far (the collectives included)."""
    device_communicators().synchronize()


def teardown_world() -> list[Any]:
    """End this rank's side of the generation: its transport first (a group still referenced keeps
    its sockets open), then every group, destroyed (gloo) or aborted (NCCL), and torch's registry of
    them emptied. Returns the groups, still referenced: whoever drops the list frees them (each one's
    sockets close and its threads end then, ~18 ms a gloo group on torch 2.13, measured), so that a
    caller that need not wait for it can let go of them on a thread of its own."""
    held = close()
    if dist.is_initialized():
        held.extend(live_groups())
    execute(current_plan())
    return held
