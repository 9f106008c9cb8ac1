"""The job's checkpoint manager, built from the ``swift`` config: where the periodic checkpoint
(:mod:`ds_swift.checkpoint.periodic`), its asynchronous writer (:mod:`ds_swift.checkpoint.background`) and
CheckFreq's interval (:mod:`ds_swift.checkpoint.checkfreq`) meet, so that none of them imports another back.
"""

from __future__ import annotations

from typing import Any

from ds_swift.checkpoint.background import AsyncWriter
from ds_swift.checkpoint.checkfreq import CheckFreqTuner
from ds_swift.checkpoint.periodic import CheckpointManager, job_id_for

__all__ = ["asynchronous", "checkpoint_manager"]


def checkpoint_manager(cfg: Any, ctx: Any, rank: int, world_size: int, services: Any, gpu: bool = False) -> Any:
    """The engine's :class:`~ds_swift.checkpoint.periodic.CheckpointManager` for a ``swift`` config: with an
    :class:`AsyncWriter` where checkpoints are asynchronous (:func:`asynchronous`), and CheckFreq's tuner
    where the strategy's ``services`` (ds_swift.recovery.registry.services_of) have one."""
    job_id = job_id_for(ctx.env.token if ctx.env is not None else None)
    manager = CheckpointManager(
        cfg.checkpoint.dir, cfg.checkpoint.interval, rank, job_id=job_id, save_timeout_s=cfg.checkpoint.save_timeout_s
    )
    if asynchronous(cfg, services, gpu):
        manager.writer = AsyncWriter(rank, world_size, cfg.checkpoint.save_timeout_s)
        manager.new_generation(ctx.generation)
    if services.checkpoint_tuner:
        manager.tuner = CheckFreqTuner(cfg.checkfreq.max_overhead, cfg.checkfreq.profile_at, rank, store=ctx.store)
    return manager


def asynchronous(cfg: Any, services: Any, gpu: bool) -> bool:
    """Whether periodic checkpoints are asynchronous for a state on GPUs (``gpu``) or on CPU: as
    ``checkpoint.async_save`` says, else on GPUs and where the strategy's ``services`` want them."""
    if cfg.checkpoint.async_save is not None:
        return bool(cfg.checkpoint.async_save)
    return gpu or bool(services.async_checkpoints)
