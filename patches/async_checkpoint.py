"""A DeepSpeed engine saves through another checkpoint engine for one ``save_checkpoint`` call.

DeepSpeed 0.19 builds its checkpoint engine once, from the config (``engine.checkpoint_engine``);
an asynchronous global checkpoint (:mod:`ds_swift.checkpoint_async`) needs DeepSpeed's own file
layout with ds-swift's snapshot engine behind it, and only for ds-swift's periodic saves: a user's
own ``save_checkpoint`` and every load keep DeepSpeed's engine. :func:`saving_through` swaps the
attribute for the duration of a ``with`` block and puts the original back, also on an exception.
"""

from __future__ import annotations

from typing import Any

import deepspeed

from ds_swift.patches._base import PatchError, PatchHandle, check_version

__all__ = ["saving_through"]


def saving_through(engine: Any, checkpoint_engine: Any) -> PatchHandle:
    """Make ``engine.save_checkpoint`` write through ``checkpoint_engine`` until the handle is removed."""
    check_version("deepspeed", deepspeed.__version__, "0.16", "0.20")
    if not hasattr(engine, "checkpoint_engine"):
        raise PatchError("this DeepSpeed engine has no checkpoint_engine attribute: asynchronous checkpoints need DeepSpeed >=0.16")
    original = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine

    def restore() -> None:
        engine.checkpoint_engine = original

    return PatchHandle("saving_through", restore)
