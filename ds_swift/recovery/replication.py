"""Replication-based recovery: a surviving replica sends its whole training state to a replacement.

The state of a pipeline rank (ZeRO stage 0) is its stage's module parameters and buffers, the
optimizer state, the LR scheduler, the step counters and the RNG state. A data-parallel replica
of the same stage holds bitwise the same parameters and optimizer state (gradients are
all-reduced before every step), so copying it gives the replacement exactly what the lost rank
had at the consensus iteration.

Wire format, over torch.distributed point-to-point in the new generation: one int64 length, the
pickled skeleton (the state with every tensor replaced by a reference, plus shapes and dtypes),
then one flat buffer per dtype holding every tensor of that dtype. A few large sends instead of
hundreds of small ones.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["capture_state", "flatten", "load_state", "recv_state", "send_state", "unflatten"]


@dataclass(frozen=True)
class _TensorRef:
    index: int


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` (nested dicts/lists/tuples) into a tensor-free skeleton and its tensors."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _TensorRef(len(tensors) - 1)
        if isinstance(x, dict):
            # OrderedDicts (state dicts) become plain dicts: load_state_dict accepts either.
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(obj), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, _TensorRef):
            return tensors[x.index]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(skeleton)


def _dtype_order(tensors: Iterable[torch.Tensor]) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    for t in tensors:
        if t.dtype not in seen:
            seen.append(t.dtype)
    return seen


def send_state(state: Any, dst: int, group: Any = None, send: Callable[..., Any] | None = None) -> int:
    """Send ``state`` to rank ``dst``; returns the payload bytes sent.

    Args:
        state: nested dicts/lists/tuples of tensors and picklable values.
        dst: the receiving rank.
        group: the process group (default: the world).
        send: ``send(tensor, dst, group=...)``; torch.distributed's by default (tests pass a queue).
    """
    send = send or dist.send
    skeleton, tensors = flatten(state)
    metas = [(tuple(t.shape), t.dtype, t.device.type) for t in tensors]
    header = io.BytesIO()
    pickle.dump((skeleton, metas), header, protocol=pickle.HIGHEST_PROTOCOL)
    blob = torch.frombuffer(bytearray(header.getvalue()), dtype=torch.uint8)
    send(torch.tensor([blob.numel()], dtype=torch.int64), dst, group=group)
    send(blob, dst, group=group)
    sent = blob.numel()
    for dtype in _dtype_order(tensors):
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in tensors if t.dtype == dtype])
        send(flat, dst, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_state(src: int, group: Any = None, recv: Callable[..., Any] | None = None) -> Any:
    """Receive a state sent by :func:`send_state` from rank ``src`` (tensors land on the CPU)."""
    recv = recv or dist.recv
    length = torch.zeros(1, dtype=torch.int64)
    recv(length, src, group=group)
    blob = torch.empty(int(length.item()), dtype=torch.uint8)
    recv(blob, src, group=group)
    skeleton, metas = pickle.loads(blob.numpy().tobytes())
    tensors: list[torch.Tensor | None] = [None] * len(metas)
    for dtype in _dtype_order(torch.empty(0, dtype=d) for _, d, _ in metas):
        idx = [i for i, (_, d, _) in enumerate(metas) if d == dtype]
        sizes = [int(torch.Size(metas[i][0]).numel()) for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype)
        recv(flat, src, group=group)
        for i, part in zip(idx, torch.split(flat, sizes)):
            tensors[i] = part.reshape(metas[i][0]).clone()
    return unflatten(skeleton, [t for t in tensors if t is not None])  # every slot is filled above


def capture_state(engine: Any) -> dict[str, Any]:
    """A rank's whole training state, by reference (no copies): what a donor sends."""
    state: dict[str, Any] = {
        "module": engine.module.state_dict(),
        "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if getattr(engine, "lr_scheduler", None) else None,
        "counters": counters_of(engine),
        "rng": {"torch": torch.get_rng_state()},
    }
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def counters_of(engine: Any) -> dict[str, int]:
    return {
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
        "micro_steps": int(getattr(engine, "micro_steps", 0)),
    }


def set_counters(engine: Any, iteration: int) -> None:
    """Make ``engine`` stand at the start of ``iteration`` (after ``iteration`` steps)."""
    engine.global_steps = iteration
    engine.global_samples = iteration * engine.train_batch_size()
    engine.micro_steps = iteration * engine.gradient_accumulation_steps()


def load_state(engine: Any, state: dict[str, Any], iteration: int) -> None:
    """Load a captured state into a (rebuilt or fresh) engine that resumes at ``iteration``."""
    engine.module.load_state_dict(state["module"], strict=True)
    if state.get("optimizer") is not None and engine.optimizer is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
    if state.get("lr_scheduler") is not None and getattr(engine, "lr_scheduler", None) is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    counters = state.get("counters", {})
    set_counters(engine, iteration)
    engine.skipped_steps = int(counters.get("skipped_steps", 0))
    rng = state.get("rng") or {}
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
