"""The engine wrapper's end: the watchdog, the protections and the hooks stopped, the last
checkpoint landed and the usage written (a mixin of
:class:`~ds_swift.runtime.engine.SwiftPipelineEngine`, which owns the state named below).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_swift.protect.update_logger import UpdateLogger
from ds_swift.runtime.engine_setup import write_usage

if TYPE_CHECKING:
    from ds_swift.checkpoint.periodic import CheckpointManager
    from ds_swift.detect.monitor import FailureMonitor
    from ds_swift.patches.determinism import ScopedDeterminism
    from ds_swift.runtime.context import SwiftContext
    from ds_swift.runtime.hooks import EngineHooks
    from ds_swift.runtime.rebuild import Rebuilder
    from ds_swift.runtime.timeline import PendingTimeline

__all__ = ["EngineShutdown"]


class EngineShutdown:
    """``close()``: the engine stays usable, unprotected; also run at interpreter exit."""

    # Set by SwiftPipelineEngine.__init__ (annotations only: the wrapper's __getattr__ passes
    # unknown names through to DeepSpeed's engine).
    _engine: Any
    _ctx: SwiftContext
    _ckpt: CheckpointManager
    _rebuild: Rebuilder
    _timeline: PendingTimeline
    _monitor: FailureMonitor
    _hooks: EngineHooks
    _recv_patch: Any
    _determinism: ScopedDeterminism
    _closed: bool
    _checkpointed: Callable[[], None]  # CheckpointCalls'

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - at interpreter exit the job store may be gone already
            self._ctx.log(f"closing at exit: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the watchdog and remove the hooks (the engine stays usable, unprotected)."""
        if self._closed:
            return
        self._closed = True
        env, store = self._ctx.env, self._ctx.store
        self._write_usage()
        self._ckpt.close()  # the last asynchronous checkpoint lands first
        if (
            self._ckpt.ckpt_dir is not None
            and self._rebuild.protect.get(UpdateLogger) is not None
            and self._ckpt.settle()
        ):
            self._checkpointed()  # the last checkpoint completed since the last look
        self._rebuild.protect.close()
        self._timeline.close()
        self._monitor.stop(final=True)  # no thread left in a store wait when the interpreter finalizes
        if store is not None and env is not None:
            store.mark_done(env.rank)
        self._hooks.uninstall()
        self._recv_patch.remove()
        self._determinism.restore()

    def _write_usage(self) -> None:
        write_usage(self._ctx, self._engine, self._rebuild.protect)
