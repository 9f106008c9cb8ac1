"""What one buddy round copies of a rank (ds_swift.protect.buddy): the payload, and its size.

The optimizer partition as its wrapper holds it (fp32 masters, the inner optimizer's state, loss
scaler, flags: ds_swift.patches.deepspeed_optim_state), the LR scheduler, the engine's counters and
the module's non-parameter buffers, as a tensor-only payload (JSON manifest + tensors,
ds_swift.recovery.state.transfer.encode).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_swift.patches.deepspeed_optim_state import capture_optimizer, optimizer_payload
from ds_swift.protect.module_buffers import persistent_buffers
from ds_swift.recovery.state.transfer import counters_of, encode

__all__ = ["round_bytes", "state_payload"]


def round_bytes(engine: Any) -> tuple[int, str]:
    """Bytes one buddy round stages of this rank after a step (:func:`state_payload`:
    the optimizer partition's fp32 masters and its inner optimizer's state, the LR scheduler, the
    counters, the module's buffers), and how they were counted.

    At start-up no step has run yet, and Adam creates its moments at the first one: those it will
    create are counted as it creates them (exp_avg and exp_avg_sq, each as large as the fp32 master
    partition, max_exp_avg_sq under amsgrad; torch's Adam also a float32 step per parameter), and
    so is the wrapper's gradient norm the first step keeps as a tensor: the figure is a round's
    after the first step. Another optimizer's state to come is not known here: the line says so."""
    from ds_swift.patches.deepspeed_optim_state import capture_optimizer, flag_bytes_to_come

    _, tensors = state_payload(engine)
    now = sum(t.numel() * t.element_size() for t in tensors)
    inner = capture_optimizer(engine.optimizer)["inner"]
    empty = {id(p) for g in inner.param_groups for p in g["params"] if not inner.state.get(p)}
    if not empty:
        return now, "measured from the state the copier sends"
    if "Adam" not in type(inner).__name__:
        return now, (
            f"the state the copier sends now; {type(inner).__name__}'s state of {len(empty)} parameter(s) "
            "is created at the first step and not counted"
        )
    torch_step = 4 if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) else 0  # a float32 tensor each
    to_come = flag_bytes_to_come(engine.optimizer)  # the wrapper's gradient norm, a tensor from the first step
    for group in inner.param_groups:
        moments = 3 if group.get("amsgrad") else 2
        to_come += sum(moments * p.numel() * p.element_size() + torch_step for p in group["params"] if id(p) in empty)
    return now + to_come, "the state the copier sends, with the Adam moments the first step creates"


def state_payload(engine: Any) -> tuple[bytes, list[torch.Tensor]]:
    """What a round copies of ``engine``: the optimizer partition (fp32 masters, inner state, loss
    scaler, flags), the LR scheduler, the engine's counters and the module's non-parameter buffers,
    encoded (the tensors are the live ones, flat)."""
    payload = {
        "optimizer": optimizer_payload(capture_optimizer(engine.optimizer)),
        "lr_scheduler": engine.lr_scheduler.state_dict() if getattr(engine, "lr_scheduler", None) else None,
        "counters": counters_of(engine),
        "buffers": persistent_buffers(engine.module),  # state_dict's, without its walk per step
    }
    manifest, tensors = encode(payload)
    return manifest, [t.detach().reshape(-1) for t in tensors]
