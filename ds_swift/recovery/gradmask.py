"""One iteration's gradients scaled on this rank: lossy forward recovery and its failure simulation.

Nicolae et al. (shared/papers/nicolae-*.txt, III-B and III-C): lossy forward recovery finishes the
failed mini-batch averaging only the surviving replicas' gradients. DeepSpeed averages gradients
over every data-parallel rank (a sum divided by the data-parallel size), so the same average comes
out when each casualty replica's ranks contribute zero and each survivor's ranks scale their local
gradients by ``dp / survivors``, the paper's own way of simulating it ("every worker divides its
local gradients by the number of survivors ... the casualties' gradients remain zero").

The scaling is a tensor hook on every trainable parameter of the rank's pipeline stage, installed
for the one iteration and removed after it: it multiplies each gradient contribution before it is
accumulated, whatever optimizer wrapper (bf16, fp16 with loss scaling, ZeRO-1) reduces it next.
Gradient clipping then sees the norm of the survivors' average, as it would with fewer replicas.

``upto_layer`` limits it to the pipeline layers at or before that index (the failure simulation's
"from a chosen layer on", in backward order: the layers after it had their gradients reduced before
the simulated failure). DeepSpeed reduces gradients after the whole backward pass, so a real
failure loses the casualties' gradients of every layer: recovery scales them all.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["GradScale", "lossy_factor", "scaled_gradients"]

_LAYER = re.compile(r"^(\d+)\.")


@dataclass(frozen=True)
class GradScale:
    """Scale this rank's gradients of ``iteration`` by ``factor`` (layers at or before ``upto_layer``;
    None: every layer)."""

    iteration: int
    factor: float
    upto_layer: int | None = None


def lossy_factor(dp_id: int, casualties: Collection[int], dp: int) -> float:
    """The multiplier that turns DeepSpeed's average over ``dp`` replicas into the average over the
    replicas not in ``casualties``: 0 on a casualty, ``dp / survivors`` on a survivor."""
    survivors = dp - len(set(casualties))
    if survivors <= 0:
        raise ValueError(f"every one of the {dp} data-parallel replicas is a casualty: no gradient to average")
    return 0.0 if dp_id in casualties else dp / survivors


def _layer_of(name: str) -> int | None:
    """The pipeline layer index of a PipelineModule parameter name (``"3.attn.weight"``); None for
    tied modules (``"tied_modules.embed.weight"``), which count as the lowest layer."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


@contextmanager
def scaled_gradients(module: Any, factor: float, upto_layer: int | None = None) -> Iterator[int]:
    """Within the block, every gradient of ``module``'s trainable parameters (of layers at or before
    ``upto_layer``) is multiplied by ``factor``; yields how many parameters that covers."""
    handles = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        layer = _layer_of(name)
        if upto_layer is not None and layer is not None and layer > upto_layer:
            continue
        handles.append(p.register_hook(lambda g, f=factor: g * f))
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
