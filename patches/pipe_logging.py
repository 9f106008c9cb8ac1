"""Capture what a DeepSpeed PipelineEngine sends to its neighbour stages, and its idle points.

Seam: the engine's instruction table (ds_swift.patches.instructions), per engine instance.

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

Pinned to DeepSpeed >=0.19,<0.20 (the p2p module and ``_send_tensor_meta`` are internals).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.pipe import p2p

from ds_swift.patches._base import PatchHandle, check_version
from ds_swift.patches.instructions import hook_instructions, schedule

__all__ = ["IdleCallback", "PipelinePosition", "SendCallback", "install", "pipeline_position"]

#: (kind "act" | "grad", tensors as sent)
SendCallback = Callable[[str, list[torch.Tensor]], None]
#: (where: "recv_act" | "recv_grad" | "step")
IdleCallback = Callable[[str], None]


@dataclass(frozen=True)
class PipelinePosition:
    """Where an engine sits in the 3D grid, and whom it sends to."""

    rank: int
    stage: int
    num_stages: int
    dp_rank: int
    tp_rank: int
    next_rank: int | None  # receives this rank's activations
    prev_rank: int | None  # receives this rank's gradients


def pipeline_position(engine: Any) -> PipelinePosition:
    grid = engine.grid
    stage = int(engine.stage_id)
    num_stages = int(engine.num_stages)
    return PipelinePosition(
        rank=int(engine.global_rank),
        stage=stage,
        num_stages=num_stages,
        dp_rank=int(grid.get_data_parallel_id()),
        tp_rank=int(grid.get_slice_parallel_rank()),
        next_rank=int(grid.stage_to_global(stage_id=stage + 1)) if stage + 1 < num_stages else None,
        prev_rank=int(grid.stage_to_global(stage_id=stage - 1)) if stage > 0 else None,
    )


def _capturing_send(engine: Any, call_next: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    captured: list[torch.Tensor] = []
    in_meta = False
    me = threading.get_ident()
    original_send = p2p.send
    had_meta = "_send_tensor_meta" in engine.__dict__
    original_meta = engine._send_tensor_meta

    def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
        if not in_meta and threading.get_ident() == me:
            captured.append(tensor.detach())
        return original_send(tensor, dest_stage, async_op=async_op)

    def send_tensor_meta(*args: Any, **kw: Any) -> Any:
        nonlocal in_meta
        in_meta = True
        try:
            return original_meta(*args, **kw)
        finally:
            in_meta = False

    p2p.send = send
    engine._send_tensor_meta = send_tensor_meta
    try:
        result = call_next(**kwargs)
    finally:
        p2p.send = original_send
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
    check_version("deepspeed", deepspeed.__version__, "0.19.0", "0.20.0")

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
