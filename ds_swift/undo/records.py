"""What one optimizer step leaves behind for its undo: scalars and references, never copies.

A :class:`StepRecord` holds, per parameter group, the hyper-parameters in force at the
step (lr, betas, eps, weight decay, momentum... after any LR-scheduler change that
preceded it), and per updated parameter a reference to the gradient the optimizer used
(``g_t`` stays where it is: in ``.grad`` or in DeepSpeed's flat fp32 partition), the
tensor version counters seen right after the step (so a later overwrite is detected
instead of silently producing a wrong undo), the state keys the step created (undo drops
them: a first step is undone exactly), and rule-specific scalars (LAMB trust ratio).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GroupRecord", "NotInvertibleError", "ParamRecord", "StepRecord", "UndoError"]

# Shared by every refusal, so the recovery runtime (and the user) always learns the way out.
STRATEGY_HINT = (
    "update-undo (which replication and logging recovery rely on) cannot be used with it: "
    'set "swift": {"strategy": "checkpoint"} in the DeepSpeed config, or use an invertible optimizer '
    "(SGD, Adam/AdamW without amsgrad and, on a GPU, without fused=True, Adagrad, RMSprop, LAMB)"
)


class NotInvertibleError(ValueError):
    """The optimizer (or one of its options) has no inverse update; raised at wrap or step time."""


class UndoError(RuntimeError):
    """An undo was asked for that cannot be done (nothing recorded, gradients gone, too old)."""


@dataclass(slots=True)
class ParamRecord:
    """One parameter (or one flat ZeRO partition) updated by the step."""

    param: torch.Tensor
    """The tensor the optimizer updated (strong reference: it is the optimizer's own)."""
    grad_ref: Any
    """The gradient it used: a strong reference when gradients are retained on purpose
    (DeepSpeed frees its flat fp32 gradient right after the step), else a weak reference so
    that a ``zero_grad(set_to_none=True)`` frees memory as it would without ds-swift."""
    grad_version: int
    param_version: int
    grad_mutated: bool
    """The step itself wrote into the gradient (torch's foreach SGD with nesterov adds mu*b
    into ``.grad``): the rule must read what the step left there, not g_t."""
    new_state_keys: frozenset[str]
    """State entries the step created (lazy initialisation): undo deletes them."""
    state_existed: bool
    """Whether ``optimizer.state`` had an entry for the parameter before the step."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Rule-specific scalars, e.g. ``trust_ratio`` (LAMB) or ``param_norm`` (apex LAMB)."""

    def grad(self) -> torch.Tensor | None:
        if isinstance(self.grad_ref, weakref.ref):
            return self.grad_ref()
        return self.grad_ref


@dataclass
class GroupRecord:
    """One parameter group as it was stepped."""

    group: dict[str, Any]
    """The optimizer's own param-group dict (identity: ZeRO steps one group at a time)."""
    hyper: dict[str, Any]
    """Every group entry but ``params``, as it was when the step ran (tensors cloned)."""
    params: list[ParamRecord]
    path: str
    """Which implementation ran: "single", "foreach", "fused" or "capturable"."""
    step_count: float | None = None
    """The optimizer's step counter after this step (first parameter's), when on the CPU."""
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments given to ``step`` (DeepSpeed FusedLamb's ``scale``)."""


@dataclass
class StepRecord:
    """Everything needed to undo one optimizer step (one training iteration)."""

    iteration: int
    optimizer_class: str
    groups: list[GroupRecord] = field(default_factory=list)
    skipped: bool = False
    """The step did not touch parameters (fp16 loss-scale overflow): undo restores counters only."""
    complete: bool = True
    """False when the step raised part-way: ``groups`` lists exactly what was applied."""
    grad_norm: Any = None
    """Global gradient norm the clipping saw (float or 0-dim tensor), when clipping ran."""
    clip_coef: Any = None
    """Factor the gradients were multiplied by before the update (<= 1), when clipping ran.
    The clipped gradient is what the optimizer read and what undo reads: it was clipped in
    place and is kept, so undo never re-applies this factor."""
    loss_scale: float | None = None
    """Dynamic loss scale in force during the step (fp16), before the scaler updated it."""
    lr_scheduler_state: dict[str, Any] | None = None
    engine_state: dict[str, Any] = field(default_factory=dict)
    """Counters of the DeepSpeed engine before the step (set by ``attach_to_engine``)."""
    prev_iteration: int | None = None
    """``last_stepped_iteration`` before this step: what it becomes again after undo."""

    @property
    def touched(self) -> list[torch.Tensor]:
        """The tensors this step updated (parameters or ZeRO partitions)."""
        return [pr.param for g in self.groups for pr in g.params]

    @property
    def lrs(self) -> list[float]:
        return [float(g.hyper["lr"]) for g in self.groups if "lr" in g.hyper]

    def summary(self) -> dict[str, Any]:
        """Plain-data view for logs and the recovery timeline."""
        return {
            "iteration": self.iteration,
            "optimizer": self.optimizer_class,
            "skipped": self.skipped,
            "complete": self.complete,
            "groups": [
                {
                    "lr": float(g.hyper["lr"]) if "lr" in g.hyper else None,
                    "params": len(g.params),
                    "path": g.path,
                    "step": g.step_count,
                }
                for g in self.groups
            ],
            "clip_coef": _scalar(self.clip_coef),
            "loss_scale": self.loss_scale,
        }


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().reshape(-1)[0].item())
    return float(x)
