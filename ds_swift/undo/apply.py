"""Carrying out an undo: which tensors a rule sees at once, and how its refinement runs.

Two paths (``InvertibleOptimizer(undo_path=...)``), equal element for element where the forward
replay is deterministic (tests/unit/test_undo_fast_path.py):

* ``"reference"``: one tensor at a time, in slices of ``numerics.CHUNK_ELEMENTS`` (2^18), refined
  by ``numerics.refine``, which gathers the elements whose candidate misses (a host sync and a dozen
  small launches per slice). On a GPU, 256M AdamW elements took 3.5 s this way: 12,928 launches
  and 296 ms of CPU per 16M elements for 29 ms of GPU work.
* ``"fast"`` (the default off CUDA): slices of 2^24 elements on a GPU (each float64 temporary 128 MB: few
  launches per element), 2^18 on a CPU (2 MB: the slice's temporaries stay in cache, measured
  faster there than 2^22); both multiples of any vector width, so a slice's elements meet the
  vectorised or scalar code of a CPU kernel as in the step. On a GPU
  (any non-CPU device) refined by ``numerics.refine_dense``: a fixed number of elementwise kernels,
  no host sync. On a CPU by ``numerics.refine``, which is cheaper there (it replays the forward on
  the misses only, and a CPU tensor's ``nonzero`` waits for nothing); ``FAST_REFINE`` forces one.
  Tensors smaller than a slice that the rule treats alike (same dtype, device, step count, created
  state entries and recorded scalars) are packed into one flat tensor per operand, undone by one
  rule call and copied back with ``torch._foreach_copy_``: a model's hundreds of biases and norms
  cost a few launches, not a few per tensor.

What the dense path costs a GPU, counted on a CPU (a dispatch mode summing each op's operand and
result bytes, torch AdamW): 91 ops and 996 bytes moved per undone fp32 element (the undo's own
bytes are 28): for 256M elements about 1,400 launches (16 slices) and, at an H100's 2.98 TB/s,
about 90 ms, some 11x the 8.4 ms foreach step measured there. So the issue's goal (undo <= 3x a
step, <= 10x the 2.5 ms bound) needs one fused kernel doing inverse and replays in registers; this
path is what such a kernel must agree with, and what runs where none is built.

* ``"fused"`` (``"auto"``, the default: fused for CUDA tensors when Triton imports, else fast): the
  fast path's packing of tiny tensors, with torch's Adam/AdamW and DeepSpeed's FusedAdam undone by
  one Triton kernel per rule call (ds_swift.undo.fused); what a kernel does not model falls back to
  the fast path's rule.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ds_swift.undo.numerics import CHUNK_ELEMENTS, REFINE, RefineMode, chunk_slices
from ds_swift.undo.records import GroupRecord, ParamRecord
from ds_swift.undo.rules import UndoContext, UndoRule

__all__ = ["FAST_CHUNK_CPU", "FAST_CHUNK_CUDA", "FAST_REFINE", "UNDO_PATHS", "UndoPath", "undo_group"]

UndoPath = Literal["fast", "reference", "fused", "auto"]
UNDO_PATHS = ("fast", "reference", "fused", "auto")
FAST_CHUNK_CUDA = 1 << 24
FAST_CHUNK_CPU = 1 << 18
FUSED_PACK = 1 << 18
"""The fused path packs tensors under a quarter of this many elements into runs of about this many."""
FAST_REFINE: RefineMode | None = None
"""The fast path's refinement; None: dense on a GPU, gathering on a CPU (tests force each)."""


def _step_value(step: Any) -> float | None:
    if step is None:
        return None
    if isinstance(step, torch.Tensor):
        return float(step.item())  # once per tensor (a fused/capturable step lives on the device)
    return float(step)


@dataclass
class _Item:
    """One updated tensor, as the rule will see it."""

    pr: ParamRecord
    grad: torch.Tensor
    state: dict[str, Any]
    step: float | None
    shaped: tuple[str, ...]
    """State entries shaped like the parameter (sliced and packed with it)."""

    @property
    def sliceable(self) -> bool:
        p = self.pr.param
        return (
            p.is_contiguous()
            and self.grad.is_contiguous()
            and self.grad.shape == p.shape
            and all(self.state[k].is_contiguous() for k in self.shaped)
        )


def _item(opt: Any, pr: ParamRecord) -> _Item:
    p = pr.param
    grad = pr.grad()
    assert grad is not None  # validated by the caller
    state: dict[str, Any] = opt.state[p] if p in opt.state else {}
    shaped = tuple(sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape))
    return _Item(pr, grad, state, _step_value(state.get("step")), shaped)


def _ctx(
    item: _Item, grec: GroupRecord, exact: bool, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]
) -> UndoContext:
    pr = item.pr
    return UndoContext(
        param=param,
        grad=grad,
        state=state,
        hyper=grec.hyper,
        step=item.step,
        new_keys=pr.new_state_keys,
        extra=pr.extra,
        grad_mutated=pr.grad_mutated,
        exact=exact,
        call_kwargs=grec.call_kwargs,
    )


def _undo_sliced(rule: UndoRule, item: _Item, grec: GroupRecord, exact: bool, chunk: int) -> None:
    p = item.pr.param
    slices = list(chunk_slices(p.numel(), chunk)) if item.sliceable and p.numel() > 0 else [slice(None)]
    for sl in slices:
        if sl == slice(None) or (sl.start == 0 and sl.stop == p.numel()):
            rule.undo_param(_ctx(item, grec, exact, p, item.grad, item.state))
            continue
        sub = {k: (v.view(-1)[sl] if k in item.shaped else v) for k, v in item.state.items()}
        rule.undo_param(_ctx(item, grec, exact, p.view(-1)[sl], item.grad.reshape(-1)[sl], sub))


