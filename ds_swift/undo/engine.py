"""Update-undo for a DeepSpeed engine: ``attach_to_engine(engine) -> EngineUndoHandle``.

The torch optimizer that does the arithmetic sits inside DeepSpeed's wrapper (or is the
engine's optimizer itself with ZeRO-0 fp32). Its ``step`` is routed through an
:class:`InvertibleOptimizer`, and each ``engine._take_model_step`` becomes one transaction
(ZeRO calls the inner step once per parameter group), numbered ``engine.global_steps``.

Where the step's gradient g_t lives, and how it is kept without a copy until the next
backward starts (the earliest point at which no undo of step t can be needed: a stage only
runs a backward of t+1 after every stage has stepped t):

* ZeRO-0 fp32: ``param.grad``. DeepSpeed's ``engine.zero_grad()`` after the step is deferred.
* ZeRO-1 (fp32/bf16/fp16): the flat fp32 gradient partition DeepSpeed builds in ``step`` and
  drops right after; the record keeps a reference until the next backward. Extra memory:
  that partition (4 bytes x params / dp) stays alive through the next forward passes.
* bf16 pipeline (BF16_Optimizer): its persistent fp32 gradient buffer; the ``clear_hp_grads``
  after the step is deferred (no extra memory; the bf16 ``.grad`` are still freed).
* fp16 ZeRO-0 (FP16_UnfusedOptimizer): per-parameter fp32 gradients it creates and drops,
  kept like ZeRO-1's. A loss-scale overflow skips the step: the record is marked skipped
  and undo restores only the loss scaler and counters.

Undo acts on the fp32 master copy; the low-precision (or all-gathered) model parameters
are then refreshed: locally, plus an all-gather over the data-parallel group with ZeRO-1 and
bf16 (``undo_to(..., refresh=False)`` skips the collective, for a recovery that re-forms the
groups first; call ``refresh_params()`` afterwards).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from ds_swift.patches import deepspeed_step
from ds_swift.patches.deepspeed_engine import restore_step_state, step_state
from ds_swift.patches.deepspeed_optim_state import loss_scalers, refresh_lp_params
from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper, WrapperKind, kind_of
from ds_swift.undo.optimizer import InvertibleOptimizer
from ds_swift.undo.records import STRATEGY_HINT, NotInvertibleError, StepRecord, UndoError

__all__ = ["EngineUndoHandle", "attach_to_engine"]

_WRAPPER_FLAGS = ("overflow", "_global_grad_norm")


@dataclass
class _Kind:
    """How one DeepSpeed optimizer wrapper keeps its gradients and master weights."""

    kind: WrapperKind  # TORCH, ZERO_STAGE1, BF16_OPTIMIZER or FP16_UNFUSED (FP16_FUSED has no inverse here)
    wrapper: Any  # engine.optimizer
    inner: Any  # the torch optimizer doing the arithmetic
    retain_grads: bool


def _classify(engine: Any) -> _Kind:
    opt = engine.optimizer
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        raise NotInvertibleError(f"torch autocast with a GradScaler is not supported by update-undo; {STRATEGY_HINT}.")
    try:
        kind = kind_of(opt)
    except UnsupportedWrapper as exc:
        raise NotInvertibleError(
            f"{exc.what} is not supported by update-undo (ZeRO stages 0 and 1 without offload are); {STRATEGY_HINT}."
        ) from None
    if kind is WrapperKind.ZERO_STAGE1:
        return _Kind(kind, opt, opt.optimizer, retain_grads=True)
    if kind is WrapperKind.BF16_OPTIMIZER:
        return _Kind(kind, opt, opt.optimizer, retain_grads=True)
    if kind is WrapperKind.FP16_UNFUSED:
        return _Kind(kind, opt, opt.optimizer, retain_grads=True)
    if kind is WrapperKind.FP16_FUSED:
        raise NotInvertibleError(
            f"DeepSpeed's fused FP16_Optimizer (FusedAdam) is not supported by update-undo; {STRATEGY_HINT}."
        )
    return _Kind(kind, opt, opt, retain_grads=False)


class EngineUndoHandle:
    """Makes ``engine``'s optimizer step undoable; ``remove()`` puts the engine back.

    Args:
        engine: a DeepSpeedEngine or PipelineEngine after ``deepspeed.initialize``.
        refine: see InvertibleOptimizer.
    """

    def __init__(self, engine: Any, *, refine: bool = True) -> None:
        deepspeed_step.check_version()
        self.engine = engine
        self.kind = _classify(engine)
        # Steps taken before attaching count as stepped (for consensus), not as undoable.
        self.optimizer = InvertibleOptimizer(
            self.kind.inner,
            lr_scheduler=getattr(engine, "lr_scheduler", None),
            retain_grads=self.kind.retain_grads,
            refine=refine,
            last_stepped_iteration=engine.global_steps - 1 if engine.global_steps > 0 else None,
        )
        self._deferred: list[Callable[[], Any]] = []
        self._step_info: dict[str, Any] = {}
        self._patch = deepspeed_step.apply(
            engine,
            deepspeed_step.StepHooks(
                on_step_begin=self._on_step_begin,
                on_step_end=self._on_step_end,
                on_backward_begin=self._on_backward_begin,
                step_overrides=self._step_overrides,
            ),
        )
        self._patch.set_attr(self.kind.inner, "step", self._inner_step)

    # ---- public ---------------------------------------------------------------------

    @property
    def last_stepped_iteration(self) -> int | None:
        """engine.global_steps during the last step taken (and not undone); None if none."""
        return self.optimizer.last_stepped_iteration

    @property
    def last_record(self) -> StepRecord | None:
        return self.optimizer.last_record

    def undo_to(self, iteration: int, *, refresh: bool = True) -> list[StepRecord]:
        """Undo every step newer than ``iteration`` (at most the last one can be undone).

        Args:
            iteration: the iteration whose step must be the last applied one afterwards.
            refresh: also all-gather the restored master partitions into the model
                parameters (a collective over the data-parallel group with ZeRO-1 and bf16);
                False restores only this rank's part, see ``refresh_params``.
        """
        last = self.last_stepped_iteration
        if last is None or iteration >= last:
            return []
        rec = self.optimizer.last_record
        if iteration < last - 1 or rec is None or rec.iteration != last:
            raise UndoError(
                f"cannot undo back to iteration {iteration}: the last step taken is iteration {last} and only "
                f"{'it' if rec is not None and rec.iteration == last else 'a recorded step'} can be undone "
                "(one resident gradient); recover from a checkpoint instead"
            )
        rec = self.optimizer.undo()
        self._restore_engine(rec)
        if not rec.skipped:
            self.refresh_params(gather=refresh)
        return [rec]

    def refresh_params(self, gather: bool = True) -> None:
        """Copy the fp32 master values into the model's parameters (local part always;
        all-gathered across data-parallel ranks when ``gather``)."""
        refresh_lp_params(self.kind.wrapper, gather=gather)

    def remove(self) -> None:
        """Restore the engine as it was; a deferred gradient zeroing happens now, as it would
        have without ds-swift."""
        if not self._patch.active:
            return
        self._patch.remove()  # first: it refuses (changing nothing) if hooks sit on top of ours
        self._flush_deferred()  # as DeepSpeed would have zeroed right after the step
        self.optimizer.release_grads()

    def detach(self) -> InvertibleOptimizer:
        """Restore the engine's methods but keep the last step undoable, and let go of the
        engine (for an in-process rebuild: the old engine and its process groups must be
        freed). The deferred gradient zeroing is dropped (the rebuilt engine starts from a
        fresh backward) and g_t stays referenced by the record. Returns the
        InvertibleOptimizer, whose ``undo()`` restores parameters, state and LR scheduler
        (engine counters are the caller's: the engine is gone)."""
        self._patch.remove()  # first: it refuses (changing nothing) if hooks sit on top of ours
        self._deferred.clear()
        self.engine = None
        return self.optimizer

    def __enter__(self) -> EngineUndoHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    # ---- hooks ----------------------------------------------------------------------

    def _inner_step(self, closure: Any = None, **kwargs: Any) -> Any:
        iteration = None if self.optimizer.in_transaction else self.engine.global_steps
        return self.optimizer.step(closure, iteration=iteration, **kwargs)

    def _on_step_begin(self) -> None:
        # Normally flushed by the backward; a step without one sees what DeepSpeed would.
        self._flush_deferred()
        self._step_info = {}
        state = step_state(self.engine)
        wrapper_flags = {n: getattr(self.kind.wrapper, n) for n in _WRAPPER_FLAGS if n in vars(self.kind.wrapper)}
        scalers = [copy.deepcopy(vars(s)) for s in loss_scalers(self.kind.wrapper, self.kind.kind)]
        rec = self.optimizer.begin(self.engine.global_steps)
        rec.engine_state = {"engine": state, "wrapper": wrapper_flags, "scalers": scalers}
        rec.loss_scale = self._loss_scale()

    def _on_step_end(self, error: BaseException | None) -> None:
        rec = self.optimizer.end(failed=error is not None)
        info = self._step_info
        k = self.kind
        if k.kind is WrapperKind.BF16_OPTIMIZER and getattr(k.wrapper, "clip_grad", 0.0) > 0 and not rec.skipped:
            info.setdefault("grad_norm", k.wrapper._global_grad_norm)
            info.setdefault("max_norm", k.wrapper.clip_grad)
        if "grad_norm" in info:
            rec.grad_norm = info["grad_norm"]
            rec.clip_coef = info.get("clip_coef")
            if rec.clip_coef is None:
                rec.clip_coef = torch.clamp(
                    torch.as_tensor(info["max_norm"], dtype=torch.float64) / (torch.as_tensor(rec.grad_norm) + 1e-6),
                    max=1.0,
                )

    def _on_backward_begin(self) -> None:
        self._flush_deferred()
        self.optimizer.release_grads()

    def _flush_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)()

    def _defer(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def deferred(*args: Any, **kwargs: Any) -> None:
            if all(getattr(d, "__wrapped_fn__", None) != fn for d in self._deferred):
                call = lambda: fn(*args, **kwargs)  # noqa: E731
                call.__wrapped_fn__ = fn  # type: ignore[attr-defined]
                self._deferred.append(call)

        return deferred

    def _step_overrides(self) -> list[deepspeed_step.Override]:
        e, k = self.engine, self.kind
        out: list[deepspeed_step.Override] = []
        if k.kind is WrapperKind.TORCH:
            out.append((e, "zero_grad", self._defer(e.zero_grad)))
            out.append((e, "clip_fp32_gradients", self._clip_fp32))
        elif k.kind is WrapperKind.BF16_OPTIMIZER:
            out.append((k.wrapper, "clear_hp_grads", self._defer(k.wrapper.clear_hp_grads)))
        elif k.kind in (WrapperKind.ZERO_STAGE1, WrapperKind.FP16_UNFUSED):
            out.append((k.wrapper, "unscale_and_clip_grads", self._capture_unscale(k.wrapper.unscale_and_clip_grads)))
        return out

    def _clip_fp32(self) -> None:
        # Same call as DeepSpeedEngine.clip_fp32_gradients (0.19.8), keeping the norm it returns.
        from deepspeed.runtime import engine as ds_engine

        e = self.engine
        max_norm = e.gradient_clipping()
        total = ds_engine.clip_grad_norm_(parameters=e.module.parameters(), max_norm=max_norm, mpu=e.mpu)
        self._step_info.update(grad_norm=total, max_norm=max_norm)

    def _capture_unscale(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        wrapper = self.kind.wrapper

        def unscale_and_clip_grads(*args: Any, **kwargs: Any) -> Any:
            clip_grad = float(getattr(wrapper, "clip_grad", 0.0))
            if self.kind.kind is WrapperKind.ZERO_STAGE1:
                total_norm = args[1] if len(args) > 1 else kwargs.get("total_norm")
            else:
                total_norm = args[0] if args else kwargs.get("total_norm")
            scale = self._loss_scale() or 1.0
            if clip_grad > 0 and total_norm is not None:
                norm = torch.as_tensor(total_norm, dtype=torch.float64) / scale
                self._step_info.update(
                    grad_norm=norm, max_norm=clip_grad, clip_coef=torch.clamp(clip_grad / (norm + 1e-6), max=1.0)
                )
            return fn(*args, **kwargs)

        return unscale_and_clip_grads

    def _loss_scale(self) -> float | None:
        k = self.kind
        if k.kind is WrapperKind.ZERO_STAGE1:
            return float(k.wrapper.loss_scale)
        if k.kind is WrapperKind.FP16_UNFUSED:
            return float(k.wrapper.loss_scale_config.cur_scale)
        return None

    def _restore_engine(self, rec: StepRecord) -> None:
        st = rec.engine_state
        restore_step_state(self.engine, st.get("engine", {}))
        for name, value in st.get("wrapper", {}).items():
            setattr(self.kind.wrapper, name, value)
        for scaler, saved in zip(loss_scalers(self.kind.wrapper, self.kind.kind), st.get("scalers", []), strict=False):
            vars(scaler).update(copy.deepcopy(saved))


def attach_to_engine(engine: Any, *, refine: bool = True) -> EngineUndoHandle:
    """Make ``engine``'s optimizer step undoable. Raises NotInvertibleError for an optimizer
    or configuration without an inverse (the message says which strategy to use instead)."""
    return EngineUndoHandle(engine, refine=refine)
