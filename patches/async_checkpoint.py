"""A DeepSpeed engine saves through another checkpoint engine for one ``save_checkpoint`` call.

DeepSpeed 0.19 builds its checkpoint engine once, from the config (``engine.checkpoint_engine``);
an asynchronous global checkpoint (:mod:`ds_swift.checkpoint.background`) needs DeepSpeed's own file
layout with ds-swift's snapshot engine behind it, and only for ds-swift's periodic saves: a user's
own ``save_checkpoint`` and every load keep DeepSpeed's engine. :func:`saving_through` swaps the
attribute for the duration of a ``with`` block and puts the original back, also on an exception.
:func:`fsyncing_saves` keeps DeepSpeed's engine and fsyncs each file it writes (synchronous saves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed

__all__ = ["commit_decoupled", "fsyncing_saves", "saving_through"]


def saving_through(engine: Any, checkpoint_engine: Any) -> PatchHandle:
    """Make ``engine.save_checkpoint`` write through ``checkpoint_engine`` until the handle is removed."""
    check_deepspeed()
    if not hasattr(engine, "checkpoint_engine"):
        raise PatchError(
            "this DeepSpeed engine has no checkpoint_engine attribute: asynchronous checkpoints need DeepSpeed >=0.16"
        )
    original = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine

    def restore() -> None:
        engine.checkpoint_engine = original

    return PatchHandle("saving_through", restore)


def fsyncing_saves(engine: Any, fsync: Callable[[str], None]) -> PatchHandle:
    """Call ``fsync(path)`` after each file ``engine``'s checkpoint engine writes, until the handle
    is removed: DeepSpeed closes its files without an fsync, and ds-swift's completion marker must
    not reach the disk before them. Each rank thus syncs exactly the files it wrote.

    Raises:
        PatchError: no ``checkpoint_engine`` attribute, or a decoupled one (it writes in another
            process: a file may not be there yet when ``save`` returns).
    """
    check_deepspeed()
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None:
        raise PatchError("this DeepSpeed engine has no checkpoint_engine attribute: its files cannot be followed")
    if ce.is_decoupled():
        raise PatchError(f"{type(ce).__name__} writes in another process: its files cannot be fsynced as written")
    had = "save" in vars(ce)
    original = ce.save

    def save(state_dict: Any, path: str) -> Any:
        result = original(state_dict, path)
        fsync(path)
        return result

    ce.save = save

    def restore() -> None:
        if had:
            ce.save = original
        else:
            del ce.save  # the class's method again

    return PatchHandle("fsyncing_saves", restore)


def commit_decoupled(engine: Any) -> bool:
    """Wait until a decoupled checkpoint engine (DeepSpeed's writer process: ``checkpoint.writer.
    decoupled``, DataStates) has written the save just made; DeepSpeed itself commits it only at the
    next optimizer step, after ds-swift would have marked the tag complete. False, and nothing done,
    for an engine that writes in its own process (its ``save`` has returned with the files written).
    """
    check_deepspeed()
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None or not ce.is_decoupled():
        return False
    engine._commit_decoupled_checkpoint()  # what the next step would do; a no-op then
    return True