def _scalar_key(value: Any) -> Hashable | None:
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return None


def _pack_key(item: _Item) -> Hashable | None:
    """Items with equal keys go through the rule's arithmetic identically; None: never packed."""
    p, pr = item.pr.param, item.pr
    if item.grad.shape != p.shape or item.grad.dtype != p.dtype:
        return None
    if p.device.type == "cpu" and p.dtype not in (torch.float32, torch.float64):
        # torch's CPU kernels round bf16/fp16 differently in their vectorised body and their
        # scalar tail (each op of the tail rounds to the dtype): a tensor packed at another offset
        # would be replayed unlike the step that ran. (CUDA kernels round every element alike.)
        return None
    others = set(item.state) - set(item.shaped) - {"step"}
    if others:
        return None  # a per-tensor state value the rule may read: keep the tensor on its own
    extra = []
    for k in sorted(pr.extra):
        if k == "step_carrier":
            continue  # read by undo_counters only, per tensor
        v = _scalar_key(pr.extra[k])
        if v is None and pr.extra[k] is not None:
            return None  # a per-tensor tensor (LAMB's trust ratio): not packable
        extra.append((k, v))
    dtypes = tuple((k, item.state[k].dtype) for k in item.shaped)
    return (p.device, p.dtype, item.step, pr.new_state_keys, pr.grad_mutated, dtypes, tuple(extra))


def _undo_packed(rule: UndoRule, items: list[_Item], grec: GroupRecord, exact: bool) -> None:
    """One rule call over the concatenation of ``items`` (see the module docstring)."""
    first = items[0]
    param = torch.cat([it.pr.param.detach().reshape(-1) for it in items])
    grad = torch.cat([it.grad.reshape(-1) for it in items])
    state: dict[str, Any] = {k: v for k, v in first.state.items() if k not in first.shaped}
    for k in first.shaped:
        state[k] = torch.cat([it.state[k].reshape(-1) for it in items])
    rule.undo_param(_ctx(first, grec, exact, param, grad, state))
    sizes = [it.pr.param.numel() for it in items]
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for name, flat in [("", param), *((k, state[k]) for k in first.shaped if k not in first.pr.new_state_keys)]:
        for it, part in zip(items, flat.split(sizes), strict=True):
            target = it.pr.param.detach() if not name else it.state[name]
            targets.append(target)
            sources.append(part.view(target.shape))
    torch._foreach_copy_(targets, sources)


def _packs(items: list[_Item], chunk: int) -> Iterator[list[_Item]]:
    """Runs of small items (under a quarter of ``chunk`` elements) with the same pack key, each up to
    about ``chunk`` elements."""
    open_packs: dict[Hashable, tuple[list[_Item], int]] = {}
    for it in items:
        key = _pack_key(it)
        n = it.pr.param.numel()
        if key is None or n >= chunk // 4:
            yield [it]
            continue
        members, total = open_packs.get(key, ([], 0))
        members.append(it)
        total += n
        if total >= chunk:
            yield members
            open_packs.pop(key, None)
        else:
            open_packs[key] = (members, total)
    yield from (members for members, _ in open_packs.values())


def undo_group(rule: UndoRule, opt: Any, grec: GroupRecord, *, exact: bool, path: UndoPath) -> None:
    """Restore every tensor ``grec`` recorded, its state, counters and created state entries."""
    items = [_item(opt, pr) for pr in grec.params]
    token = REFINE.set("gather" if path == "reference" else _fast_refine(items))
    chunk: int | None = None
    if path in ("fused", "auto"):
        from ds_swift.undo import fused

        if fused.use_fused(rule, path, {it.pr.param.device.type for it in items}):
            rule, chunk = fused.fused_rule(rule), fused.FUSED_CHUNK
    try:
        if path == "reference":
            for it in items:
                _undo_sliced(rule, it, grec, exact, CHUNK_ELEMENTS)
        else:
            # The fused path packs only tiny tensors (their launch costs more than copying them) and
            # slices only above FUSED_CHUNK: a large tensor is one launch, never copied.
            for pack in _packs(items, chunk=FUSED_PACK if chunk else _fast_chunk(items)):
                if len(pack) == 1:
                    _undo_sliced(rule, pack[0], grec, exact, chunk or _fast_chunk(pack))
                else:
                    _undo_packed(rule, pack, grec, exact)
    finally:
        REFINE.reset(token)
    for it in items:
        p, pr, state = it.pr.param, it.pr, it.state
        rule.undo_counters(state, pr)
        for key in pr.new_state_keys:
            state.pop(key, None)
        if not pr.state_existed and p in opt.state and not opt.state[p]:
            del opt.state[p]


def _fast_chunk(items: list[_Item]) -> int:
    on_gpu = any(it.pr.param.device.type == "cuda" for it in items)
    return FAST_CHUNK_CUDA if on_gpu else FAST_CHUNK_CPU


def _fast_refine(items: list[_Item]) -> RefineMode:
    if FAST_REFINE is not None:
        return FAST_REFINE
    return "dense" if any(it.pr.param.device.type != "cpu" for it in items) else "gather"
