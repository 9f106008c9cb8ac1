"""Which undo rule inverts an optimizer's step: the registry of known optimizer classes.

Apart from :mod:`ds_swift.undo.rules` (the rule interface) so that the rule modules, which
import the interface, are not imported back by it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from ds_swift.undo import rules_deepspeed, rules_lamb, rules_torch
from ds_swift.undo.records import STRATEGY_HINT, NotInvertibleError
from ds_swift.undo.rules import UndoRule

__all__ = ["rule_for"]


def _unwrap(fn: Any) -> Any:
    return inspect.unwrap(fn) if callable(fn) else fn


def _step_is_base(cls: type, base: type) -> bool:
    """True if ``cls`` runs ``base``'s step arithmetic (torch re-wraps ``step`` per class for
    profiling hooks, so compare the unwrapped functions, not the attributes)."""
    return _unwrap(getattr(cls, "step", None)) is _unwrap(getattr(base, "step", None))


def _known_classes() -> list[tuple[type, Callable[[], UndoRule]]]:
    known: list[tuple[type, Callable[[], UndoRule]]] = [
        (torch.optim.SGD, rules_torch.SGDRule),
        (torch.optim.AdamW, rules_torch.AdamRule),
        (torch.optim.Adam, rules_torch.AdamRule),
        (torch.optim.Adagrad, rules_torch.AdagradRule),
        (torch.optim.RMSprop, rules_torch.RMSpropRule),
        (rules_lamb.lamb_class(), rules_lamb.LambRule),
    ]
    # Optional back-ends are looked up only if already imported: an optimizer instance of
    # theirs cannot exist otherwise, and importing deepspeed/apex here would cost seconds.
    ds_lamb = sys.modules.get("deepspeed.ops.lamb.fused_lamb")
    if ds_lamb is not None and hasattr(ds_lamb, "FusedLamb"):
        known.append((ds_lamb.FusedLamb, rules_lamb.DeepSpeedFusedLambRule))
    ds_adam = sys.modules.get("deepspeed.ops.adam.fused_adam")
    if ds_adam is not None and hasattr(ds_adam, "FusedAdam"):
        known.append((ds_adam.FusedAdam, rules_deepspeed.DeepSpeedFusedAdamRule))
    return known


def _apex_refusal(optimizer: Any) -> str | None:
    apex_opt = sys.modules.get("apex.optimizers")
    cls = getattr(apex_opt, "FusedLAMB", None) if apex_opt is not None else None
    if cls is not None and isinstance(optimizer, cls):
        return (
            "apex.optimizers.FusedLAMB is not invertible without an extra gradient copy: its "
            "multi_tensor_lamb kernel overwrites each .grad with the update (stage 1) before applying "
            "it, so g_t is gone after the step and m_{t-1}, v_{t-1} cannot be solved for. Use "
            "ds_swift.undo.Lamb or deepspeed.ops.lamb.FusedLamb (which keep the gradient)"
        )
    return None


def rule_for(optimizer: Any) -> UndoRule:
    """The rule for ``optimizer``, or NotInvertibleError saying why not and what to do."""
    apex_reason = _apex_refusal(optimizer)
    if apex_reason is not None:
        raise NotInvertibleError(f"{apex_reason}; {STRATEGY_HINT}.")
    cls = type(optimizer)
    for base, make in _known_classes():
        if isinstance(optimizer, base):
            if not _step_is_base(cls, base):
                raise NotInvertibleError(
                    f"{cls.__module__}.{cls.__qualname__} overrides {base.__name__}.step, so its update is "
                    f"unknown to ds-swift; {STRATEGY_HINT}."
                )
            rule = make()
            rule.check_optimizer(optimizer)
            return rule
    raise NotInvertibleError(
        f"no inverse update is known for optimizer class {cls.__module__}.{cls.__qualname__}; {STRATEGY_HINT}."
    )
