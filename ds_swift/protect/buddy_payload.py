"""What one buddy round copies of a rank (ds_swift.protect.buddy): the payload, and its size.

The optimizer partition as its wrapper holds it (fp32 masters, the inner optimizer's state, loss
scaler, flags: ds_swift.patches.deepspeed_optim_state), the LR scheduler, the engine's counters and
the module's non-parameter buffers, as a tensor-only payload (JSON manifest + tensors,
ds_swift.recovery.state.transfer.encode).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.patches.deepspeed_optim_state import capture_optimizer, optimizer_payload
from ds_swift.recovery.state.transfer import counters_of, encode

__all__ = ["persistent_buffers", "round_bytes", "state_payload"]


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


# ---------------------------------------------------------------- the module's non-parameter state
# A module's non-parameter state, as ``state_dict`` gives it, without ``state_dict``'s walk per step.
#
# The buddy copier hands the module's persistent buffers over after every optimizer step, on the
# training thread (ds_swift.protect.buddy.state_payload). ``module.state_dict()`` gets them by walking
# every submodule and building an entry for every parameter too, which the copy then drops: 1.3 ms of
# Python for a 24-layer transformer on this CPU, every step, on the thread that launches the next
# step's kernels (a GPU step is ~100 ms; the protection budget 2 %).
#
# :func:`persistent_buffers` finds where each persistent buffer lives once per module, then reads the
# buffers from there: a look per submodule (was one added, or a buffer registered since?) and one per
# buffer. A module that changes what ``state_dict`` says (a state-dict hook, ``get_extra_state`` or its
# own ``_save_to_state_dict``: TransformerEngine's fp8 layers, for one) is read by ``state_dict``
# itself, every step, as before.


_Dicts = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class _Layout:
    """Where a module's persistent buffers live, and what that was read from. It holds the
    submodules' own dicts, never a module: a layout must not keep its module alive (the cache is
    keyed weakly by it, and an engine rebuilt after a failure drops the old one)."""

    dicts: tuple[_Dicts, ...]
    """(``_buffers``, ``_parameters``, ``_modules``) of every submodule (the module's own first)."""
    shape: tuple[tuple[int, ...], ...]
    """Their lengths when read: another length means the layout is stale (a buffer registered, a
    submodule added since)."""
    where: tuple[tuple[str, dict[str, Any], str], ...]
    """(state_dict key, the dict that holds it, the name there) of each entry: a persistent buffer
    (``_buffers``) or a parameter seen again under another name (``_parameters``: state_dict keeps
    both names, ``named_parameters`` one, and the payload always took what state_dict held beyond it)."""


#: each module's layout; None where ``state_dict`` must be asked (see the module docstring)
_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, _Layout | None] = weakref.WeakKeyDictionary()
#: each module's parameter names (``named_parameters``: a shared one once), for the ``state_dict`` path
_PARAMS: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``module.state_dict()`` holds besides ``module.named_parameters()`` (persistent buffers,
    and a shared parameter's other names), keyed and ordered as there, detached."""
    if module in _LAYOUTS:
        layout = _LAYOUTS[module]
        if layout is not None and _stale(layout):
            layout = _LAYOUTS[module] = _read_layout(module)
    else:
        layout = _LAYOUTS[module] = _read_layout(module)
    if layout is None:
        return {k: v for k, v in module.state_dict().items() if k not in _param_names(module)}
    out = {}
    for key, held, name in layout.where:
        t = held.get(name)
        if t is not None:  # an entry set to None is left out by state_dict too
            out[key] = t.detach()
    return out


def _param_names(module: torch.nn.Module) -> frozenset[str]:
    names = _PARAMS.get(module)
    if names is None:  # a module's parameters are fixed once its optimizer holds them
        names = _PARAMS[module] = frozenset(n for n, _ in module.named_parameters())
    return names


def _stale(layout: _Layout) -> bool:
    return any(tuple(map(len, d)) != shape for d, shape in zip(layout.dicts, layout.shape, strict=True))


def _read_layout(module: torch.nn.Module) -> _Layout | None:
    base = torch.nn.Module
    params = frozenset(n for n, _ in module.named_parameters())
    dicts: list[_Dicts] = []
    where: list[tuple[str, dict[str, Any], str]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        kind = type(sub)
        if (
            kind._save_to_state_dict is not base._save_to_state_dict
            or kind.get_extra_state is not base.get_extra_state
            or sub._state_dict_hooks
            or sub._state_dict_pre_hooks
        ):
            return None
        dicts.append((sub._buffers, sub._parameters, sub._modules))
        dot = prefix + "." if prefix else ""
        # state_dict's order: a submodule's parameters, then its buffers
        where += [(dot + a, sub._parameters, a) for a in sub._parameters if dot + a not in params]
        where += [(dot + a, sub._buffers, a) for a in sub._buffers if a not in sub._non_persistent_buffers_set]
    return _Layout(tuple(dicts), tuple(tuple(map(len, d)) for d in dicts), tuple(where))
