"""Inverse-update rules: one small class per optimizer family, found by optimizer class.

A rule knows (a) whether an optimizer configuration is invertible, (b) which tensors a
step reads (usually ``p.grad`` of every parameter that has one), (c) any scalar it must
capture at step time that the post-step state does not determine (LAMB's trust ratio),
and (d) how to compute the pre-step parameter and state from the post-step ones. The
driver (:mod:`ds_swift.undo.optimizer`) handles records, chunking, validation and the
state entries a step created.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_swift.undo.records import STRATEGY_HINT, GroupRecord, NotInvertibleError, ParamRecord

__all__ = ["UndoContext", "UndoRule"]  # which rule for which optimizer: ds_swift.undo.rule_registry


@dataclass
class UndoContext:
    """One parameter (or one slice of it) to undo. Tensors are views: writes land in place."""

    param: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]
    hyper: dict[str, Any]
    step: float | None
    """The step counter after the step being undone (None when the optimizer keeps none)."""
    new_keys: frozenset[str]
    extra: dict[str, Any]
    exact: bool
    """Whether the forward may be replayed op for op to refine the inverse (see numerics)."""
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    grad_mutated: bool = False
    """The step wrote into ``grad`` (see ParamRecord.grad_mutated)."""

    @property
    def first_step(self) -> bool:
        return bool(self.new_keys)


class UndoRule(ABC):
    """Inverse of one optimizer family's update."""

    name: str = "?"
    # Optimizer-level flags/group keys that make the update non-invertible, with the reason.
    refused_flags: dict[str, str] = {}
    mutates_grad_ok = False
    """Whether undo_param knows what a step that wrote into the gradient left there."""

    def check_group(self, group: dict[str, Any]) -> None:
        """Raise NotInvertibleError for a configuration the rule cannot invert."""
        for key, why in self.refused_flags.items():
            if group.get(key):
                raise NotInvertibleError(f"{self.name}({key}=True) is not invertible: {why}; {STRATEGY_HINT}.")
        if group.get("differentiable"):
            raise NotInvertibleError(
                f"{self.name}(differentiable=True) is not supported: the update is part of an autograd "
                f"graph; {STRATEGY_HINT}."
            )

    def check_optimizer(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            self.check_group(group)

    def path(self, group: dict[str, Any]) -> str:
        """Which implementation ran ("single", "foreach", "fused", "capturable")."""
        if group.get("fused"):
            return "fused"
        if group.get("capturable"):
            return "capturable"
        return "foreach" if group.get("foreach") else "single"

    def select(
        self, optimizer: Any, group: dict[str, Any], call_kwargs: dict[str, Any], group_index: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, gradient) pairs the step will update: torch's own rule is "has a grad"."""
        return [(p, p.grad) for p in group["params"] if p.grad is not None]

    def post_step(self, optimizer: Any, groups: list[GroupRecord], call_kwargs: dict[str, Any]) -> None:
        """Capture what the step computed and the state does not keep (per ParamRecord.extra)."""
        return None

    @abstractmethod
    def undo_param(self, ctx: UndoContext) -> None:
        """Restore ``ctx.param`` and the state tensors that existed before the step, in place."""

    def undo_counters(self, state: dict[str, Any], pr: ParamRecord) -> None:
        """Step counters are per parameter; they are not sliced, so they are undone once here."""
        if "step" in state and "step" not in pr.new_state_keys:
            step = state["step"]
            if isinstance(step, torch.Tensor):
                step.sub_(1)
            else:
                state["step"] = step - 1


def is_plain_number(*values: Any) -> bool:
    """Forward replay is only attempted with Python-number hyper-parameters (a tensor lr is
    rounded to its dtype inside torch's step, which the replay would have to mimic)."""
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
