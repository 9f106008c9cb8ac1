"""InvertibleOptimizer: run an optimizer's own step, record what its inverse needs, undo it.

The wrapped step is the optimizer's step, unchanged, so training is bit-for-bit the same
with and without ds-swift. Recording reads hyper-parameters and state keys and takes
references (no tensor copies); the only work per step is a Python pass over the
parameters. Only the last step can be undone: that is all crash consistency needs (a
survivor is at most one update ahead of the consensus iteration), and it is all that the
single resident gradient allows.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ds_swift.undo.apply import UNDO_PATHS, UndoPath, undo_group
from ds_swift.undo.records import GroupRecord, NotInvertibleError, ParamRecord, StepRecord, UndoError
from ds_swift.undo.rule_registry import rule_for
from ds_swift.undo.rules import UndoRule

__all__ = ["InvertibleOptimizer"]

_NO_KEYS: frozenset[str] = frozenset()


def _snapshot_hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


def _restore_hyper(group: dict[str, Any], hyper: dict[str, Any]) -> None:
    for k, v in hyper.items():
        cur = group.get(k)
        if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
            cur.copy_(v)  # keep the tensor object: a scheduler or the step may hold it
        else:
            group[k] = v


def _step_value(step: Any) -> float | None:
    if step is None:
        return None
    if isinstance(step, torch.Tensor):
        return float(step.item())
    return float(step)


class InvertibleOptimizer:
    """Wraps a torch optimizer so that its last step can be undone.

    Args:
        optimizer: the optimizer to wrap (SGD, Adam, AdamW, Adagrad, RMSprop,
            ds_swift.undo.Lamb, DeepSpeed FusedLamb). Anything else, or a non-invertible
            option (amsgrad, differentiable), raises NotInvertibleError here.
        lr_scheduler: restored to its state before the last step on undo (it must be
            stepped after the optimizer, torch's and DeepSpeed's convention).
        retain_grads: keep strong references to the gradients a step used (for callers
            that free them right after the step, as DeepSpeed's ZeRO and mixed-precision
            optimizers do with their fp32 gradients). Otherwise the gradient must still be
            in ``.grad`` at undo time, checked through weak references and version counters.
        refine: check the float64 inverse against a replay of the forward (exact for most
            elements); off only to measure what refinement buys.
        undo_path: "auto" (the default): "fused" for CUDA tensors when Triton imports, "fast"
            otherwise. "fused": torch's Adam/AdamW and DeepSpeed's FusedAdam undone by one Triton
            kernel per tensor (ds_swift.undo.fused; the fast path for what it does not model, and
            where Triton is missing, said once in the log). "fast": large slices and packed small
            tensors, refinement without host syncs. "reference": per-tensor 2^18-element slices,
            refinement that gathers the misses: the float64 path the others are tested against.
            See ds_swift.undo.apply.
        last_stepped_iteration: the iteration of the last step taken before wrapping (not
            undoable, but reported until the first recorded step).
    """

    # torch's GradScaler would otherwise (through __getattr__) see a fused inner optimizer's
    # flag and hand the wrapper grad_scale/found_inf to pass to a kernel that may skip a step
    # per device; it unscales first and steps only on finite gradients instead.
    _step_supports_amp_scaling = False

    def __init__(
        self,
        optimizer: Any,
        lr_scheduler: Any = None,
        *,
        retain_grads: bool = False,
        refine: bool = True,
        undo_path: UndoPath = "auto",
        last_stepped_iteration: int | None = None,
    ) -> None:
        if isinstance(optimizer, InvertibleOptimizer):
            raise ValueError("optimizer is already an InvertibleOptimizer")
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.retain_grads = retain_grads
        self.refine = refine
        if undo_path not in UNDO_PATHS:
            raise ValueError(f"undo_path must be one of {', '.join(map(repr, UNDO_PATHS))}, not {undo_path!r}")
        self.undo_path: UndoPath = undo_path
        self.rule: UndoRule = rule_for(optimizer)
        if undo_path in ("fused", "auto"):
            from ds_swift.undo.fused import announce

            announce(self.rule, undo_path, optimizer)
        self._record: StepRecord | None = None
        self._txn: StepRecord | None = None
        self._released = False
        self._last_iteration: int | None = last_stepped_iteration
        # Bound before anyone (attach_to_engine) patches ``optimizer.step`` to route here.
        self._inner_step = optimizer.step

    # ---- pass-through --------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._record = None  # the recorded step no longer describes this state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.release_grads()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally; guard against recursion before __init__.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"InvertibleOptimizer({self.optimizer!r})"

    # ---- recording ------------------------------------------------------------------

    @property
    def last_record(self) -> StepRecord | None:
        """The step that undo() would undo (None after an undo or before any step)."""
        return self._record

    @property
    def last_stepped_iteration(self) -> int | None:
        return self._last_iteration

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    @property
    def can_undo(self) -> bool:
        try:
            if self._record is None:
                return False
            self._validate(self._record)
            return True
        except UndoError:
            return False

    def step(self, closure: Callable[[], Any] | None = None, iteration: int | None = None, **kwargs: Any) -> Any:
        """The wrapped optimizer's step, recorded. ``kwargs`` go to it unchanged."""
        loss = None
        if closure is not None:
            # torch's optimizers evaluate the closure first thing; doing it here lets the
            # record see the gradients the closure produced, and keeps the arithmetic.
            with torch.enable_grad():
                loss = closure()
        if self._txn is not None:
            self._step_into(self._txn, kwargs)
            return loss
        with self.transaction(iteration) as rec:
            self._step_into(rec, kwargs)
        return loss

    @contextmanager
    def transaction(self, iteration: int | None = None) -> Iterator[StepRecord]:
        """Group every step() call inside into one undoable record (DeepSpeed's ZeRO steps
        the optimizer once per parameter group). A transaction with no step() call records a
        skipped step (fp16 overflow); one that raises records what was applied."""
        rec = self.begin(iteration)
        try:
            yield rec
        except BaseException:
            self.end(failed=True)
            raise
        self.end(failed=False)

    def begin(self, iteration: int | None = None) -> StepRecord:
        """Open a transaction (see ``transaction``); close it with ``end``."""
        if self._txn is not None:
            raise RuntimeError("an optimizer-step transaction is already open")
        if iteration is None:
            iteration = 0 if self._last_iteration is None else self._last_iteration + 1
        self._txn = StepRecord(
            iteration=iteration,
            optimizer_class=f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
            lr_scheduler_state=self._scheduler_snapshot(),
            prev_iteration=self._last_iteration,
        )
        return self._txn

    def end(self, failed: bool = False) -> StepRecord:
        """Close the open transaction and make it the undoable record."""
        rec = self._txn
        if rec is None:
            raise RuntimeError("no optimizer-step transaction is open")
        self._txn = None
        rec.complete = not failed
        rec.skipped = not failed and not rec.groups
        # The previous record (if any) drops here: its gradients are overwritten anyway.
        self._record = rec
        self._released = False
        self._last_iteration = rec.iteration
        return rec

    def _scheduler_snapshot(self) -> dict[str, Any] | None:
        if self.lr_scheduler is None:
            return None
        return copy.deepcopy(self.lr_scheduler.state_dict())

    def _step_into(self, rec: StepRecord, kwargs: dict[str, Any]) -> None:
        opt = self.optimizer
        self.rule.check_optimizer(opt)  # options may have changed since wrap time
        if getattr(opt, "found_inf", None) is not None or getattr(opt, "grad_scale", None) is not None:
            raise NotInvertibleError(
                "a GradScaler-driven fused step (grad_scale/found_inf) may skip per device inside the "
                "kernel and cannot be recorded; unscale before stepping or use a non-fused optimizer"
            )
        # This runs every step: one dict lookup per parameter before and after, no copies.
        state = opt.state
        pending: list[tuple[GroupRecord, list[tuple[torch.Tensor, torch.Tensor, Any, frozenset[str], int]]]] = []
        for gi, group in enumerate(opt.param_groups):
            items = []
            for p, g in self.rule.select(opt, group, kwargs, gi):
                if g.is_sparse or p.is_complex():
                    raise NotInvertibleError("sparse gradients and complex parameters are not supported by update-undo")
                st = state.get(p)  # never index: optimizer.state is a defaultdict
                items.append((p, g, st, frozenset(st) if st else _NO_KEYS, g._version))
            grec = GroupRecord(group=group, hyper=_snapshot_hyper(group), params=[], path=self.rule.path(group))
            pending.append((grec, items))

        self._inner_step(**kwargs)

        retain = self.retain_grads
        new_groups: list[GroupRecord] = []
        for grec, items in pending:
            records = grec.params
            for p, g, st_before, keys, grad_version in items:
                st = state.get(p)
                n_after = len(st) if st is not None else 0
                version = g._version
                records.append(
                    ParamRecord(
                        param=p,
                        grad_ref=g if retain else weakref.ref(g),
                        grad_version=version,
                        param_version=p._version,
                        grad_mutated=version != grad_version,
                        # Steps only ever add state entries: compare sizes before building sets.
                        new_state_keys=_NO_KEYS if n_after == len(keys) else frozenset(st or ()) - keys,
                        state_existed=st_before is not None,
                    )
                )
            if records:
                first = state.get(records[0].param)
                step = first.get("step") if first else None
                if not (isinstance(step, torch.Tensor) and step.device.type != "cpu"):
                    grec.step_count = _step_value(step)
            if "scale" in kwargs:
                grec.call_kwargs = {"scale": kwargs["scale"]}
            new_groups.append(grec)
        self.rule.post_step(opt, new_groups, kwargs)
        rec.groups.extend(new_groups)

    # ---- undo -----------------------------------------------------------------------

    def release_grads(self) -> None:
        """Drop the references to the step's gradients (the next backward is about to
        overwrite them): the record stays for inspection but can no longer be undone."""
        rec = self._record
        if rec is None or self._released:
            return  # called at every backward: keep it O(1) after the first
        for g in rec.groups:
            for pr in g.params:
                pr.grad_ref = None
        self._released = True

    def _validate(self, rec: StepRecord) -> None:
        for g in rec.groups:
            for pr in g.params:
                grad = pr.grad()
                if grad is None:
                    raise UndoError(
                        f"cannot undo iteration {rec.iteration}: its gradients were released or freed "
                        "(zero_grad or the next backward ran); only a step whose g_t is still resident "
                        "can be undone"
                    )
                if grad._version != pr.grad_version:
                    raise UndoError(
                        f"cannot undo iteration {rec.iteration}: a gradient was modified in place after "
                        "the step (zero_grad(set_to_none=False) or a new backward)"
                    )
                if pr.grad_mutated and not self.rule.mutates_grad_ok:
                    raise UndoError(
                        f"cannot undo iteration {rec.iteration}: {self.rule.name}'s step wrote into the gradient"
                    )
                if pr.param._version != pr.param_version:
                    raise UndoError(
                        f"cannot undo iteration {rec.iteration}: a parameter was modified after the step "
                        "(another step, or a load)"
                    )

    @property
    def undoable_but_for_gradients(self) -> bool:
        """The last step could be undone with its gradients given back (:meth:`restore_gradients`):
        nothing changed its parameters since, and the step did not write into its gradients."""
        rec = self._record
        if rec is None:
            return False
        return all(
            pr.param._version == pr.param_version and not (pr.grad_mutated and not self.rule.mutates_grad_ok)
            for g in rec.groups
            for pr in g.params
        )

    def restore_gradients(self, grads: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Give the last step's record back the gradients g_t it read, as ``(parameter, gradient)``
        pairs, where they were overwritten since (the next backward pass reuses DeepSpeed's flat
        fp32 buffers): from a copy taken at the step (strategy tranlogs' update record). Each
        becomes the gradient the undo reads. Returns how many of the record's parameters got one."""
        rec = self._record
        if rec is None:
            return 0
        given = {id(p): g for p, g in grads}
        n = 0
        for grec in rec.groups:
            for pr in grec.params:
                g = given.get(id(pr.param))
                if g is not None:
                    pr.grad_ref = g.to(device=pr.param.device, copy=True)
                    pr.grad_version = pr.grad_ref._version
                    n += 1
        return n

    def own_gradients(self) -> int:
        """Give the last step's record a copy of each gradient g_t it reads, while g_t is still
        resident and unchanged (else nothing: the undo then fails as it would have). A survivor that
        keeps its engine across a failure clears the engine's gradient buffers for the next generation
        (ds_swift.patches.deepspeed_fresh), which hold g_t (BF16_Optimizer's fp32 buffer, ZeRO-0's
        ``.grad``): an undo after that must not read zeros. Costs one copy of g_t, during a recovery
        only. Returns how many gradients were copied."""
        rec = self._record
        if rec is None or self._released:
            return 0
        try:
            self._validate(rec)
        except UndoError:
            return 0
        resident = [(pr.param, pr.grad()) for grec in rec.groups for pr in grec.params]
        return self.restore_gradients((p, g) for p, g in resident if g is not None)

    def undo(self) -> StepRecord:
        """Restore parameters, optimizer state and LR scheduler to before the last step."""
        rec = self._record
        if rec is None:
            raise UndoError("nothing to undo: no step recorded since the wrapper was made or the last undo")
        self._validate(rec)
        opt = self.optimizer
        with torch.no_grad():
            for grec in reversed(rec.groups):
                undo_group(self.rule, opt, grec, exact=self.refine, path=self.undo_path)
            for grec in rec.groups:
                _restore_hyper(grec.group, grec.hyper)
        if self.lr_scheduler is not None and rec.lr_scheduler_state is not None:
            self.lr_scheduler.load_state_dict(copy.deepcopy(rec.lr_scheduler_state))
        self._record = None
        self._last_iteration = rec.prev_iteration
        return rec
