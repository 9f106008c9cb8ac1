"""The engine wrapper's checkpoint calls: DeepSpeed's save and load, protected and remembered.

``save_checkpoint`` is retried after a recovery (the iterations a failure took are trained again
first); ``load_checkpoint`` makes the checkpoint it loaded the job's origin; the periodic saves and
the log clean-up after a complete checkpoint are the runtime's. A mixin of
:class:`~ds_swift.runtime.engine.SwiftPipelineEngine`, which owns the state named below.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ds_swift.checkpoint.periodic import Origin, latest_complete, trusted_origin
from ds_swift.runtime.rebuild import MAX_ATTEMPTS

if TYPE_CHECKING:
    from ds_swift.checkpoint.periodic import CheckpointManager
    from ds_swift.detect.monitor import FailureMonitor
    from ds_swift.runtime.context import SwiftContext
    from ds_swift.runtime.hooks import EngineHooks
    from ds_swift.runtime.rebuild import Rebuilder

__all__ = ["CheckpointCalls"]


class CheckpointCalls:
    """Checkpoint saves and loads of the engine in force, through failures."""

    # Set by SwiftPipelineEngine.__init__ (annotations only: the wrapper's __getattr__ passes
    # unknown names through to DeepSpeed's engine).
    _engine: Any
    _ctx: SwiftContext
    _ckpt: CheckpointManager
    _hooks: EngineHooks
    _monitor: FailureMonitor
    _rebuild: Rebuilder
    _op_timeouts: Callable[[], AbstractContextManager[Any]]
    _recover_as_survivor: Callable[[str], None]
    _train_batch: Callable[[Any], Any]

    def _save_checkpoint(self) -> None:
        self._ckpt.save(self._engine)
        self._checkpointed()

    def _checkpointed(self) -> None:
        """A global checkpoint may have completed: the message and update logs older than this job's
        newest complete one go (another run's newer checkpoint in the directory counts for nothing;
        rank 0's completion marker may not be there yet: then they go after the next one)."""
        found = latest_complete(self._ckpt.ckpt_dir, job=self._ckpt.job_id)
        if found is not None:
            self._rebuild.protect.after_checkpoint(found[0])

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        **kwargs: Any,
    ) -> Any:
        """DeepSpeed's ``save_checkpoint``, protected: a failure during the save is recovered from,
        the iterations lost to it are trained again, and the save is retried."""
        with self._op_timeouts():
            return self._save_checkpoint_protected(save_dir, tag, client_state, save_latest, **kwargs)

    def _save_checkpoint_protected(
        self, save_dir: str, tag: str | None, client_state: dict[str, Any] | None, save_latest: bool, **kwargs: Any
    ) -> Any:
        from ds_swift.patches.deepspeed_rebuild import long_op_timeout

        target = int(self._engine.global_steps)
        for _ in range(MAX_ATTEMPTS):
            how = self._monitor.failure_seen()
            if how is None:
                try:
                    with long_op_timeout(self._ckpt.save_timeout_s or self._ctx.op_timeout_s):
                        return self._engine.save_checkpoint(
                            save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs
                        )
                except Exception as exc:  # noqa: BLE001 - classified, re-raised unless a failure
                    how = self._monitor.classify(exc)
            self._recover_as_survivor(how)
            while int(self._engine.global_steps) < target:
                self._train_batch(None)
        raise RuntimeError(f"ds-swift: save_checkpoint failed {MAX_ATTEMPTS} times in a row")

    def load_checkpoint(self, load_dir: str, tag: str | None = None, **kwargs: Any) -> Any:
        """DeepSpeed's ``load_checkpoint``; the checkpoint loaded becomes the job's origin, which a
        checkpoint fallback may go back to although another launch wrote it."""
        from ds_swift.checkpoint.damage import named_on_failure

        with named_on_failure(load_dir, tag):
            load_path, client_state = self._engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if load_path is not None:
            # The tag DeepSpeed loaded (its file's directory), not DeepSpeed's 'latest' read again.
            loaded = tag if tag is not None else Path(load_path).parent.name
            origin = trusted_origin(load_dir, str(loaded), int(self._engine.global_steps), dist.get_rank())
            self._set_origin(origin, publish=True)
        return load_path, client_state

    def _set_origin(self, origin: Origin | None, publish: bool) -> None:
        from ds_swift.recovery.coordinator import ORIGIN_KEY

        if origin is None:
            return
        self._ckpt.origin = origin
        if publish and self._ctx.store is not None and dist.get_rank() == 0:
            self._ctx.store.set(ORIGIN_KEY, origin.to_json())
