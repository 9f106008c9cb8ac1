"""The pipeline's p2p seam: ``deepspeed.runtime.pipe.p2p.send`` / ``p2p.recv``, swapped for a while.

DeepSpeed's ``PipelineEngine`` calls ``p2p.send``/``p2p.recv`` through the module attribute in its
send/receive instruction handlers (activations, gradients and the tensor-meta handshake of the
first batch), so replacing the attribute around one handler call sees exactly what that handler
puts on (or takes off) the wire. Three patches of this seam, each applied around one handler:

- :func:`capture_sends`: message logging; every tensor sent is handed to a callback, then sent;
- :func:`drop_sends`: replay; a send to a rank that is not replaying is not made;
- :func:`serve_recvs`: replay; a receive is filled by a callback (from the log), not the wire.

Each acts only on the thread that applied it: another thread's send or receive (a watchdog's
poison message) passes through to whatever was there. Each checks the DeepSpeed version, refuses
to be applied while the same patch is already in force, and returns a handle whose ``remove()``
(or ``with`` block) puts back exactly the function it replaced. Patches nest (a replay's
``drop_sends`` around the logger's ``capture_sends``) and must be removed innermost first.

Pinned to ``SUPPORTED_DEEPSPEED`` (ds_swift.patches._base; ``p2p`` is an internal module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.pipe import p2p

from ds_swift.patches._base import SUPPORTED_DEEPSPEED, PatchError, PatchHandle, check_deepspeed

__all__ = ["SUPPORTED_DEEPSPEED", "capture_sends", "drop_sends", "serve_recvs"]

_MARK = "_ds_swift_p2p"

P2PFn = Callable[..., Any]


def _in_force(fn: Any, mark: str) -> bool:
    # Our wrappers keep the function they replaced in __wrapped__: walk the chain of patches.
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        if getattr(fn, _MARK, None) == mark:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _swap(attr: str, mark: str, make: Callable[[P2PFn], P2PFn]) -> PatchHandle:
    """Replace ``p2p.<attr>`` by ``make(current)``; the handle puts ``current`` back."""
    check_deepspeed()
    original = getattr(p2p, attr)
    if _in_force(original, mark):
        raise PatchError(f"p2p.{attr} is already patched by ds-swift ({mark}); remove the first patch")
    wrapper = make(original)
    setattr(wrapper, _MARK, mark)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(p2p, attr, wrapper)

    def restore() -> None:
        if getattr(p2p, attr) is not wrapper:
            raise PatchError(f"p2p.{attr} was re-patched after ds-swift's {mark} and not restored first")
        setattr(p2p, attr, original)

    return PatchHandle(f"p2p.{attr} {mark}", restore)


def capture_sends(on_send: Callable[[torch.Tensor], None]) -> PatchHandle:
    """Call ``on_send(tensor)`` for every tensor this thread sends, before sending it.

    Args:
        on_send: gets the tensor exactly as DeepSpeed hands it to the wire (after its own casts).
    """
    me = threading.get_ident()

    def make(original: P2PFn) -> P2PFn:
        def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
            if threading.get_ident() == me:
                on_send(tensor)
            return original(tensor, dest_stage, async_op=async_op)

        return send

    return _swap("send", "capture", make)


def drop_sends() -> PatchHandle:
    """Make this thread's sends no-ops (their receiver is not there to take them)."""
    me = threading.get_ident()

    def make(original: P2PFn) -> P2PFn:
        def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
            if threading.get_ident() != me:
                return original(tensor, dest_stage, async_op=async_op)
            return None

        return send

    return _swap("send", "drop", make)


def serve_recvs(fill: Callable[[torch.Tensor], None]) -> PatchHandle:
    """Fill this thread's receive buffers with ``fill(buffer)`` instead of receiving.

    Args:
        fill: writes the message into the buffer in place (or raises: nothing was received).
    """
    me = threading.get_ident()

    def make(original: P2PFn) -> P2PFn:
        def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
            if threading.get_ident() != me:
                return original(tensor, src_stage, async_op=async_op)
            fill(tensor)
            return None

        return recv

    return _swap("recv", "serve", make)
