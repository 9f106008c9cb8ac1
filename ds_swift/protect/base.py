"""One protection: what a worker runs while nothing fails so that a strategy can restore it.

Every protection has the same small lifecycle, which the runtime drives without knowing which
protections there are (:class:`~ds_swift.protect.protections.Protections`):

- :meth:`Protection.build` (once per worker): the protection, or why it is off, from the configured
  strategy's services (:func:`ds_swift.recovery.registry.services_of`) and the config;
- :meth:`Protection.start_generation` (every rank, once per generation, at the same point): hook
  into the engine in force;
- :meth:`Protection.quiesce` (a survivor, before its teardown): finish or drop what is in flight;
- :meth:`Protection.held` (every rank, at a recovery): what it holds for the consensus, carried in
  the report under its :attr:`Protection.name` (``RankReport.holdings``; the typed views a strategy
  reads are ds_swift.recovery.holdings);
- :meth:`Protection.lent` (at a recovery): an object a strategy may use in its restore, kept by type
  (ds_swift.recovery.handover);
- :meth:`Protection.cost_line` (once at start-up, by one rank per stage): what it costs per
  iteration; :meth:`Protection.usage` (at the end): what it cost;
- :meth:`Protection.after_checkpoint`, :meth:`Protection.close`.

A new protection is one subclass and one line in :data:`ds_swift.protect.protections.PROTECTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ds_swift.config import SwiftConfig
from ds_swift.recovery.holdings import Held
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.services import StrategyServices

__all__ = ["CostInputs", "Protection", "Site"]


@dataclass
class Site:
    """Where a worker's protections are built: what they may read and call.

    Args:
        cfg: the swift config.
        services: what the configured strategy runs while nothing fails.
        ctx: the worker's distributed context (ds_swift.runtime.context.SwiftContext).
        hooks: the runtime's per-engine hooks (ds_swift.runtime.hooks.EngineHooks): a protection's
            instruction hooks are added there, and removed with the runtime's.
        engine: the engine in force (None during a rebuild).
        generation: the generation in force.
        machine: this rank's machine.
        check_after_receive: raises where the generation failed while something was received.
        ckpt: the periodic checkpoints (ds_swift.checkpoint.periodic.CheckpointManager).
        host: the recovery's host, the engine wrapper (ds_swift.recovery.host.RecoveryHost).
    """

    cfg: SwiftConfig
    services: StrategyServices
    ctx: Any
    hooks: Any
    engine: Callable[[], Any]
    generation: Callable[[], int]
    machine: Callable[[], int]
    check_after_receive: Callable[[], None]
    ckpt: Any
    host: Any


@dataclass(frozen=True)
class CostInputs:
    """What a start-up cost line may need besides the engine: the rank state's bytes and device (one
    count for every line), the job's machines (None: unknown) and what a benchmark switched off."""

    state: Any
    total_bytes: int
    device: str
    machines: int | None
    without: frozenset[str]


class Protection:
    """One protection of one worker (every method but :meth:`build` and :meth:`cost_line` does
    nothing unless a protection needs it)."""

    #: its key in ``RankReport.holdings`` and in the usage record
    name: ClassVar[str]
    #: what its start-up cost line calls it
    label: ClassVar[str]

    @classmethod
    def build(cls, site: Site) -> Protection | str | None:
        """The protection this worker runs; or why it is off (said in its cost line); or None where
        the configured strategy has nothing of its kind (no line)."""
        raise NotImplementedError

    @classmethod
    def off_line(cls, why: str) -> str:
        """The start-up line of a protection that is off."""
        return f"  {cls.label}: off ({why}): 0"

    def start_generation(self, engine: Any) -> None:
        """Every rank, once per generation, at the same point (after generation 0's build, after each
        recovery, never during one): hook into ``engine``."""

    def quiesce(self, timeout_s: float) -> None:
        """A survivor, before its teardown: what is in flight finishes within ``timeout_s`` or is said lost."""

    def held(self, kept: KeptState | None) -> Held | None:
        """What this rank holds for the consensus (``kept``: a survivor's kept state; None: a
        replacement), or None: nothing to report."""
        return None

    def lent(self, kept: KeptState | None) -> object | None:
        """What a strategy may use in its restore (kept by type in ``RankContext.lent``), or None
        (``kept``: a survivor's kept state; None: a replacement)."""
        return None

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        """One start-up line: what this protection costs per iteration, and how that was found."""
        raise NotImplementedError

    def usage(self) -> Mapping[str, Any]:
        """What it cost this rank so far (the end-of-job usage record, ``ds-swift bench``)."""
        return {}

    def after_checkpoint(self, done: int) -> None:
        """A global checkpoint of ``done`` iterations is complete."""

    def after_step(self, engine: Any) -> None:
        """An iteration completed (the runtime's own point after the step, not an instruction hook)."""

    def forget(self) -> None:
        """After an elastic resize: what it held is keyed by the old ranks; the new generation starts afresh."""

    def close(self, timeout_s: float) -> None:
        """The job ends: finish within ``timeout_s`` (a last round, a last record) and stop."""
