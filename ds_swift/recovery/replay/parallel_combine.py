"""How the two copies of a replayed stage combine their gradients (parallel recovery, pure torch).

Each copy replays a share of an iteration's micro-batches (ds_swift.recovery.replay.parallel); before the
optimizer step both need the gradient the sequential run accumulated. :class:`GradCapture` records
what every backward call adds to every parameter (a tensor hook), per micro-batch; then

- :func:`combine_exact` re-does AccumulateGrad's sum in the parameter's dtype, in micro-batch and
  call order: the gradient where it lives in ``param.grad`` (fp32 ZeRO-0, fp16, ZeRO-1 stage 1);
- :func:`combine_exact_hp` re-does a BF16_Optimizer's fp32 accumulation (bf16 with ZeRO-0 or
  ZeRO-1): per micro-batch the bf16 sum of its backward calls (what ``param.grad`` held after the
  micro-batch, zeroed before it), cast to fp32 and added to a zeroed fp32 buffer in micro-batch
  order; or, with ``immediate_grad_update``, every call's gradient added at once;
- :func:`combine_fast` adds the copies' partial sums (not bitwise: another association).

The same additions in the same order as the sequential run, so bitwise equal to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

__all__ = ["Contribution", "GradCapture", "combine_exact", "combine_exact_hp", "combine_fast"]

#: per parameter, the gradients the backward calls of one micro-batch added, in call order
Contribution = list[list[torch.Tensor]]


def combine_exact(contributions: Mapping[int, Contribution], num_params: int) -> list[torch.Tensor | None]:
    """Sum every micro-batch's per-call gradients in micro-batch then call order, as AccumulateGrad did.

    ``contributions[m][i]`` lists what the backward calls of micro-batch ``m`` added to parameter
    ``i``. The first one becomes the gradient, each later one is added to it in place: the same
    floating-point additions, in the same order, as sequential accumulation.
    """
    grads: list[torch.Tensor | None] = [None] * num_params
    for m in sorted(contributions):
        per_param = contributions[m]
        if len(per_param) != num_params:
            raise ValueError(f"micro-batch {m} has contributions for {len(per_param)} parameters, not {num_params}")
        for i, calls in enumerate(per_param):
            for c in calls:
                g = grads[i]
                if g is None:
                    grads[i] = c.clone()
                else:
                    g.add_(c)
    return grads


def combine_exact_hp(
    contributions: Mapping[int, Contribution],
    num_params: int,
    per_call: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor | None]:
    """A BF16_Optimizer's fp32 gradient buffers after the micro-batches of ``contributions``.

    The buffer starts at zero (the step before cleared it). Per micro-batch in order, the pipeline
    engine zeroes ``param.grad``, the backward calls add to it (in bf16, by AccumulateGrad), and
    ``update_hp_grads`` adds it, cast, to the buffer; with ``per_call`` (``immediate_grad_update``)
    each call's gradient is added to the buffer as it comes. A micro-batch that did not reach a
    parameter adds nothing (zero) to it; a parameter no micro-batch reached gets None.
    """
    grads: list[torch.Tensor | None] = [None] * num_params
    for m in sorted(contributions):
        per_param = contributions[m]
        if len(per_param) != num_params:
            raise ValueError(f"micro-batch {m} has contributions for {len(per_param)} parameters, not {num_params}")
        for i, calls in enumerate(per_param):
            if not calls:
                continue
            if per_call:
                addends = list(calls)
            else:
                low = torch.zeros_like(calls[0])  # param.grad after clear_lp_grads
                for c in calls:
                    low.add_(c)
                addends = [low]
            acc = grads[i]
            if acc is None:
                acc = grads[i] = torch.zeros(calls[0].shape, dtype=dtype, device=calls[0].device)
            for a in addends:
                acc.add_(a.to(dtype))
    return grads


def combine_fast(partials: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """Sum the sub-pipelines' accumulated gradients in sub-pipeline order (what an all-reduce of them gives)."""
    out: list[torch.Tensor | None] = []
    for per_param in zip(*partials):
        acc: torch.Tensor | None = None
        for g in per_param:
            if g is not None:
                acc = g.clone() if acc is None else acc + g
        out.append(acc)
    return out


class GradCapture:
    """Records what every backward call adds to every parameter's gradient, per micro-batch.

    A tensor hook on a leaf sees the gradient AccumulateGrad is about to add (after any hook
    registered before it), once per backward call: exactly the addends of sequential accumulation.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.current: int | None = None
        self.contribs: dict[int, Contribution] = {}
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.current is None:
                raise RuntimeError("a parameter gradient outside a captured micro-batch")
            # Cloned: AccumulateGrad may adopt this very tensor as .grad and add to it in place later.
            self.contribs[self.current][i].append(grad.detach().clone())

        return hook

    @contextmanager
    def micro_batch(self, m: int) -> Iterator[None]:
        """Attribute the backward calls made inside the block to micro-batch ``m``."""
        self.current = m
        self.contribs.setdefault(m, [[] for _ in self.params])
        try:
            yield
        finally:
            self.current = None

    def take(self) -> dict[int, Contribution]:
        out, self.contribs = self.contribs, {}
        return out

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()
