"""What the engine wrapper sets up around a DeepSpeed engine, and what it reports of it.

The pieces of :class:`~ds_swift.runtime.engine.SwiftPipelineEngine`'s start that stand alone: the
failure simulation, the watchdog's timeout check, the start-up line per
protection with its cost, and the usage record each rank leaves at close (``ds-swift bench``).
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.protect.costs import protection_costs, switched_off_line
from ds_swift.runtime.failure_simulation import FailureSimulation

if TYPE_CHECKING:
    from ds_swift.checkpoint.periodic import CheckpointManager
    from ds_swift.protect.protections import Protections
    from ds_swift.runtime.context import SwiftContext

__all__ = [
    "check_hang_timeout",
    "failure_simulation",
    "log_protection_costs",
    "speaks_for_stage",
    "write_usage",
]


def failure_simulation(cfg: SwiftConfig, ctx: SwiftContext) -> FailureSimulation | None:
    """The simulated failure the config asks for; never on a replacement (a real failure ended it)."""
    if cfg.simulate_failure.iteration is None or (ctx.env is not None and ctx.env.replacement):
        return None
    return FailureSimulation(cfg.simulate_failure)


def check_hang_timeout(cfg: SwiftConfig, ctx: SwiftContext) -> None:
    """Refuse a hang timeout the op timeout would always beat (the hang could never be seen)."""
    hang = cfg.watchdog.hang_timeout_s
    if hang is not None and hang <= ctx.op_timeout_s:
        raise ConfigError(
            f"swift config: watchdog.hang_timeout_s={hang:g} must be more than the op timeout "
            f"({ctx.op_timeout_s:g} s, from ds-swift-launch --op-timeout): raise it, or set it to null (off)"
        )


def log_protection_costs(
    engine: Any,
    cfg: SwiftConfig,
    ctx: SwiftContext,
    protections: Protections,
    ckpt: CheckpointManager,
    without: frozenset[str],
    undo_off: str | None = None,
) -> None:
    """One start-up line per protection, with its cost: said (and measured) by one rank per pipeline
    stage (:func:`speaks_for_stage`), which the stage's other ranks resemble. ``undo_off``: why
    update-undo is not attached (None: it is)."""
    if without:
        # Every rank, loudly: an environment variable switched protections off, and one a benchmark's
        # shell leaked into a real job must not hide among one stage's informational lines.
        ctx.log(switched_off_line(without), level=logging.WARNING)
    if not speaks_for_stage(engine):
        return
    for line in protection_costs(
        engine,
        cfg,
        protections,
        async_ckpt=ckpt.writer is not None,
        checkpoint_tuner=ckpt.tuner is not None,
        without=without,
        machines=ctx.env.num_machines if ctx.env is not None else None,
        undo_off=undo_off,
    ):
        ctx.log(line)


def speaks_for_stage(engine: Any) -> bool:
    """Whether this rank says its stage's start-up costs: data-parallel rank 0, tensor-parallel rank 0
    of the stage. Every rank saying its own was eight lines per rank, eight thousand on a thousand
    ranks; a stage's ranks hold the same layers (their costs differ only by a partition's rounding)."""
    grid = getattr(engine, "grid", None)
    if grid is None:
        return True
    tp = grid.get_slice_parallel_rank() if hasattr(grid, "get_slice_parallel_rank") else 0
    return int(grid.get_data_parallel_id()) == 0 and int(tp) == 0


def write_usage(ctx: SwiftContext, engine: Any, protections: Protections) -> None:
    """``<run_dir>/usage/rank<r>.json``: what this rank's protections cost it (``ds-swift bench``
    reads these: message-log and update-log bytes written, buddy bytes sent and held, what the
    training thread waited for), and its peak host memory."""
    if ctx.env is None:
        return  # not under ds-swift-launch: no run directory of the job's
    rank = ctx.env.rank
    try:
        record = {
            "rank": rank,
            "iterations": int(engine.global_steps),
            "log_bytes": 0,
            "buddy_bytes_sent": 0,
            "buddy_host_bytes": 0,
            "buddy_off": None,
            "buddy_wait_s": 0.0,
            "digest_wait_s": 0.0,
            **protections.usage(),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        out = Path(ctx.run_dir) / "usage"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(record))
    except Exception as exc:  # noqa: BLE001 - a report: it must never fail the job's close
        ctx.log(f"usage record not written: {type(exc).__name__}: {exc}")
