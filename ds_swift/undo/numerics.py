"""Floating-point helpers for the inverse updates, and the error measures the tests report.

Why the inverse is computed the way it is:

* A forward update ``x1 = fl(x0 - u)`` loses at most half an ulp of ``x1``. Solving for
  ``x0`` in the tensor's own precision adds a second rounding; solving it in float64 and
  rounding once gives back ``x0`` exactly unless the forward rounding itself merged two
  neighbours (only possible when ``x1`` left ``x0``'s binade). So every inverse is
  evaluated in float64 from the stored (rounded) inputs.
* Where the forward arithmetic can be replayed op for op (same torch calls on the same
  dtype), :func:`refine` checks the float64 answer and its neighbours against the forward
  and keeps the one that reproduces the post-step value bit for bit. For parameters and
  second moments this makes undo exact for almost every element; what remains is the
  information the forward destroyed (many pre-images map to one result).

Two refinements give the same answer element for element: :func:`refine` (the reference) replays
the forward on every element once and searches the neighbours of the few that miss, gathering them
with ``nonzero`` (a host sync, and a dozen small launches, per slice); :func:`refine_dense` replays
the forward on the candidate and on all ``2*radius`` neighbours of every element and picks with
``torch.where``: a fixed number of elementwise kernels and no host sync, which is what a GPU wants.
Which one :func:`ds_swift.undo.rules_torch.solve` uses is set by the undo driver (``REFINE``; see
:mod:`ds_swift.undo.apply`: dense on a GPU, gathering on a CPU, where it is cheaper and syncs nothing).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal

import torch

__all__ = [
    "REFINE",
    "WORK_DTYPE",
    "Replay",
    "chunk_slices",
    "elementwise_rel_error",
    "refine",
    "refine_dense",
    "refine_monotone",
    "ulp_error",
    "w",
]

WORK_DTYPE = torch.float64
# Undo handles one tensor at a time in slices of this many elements, so its float64
# temporaries (about a dozen slices: 2 MB each) stay small even for a multi-GB flat ZeRO
# partition.
CHUNK_ELEMENTS = 1 << 18

RefineMode = Literal["dense", "gather"]
# Set by the undo driver around a rule call (the rules reach refinement through solve(), several
# calls deep; threading the mode through every signature would only add noise).
REFINE: ContextVar[RefineMode] = ContextVar("ds_swift_undo_refine", default="dense")


def f32(x: Any) -> float:
    """``x`` (a number, or a one-element tensor) rounded to a C ``float``: what a CUDA kernel taking
    ``float`` arguments computes with."""
    try:
        return float(struct.unpack("f", struct.pack("f", float(x)))[0])
    except OverflowError:  # beyond float's range: what a cast to float gives
        return math.copysign(math.inf, float(x))


def w(t: torch.Tensor) -> torch.Tensor:
    """The tensor in the work precision (float64)."""
    return t.to(WORK_DTYPE)


def chunk_slices(numel: int, chunk: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    for start in range(0, numel, chunk):
        yield slice(start, min(numel, start + chunk))


class Replay:
    """``fn(x, *tensors)``, evaluable on a subset of elements: ``tensors`` are the elementwise
    operands the forward reads besides x (anything with x's number of elements is indexed
    along with x; 0-dim tensors are passed whole)."""

    def __init__(self, fn: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...]) -> None:
        self.fn = fn
        self.tensors = tensors

    def __call__(self, x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
        n = x.numel() if index is None else None
        args = []
        for t in self.tensors:
            if t.dim() == 0:
                args.append(t)
            elif index is None:
                assert t.numel() == n
                args.append(t.reshape(-1))
            else:
                args.append(t.reshape(-1)[index])
        return self.fn(x, *args)


def refine(
    candidate: torch.Tensor,
    target: torch.Tensor,
    forward: Replay,
    estimate: torch.Tensor | None = None,
    radius: int = 2,
) -> torch.Tensor:
    """Among ``candidate`` and its ``radius`` neighbours each side, per element, prefer the
    nearest value that ``forward`` maps exactly onto ``target``, trying first the side of the
    unrounded ``estimate``; keep ``candidate`` where none does (the forward replica then
    differs from the kernel that ran, or the rounding merged more pre-images than we search;
    several pre-images are equally valid answers, the nearest to the estimate is chosen).
    Only the elements whose candidate fails are searched (a few percent for parameters)."""
    flat = candidate.reshape(-1)
    target_flat = target.reshape(-1)
    miss = (forward(flat) != target_flat).nonzero().squeeze(1)
    if miss.numel() == 0:
        return candidate
    cand = flat[miss]
    goal = target_flat[miss]
    best = cand
    ok = torch.zeros_like(cand, dtype=torch.bool)
    if estimate is None:
        toward = torch.full_like(cand, math.inf)
    else:
        up = estimate.reshape(-1)[miss] > cand.to(estimate.dtype)
        toward = torch.where(up, math.inf, -math.inf).to(cand.dtype)
    near = far = cand
    for _ in range(radius):
        near = torch.nextafter(near, toward)
        far = torch.nextafter(far, -toward)
        for c in (near, far):
            hit = (~ok) & (forward(c, miss) == goal)
            best = torch.where(hit, c, best)
            ok = ok | hit
        if bool(ok.all()):
            break
    out = flat.clone()
    out[miss] = best
    return out.view_as(candidate)


def refine_dense(
    candidate: torch.Tensor,
    target: torch.Tensor,
    forward: Replay,
    estimate: torch.Tensor | None = None,
    radius: int = 2,
) -> torch.Tensor:
    """:func:`refine` without a host sync: the forward is replayed on the candidate and on each of
    its ``2*radius`` neighbours for every element, and the first that maps onto ``target`` in
    refine's order (candidate, then nearest first, the estimate's side first) wins. Same answer as
    refine element for element, for a fixed ``1 + 2*radius`` forward replays of the whole slice."""
    flat = candidate.reshape(-1)
    goal = target.reshape(-1)
    if estimate is None:
        toward = torch.full_like(flat, math.inf)
    else:
        up = estimate.reshape(-1) > flat.to(estimate.dtype)
        toward = torch.where(up, math.inf, -math.inf).to(flat.dtype)
    order = [flat]  # refine's order of preference
    near = far = flat
    away = toward.neg()
    for _ in range(radius):
        near = torch.nextafter(near, toward)
        far = torch.nextafter(far, away)
        order += [near, far]
    # Least preferred first: each hit overrides what the ones after it chose. The candidate itself
    # is also the answer where nothing hits, so it needs no check.
    best = flat
    for c in reversed(order[1:]):
        best = torch.where(forward(c) == goal, c, best)
    return torch.where(forward(flat) == goal, flat, best).view_as(candidate)


def refine_monotone(candidate: torch.Tensor, target: torch.Tensor, forward: Replay, radius: int = 2) -> torch.Tensor:
    """:func:`refine_dense` for a forward that is non-decreasing in x (each of its roundings is
    monotone: x scaled by a positive constant, then a fused or rounded add of terms not depending on
    x). Then every pre-image of ``target`` lies on the side where ``forward(candidate)`` falls short,
    and refine's nearest-first search reduces to stepping that way: ``1 + radius`` replays instead of
    ``1 + 2*radius``, with the same answer."""
    flat = candidate.reshape(-1)
    goal = target.reshape(-1)
    at = forward(flat)
    toward = torch.where(at < goal, math.inf, -math.inf).to(flat.dtype)
    steps = []
    c = flat
    for _ in range(radius):
        c = torch.nextafter(c, toward)
        steps.append(c)
    best = flat
    for c in reversed(steps):
        best = torch.where(forward(c) == goal, c, best)
    return torch.where(at == goal, flat, best).view_as(candidate)


# ---- error measures (tests, benchmark, issue note) -------------------------------------


def ulp_of(magnitude: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` values at ``magnitude`` (its unit in the last place)."""
    m = torch.tensor(abs(magnitude), dtype=dtype)
    nxt = torch.nextafter(m, torch.tensor(math.inf, dtype=dtype))
    return float(nxt.double() - m.double())


def ulp_error(restored: torch.Tensor, original: torch.Tensor, post: torch.Tensor | None = None) -> float:
    """max |restored - original| in units of the last place of the tensor's largest
    magnitude (the acceptance measure: <= 2). With ``post`` (the same tensor after the step
    that was undone) the magnitude is the larger of the two: a step that grows a state
    tensor (early Adam steps double v) rounds it at the larger scale, and that rounding is
    information the step destroyed, not error added by the undo."""
    if original.numel() == 0:
        return 0.0
    diff = (w(restored) - w(original)).abs().max().item()
    if diff == 0:
        return 0.0
    scale = w(original).abs().max().item()
    if post is not None and post.numel():
        scale = max(scale, w(post).abs().max().item())
    return diff / ulp_of(scale, original.dtype)


def elementwise_rel_error(restored: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """|restored - original| / |original| per element (0 where both are 0, inf where only
    the original is 0): large where an element cancelled to nearly nothing."""
    a, b = w(restored), w(original)
    diff = (a - b).abs()
    rel = diff / b.abs()
    return torch.where(diff == 0, torch.zeros_like(rel), rel)
