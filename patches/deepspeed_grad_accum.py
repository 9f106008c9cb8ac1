"""Where a DeepSpeed optimizer wrapper accumulates a parameter's gradient over the micro-batches.

Parallel recovery (ds_swift.recovery.replay.parallel) replays a share of an iteration's micro-batches on
each of two copies of a stage and must then give both copies the accumulated gradient the
sequential run had, bit for bit. Where that sum lives depends on the wrapper (DeepSpeed 0.19.8):

- ``torch``, ``zero`` (stage 1), ``fp16``, ``fp16_unfused``: in ``param.grad`` (the low-precision
  parameter's own dtype), summed by autograd's AccumulateGrad over every backward call of the
  iteration; the step reads it there. Not ZeRO-1 with a ``data_types.grad_accum_dtype`` other than
  the parameters' (fp16 with fp32 accumulation): it sums in ``param.grad_accum``, refused here.
- ``bf16`` (``BF16_Optimizer``, bf16 with ZeRO-0 or ZeRO-1): in an fp32 buffer per parameter
  (``fp32_groups_gradients``). Without ``bf16.immediate_grad_update`` the pipeline engine zeroes
  ``param.grad`` before each micro-batch's backward and adds it, cast to fp32, to that buffer after
  it (``update_hp_grads``), so the buffer is the fp32 sum of per-micro-batch bf16 sums; with it, a
  post-accumulate hook adds every backward call's gradient at once. The step, the clipping norm and
  the data-parallel reduction read the buffer, not ``param.grad``.

:func:`accumulator` says which; :func:`set_hp_grads` writes the combined buffers of a ``bf16`` wrapper.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper, WrapperKind, kind_of

__all__ = ["Accumulator", "accumulator", "hp_grads", "set_hp_grads"]


@dataclass(frozen=True)
class Accumulator:
    """How a wrapper sums a parameter's gradient over an iteration.

    Args:
        where: ``"param"`` (``param.grad``, by AccumulateGrad) or ``"hp"`` (an fp32 buffer per parameter).
        per: for ``"hp"``: the buffer gains one addend per micro-batch (``"micro_batch"``: the bf16 sum
            of that micro-batch's backward calls) or per backward call (``"call"``).
        dtype: the buffer's dtype (``"hp"``).
    """

    where: Literal["param", "hp"]
    per: Literal["micro_batch", "call"] = "call"
    dtype: torch.dtype = torch.float32


def accumulator(opt: Any) -> Accumulator:
    """Where ``opt`` (an engine's optimizer, or None) accumulates gradients; raises UnsupportedWrapper
    for wrappers ds-swift cannot read (ZeRO-2/3, CPU offload)."""
    if opt is None:
        return Accumulator("param")
    kind = kind_of(opt)
    if kind is WrapperKind.ZERO_STAGE1 and bool(getattr(opt, "use_grad_accum_attribute", False)):
        # ZeRO-1 whose gradient accumulation dtype is not the parameters' (fp16 or bf16 with
        # data_types.grad_accum_dtype fp32 outside BF16_Optimizer): the sum lives in param.grad_accum.
        raise UnsupportedWrapper(
            f"ZeRO stage 1 with data_types.grad_accum_dtype {opt.gradient_accumulation_dtype} (gradients summed in "
            "param.grad_accum)"
        )
    if kind is not WrapperKind.BF16_OPTIMIZER:
        return Accumulator("param")
    per: Literal["micro_batch", "call"] = "call" if bool(opt.immediate_grad_update) else "micro_batch"
    return Accumulator("hp", per)


def set_hp_grads(opt: Any, grads: Mapping[int, torch.Tensor]) -> int:
    """Overwrite a ``bf16`` wrapper's fp32 gradient buffers: ``grads`` maps ``id(lp param)`` to its
    gradient (the parameter's shape). Parameters absent from ``grads`` keep their buffer (zero, and
    marked as having no gradient, when no micro-batch reached them). Returns how many were set."""
    done = 0
    with torch.no_grad():
        for i, group in enumerate(opt.bf16_groups):
            for j, lp in enumerate(group):
                g = grads.get(id(lp))
                if g is None:
                    continue
                hp = opt.fp32_groups_gradients[i][j]
                hp.copy_(g.view(hp.shape))
                lp._hp_grad = hp  # what _update_hp_grad leaves behind, read by the clipping
                opt.fp32_groups_has_gradients[i][j] = True
                done += 1
    return done


def hp_grads(opt: Any) -> dict[int, torch.Tensor]:
    """A ``bf16`` wrapper's fp32 gradient buffers by ``id(lp param)`` (views, not copies)."""
    return {
        id(lp): opt.fp32_groups_gradients[i][j].view(lp.shape)
        for i, group in enumerate(opt.bf16_groups)
        for j, lp in enumerate(group)
    }
