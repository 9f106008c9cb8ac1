"""Update-undo: invertible optimizer steps (SWIFT section 4).

from ds_swift.undo import InvertibleOptimizer, NotInvertibleError
opt = InvertibleOptimizer(torch.optim.AdamW(model.parameters()), lr_scheduler=sched)
loss.backward(); opt.step(); sched.step()
opt.undo()            # parameters, optimizer state and scheduler as before the step

from ds_swift.undo import attach_to_engine
with attach_to_engine(engine) as handle:   # DeepSpeed engine, ZeRO 0/1, fp32/bf16/fp16
    engine.train_batch(...)
    handle.undo_to(handle.last_stepped_iteration - 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_swift.undo.lamb import Lamb
from ds_swift.undo.optimizer import InvertibleOptimizer
from ds_swift.undo.records import GroupRecord, NotInvertibleError, ParamRecord, StepRecord, UndoError

if TYPE_CHECKING:
    from ds_swift.undo.engine import EngineUndoHandle

__all__ = [
    "EngineUndoHandle",
    "GroupRecord",
    "InvertibleOptimizer",
    "Lamb",
    "NotInvertibleError",
    "ParamRecord",
    "StepRecord",
    "UndoError",
    "attach_to_engine",
]


def attach_to_engine(engine: Any, **kwargs: Any) -> EngineUndoHandle:
    """Make a DeepSpeed engine's optimizer step undoable (see ds_swift.undo.engine)."""
    from ds_swift.undo.engine import attach_to_engine as _attach

    return _attach(engine, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "EngineUndoHandle":
        from ds_swift.undo.engine import EngineUndoHandle

        return EngineUndoHandle
    raise AttributeError(name)
