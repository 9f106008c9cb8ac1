"""What the iteration about to be trained reads: its data and its gradient scaling (a mixin of
:class:`~ds_swift.runtime.engine.SwiftPipelineEngine`, which owns the state named below).

The data comes from ``batch_fn`` by position (ds_swift.data.keyed), or from the user's iterator
only where it can be at the right iteration; a lossy forward recovery may ask the next iteration
to scale its gradients (ds_swift.recovery.gradmask).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from ds_swift.data.keyed import BatchFn, DataIteratorError, micro_batches
from ds_swift.recovery.gradmask import GradScale, scaled_gradients

if TYPE_CHECKING:
    from ds_swift.runtime.context import SwiftContext

__all__ = ["IterationInputs"]


class IterationInputs:
    """The data of the iteration about to be trained, and the gradient scaling asked of it."""

    # Set by SwiftPipelineEngine.__init__ (annotations only: the wrapper's __getattr__ passes
    # unknown names through to DeepSpeed's engine).
    _engine: Any
    _ctx: SwiftContext
    _batch_fn: BatchFn
    _grad_scale: GradScale | None
    _user_iter_warned: bool

    def _scaled(self, engine: Any) -> AbstractContextManager[Any]:
        """The gradient scaling a lossy forward recovery asked of the iteration about to be trained."""
        scale, iteration = self._grad_scale, int(engine.global_steps)
        if scale is None or scale.iteration != iteration:
            if scale is not None and scale.iteration < iteration:
                self._grad_scale = None  # trained (or skipped past by a later recovery)
            return nullcontext()
        self._ctx.log(
            f"iteration {iteration}: gradients x {scale.factor:g}"
            + (f" in layers up to {scale.upto_layer}" if scale.upto_layer is not None else "")
        )
        return scaled_gradients(engine.module, scale.factor, scale.upto_layer)

    def _position(self, data_iter: Any, attempts: int) -> Any:
        """The user's iterator, at the iteration about to be trained, or an error (never the wrong
        samples): a :class:`~ds_swift.data.keyed.ResumableIterator` is rewound there; a plain one only
        serves iterations that follow on from what it gave, not a retry after a recovery or a
        replacement's first iteration."""
        e = self._engine
        if not (e.is_first_stage() or e.is_last_stage()):
            return data_iter  # middle stages read no data
        iteration = int(e.global_steps)
        if hasattr(data_iter, "rewind"):
            if data_iter.iteration != iteration:
                data_iter.rewind(iteration)
            return data_iter
        replacement_start = self._ctx.env is not None and self._ctx.env.replacement and not self._user_iter_warned
        self._user_iter_warned = True
        if attempts > 0 or replacement_start:
            raise DataIteratorError(
                f"ds-swift: train_batch(data_iter=...) after a recovery: iteration {iteration} would be trained on "
                "whatever the iterator holds next, not its own samples. Pass batch_fn to ds_swift.initialize() "
                "(samples by position), or wrap the iterator: ds_swift.data.keyed.ResumableIterator(factory, micro_batches), "
                "where factory(iteration) builds it at that iteration (e.g. a DataLoader over "
                "MegatronPretrainingSampler(consumed_samples=...))"
            )
        return data_iter

    def _data_for(self, iteration: int) -> Any:
        e = self._engine
        return micro_batches(self._batch_fn, iteration, e.grid.get_data_parallel_id(), e.gradient_accumulation_steps())
