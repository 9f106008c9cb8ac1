"""Capture what a DeepSpeed PipelineEngine sends to its neighbour stages, and its idle points.

Seams: the engine's instruction table (ds_swift.patches.instructions), per engine instance, and
the p2p module around one handler call (ds_swift.patches.pipe_p2p).

- ``SendActivation`` / ``SendGrad``: while DeepSpeed's handler runs, ``p2p.send`` is wrapped so
  that the *exact* tensors handed to the wire are captured (after DeepSpeed's own casts: the
  bool-mask ``.half()``, tensor-parallel partitioning, skipped non-float inputs), excluding the
  shape/dtype metadata that ``_send_tensor_meta`` sends on the first micro-batch. Only sends
  from the thread running the instruction are captured (a watchdog's poison send is not a
  message). The callback gets them only when the handler returned: a send that raised was not
  delivered and is not logged.
- Idle points, where the sender copies queued messages off the device (SWIFT section 5.1):
  before ``RecvActivation``/``RecvGrad`` (the stage is about to wait on a neighbour; the warm-up
  and cool-down bubbles of the 1F1B schedule are exactly these waits) and after
  ``OptimizerStep`` (the end of the iteration, so no message waits longer than one iteration).
- Evaluation (``eval_batch``, the module in eval mode) is never captured: it is not replayed.

Pinned to ``SUPPORTED_DEEPSPEED`` (ds_swift.patches._base; the p2p module and ``_send_tensor_meta`` are internals).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_swift.patches._base import PatchHandle, check_deepspeed
from ds_swift.patches.instructions import hook_instructions, schedule
from ds_swift.patches.pipe_p2p import capture_sends

__all__ = ["IdleCallback", "SendCallback", "install"]

#: (kind "act" | "grad", tensors as sent)
SendCallback = Callable[[str, list[torch.Tensor]], None]
#: (where: "recv_act" | "recv_grad" | "step")
IdleCallback = Callable[[str], None]


def _capturing_send(
    engine: Any, call_next: Callable[..., Any], kwargs: dict[str, Any]
) -> tuple[Any, list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    in_meta = False
    had_meta = "_send_tensor_meta" in engine.__dict__
    original_meta = engine._send_tensor_meta

    def on_send(tensor: torch.Tensor) -> None:
        if not in_meta:
            captured.append(tensor.detach())

    def send_tensor_meta(*args: Any, **kw: Any) -> Any:
        nonlocal in_meta
        in_meta = True
        try:
            return original_meta(*args, **kw)
        finally:
            in_meta = False

    # The instance attribute shadows the class's method for this one handler call.
    engine._send_tensor_meta = send_tensor_meta
    try:
        with capture_sends(on_send):
            result = call_next(**kwargs)
    finally:
        if had_meta:
            engine._send_tensor_meta = original_meta
        else:
            del engine.__dict__["_send_tensor_meta"]
    return result, captured


def install(
    engine: Any,
    name: str,
    on_send: SendCallback,
    on_idle: IdleCallback,
    kinds: frozenset[str] = frozenset({"act", "grad"}),
) -> PatchHandle:
    """Hook ``engine``: ``on_send`` after each captured send of the given kinds, ``on_idle`` at idle points.

    Args:
        engine: a ``deepspeed.runtime.pipe.engine.PipelineEngine``.
        name: the hook set's unique name on this engine.
        on_send: called on the training thread with (kind, tensors sent), in send order.
        on_idle: called on the training thread at each idle point.
        kinds: which sends to capture ("act", "grad"); the others run untouched.
    """
    check_deepspeed()

    def send_hook(kind: str) -> Callable[..., Any]:
        def hook(engine: Any, call_next: Callable[..., Any], **kwargs: Any) -> Any:
            if not engine.module.training:
                return call_next(**kwargs)
            result, captured = _capturing_send(engine, call_next, kwargs)
            if captured:
                on_send(kind, captured)
            return result

        return hook

    def idle_before(where: str) -> Callable[..., Any]:
        def hook(engine: Any, call_next: Callable[..., Any], **kwargs: Any) -> Any:
            if engine.module.training:
                on_idle(where)
            return call_next(**kwargs)

        return hook

    def idle_after(engine: Any, call_next: Callable[..., Any], **kwargs: Any) -> Any:
        result = call_next(**kwargs)
        on_idle("step")
        return result

    hooks: dict[type, Callable[..., Any]] = {
        schedule.RecvActivation: idle_before("recv_act"),
        schedule.RecvGrad: idle_before("recv_grad"),
        schedule.OptimizerStep: idle_after,
    }
    if "act" in kinds:
        hooks[schedule.SendActivation] = send_hook("act")
    if "grad" in kinds:
        hooks[schedule.SendGrad] = send_hook("grad")
    return hook_instructions(engine, name, hooks)
