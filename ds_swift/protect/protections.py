"""A worker's protections: every registered :class:`~ds_swift.protect.base.Protection`, built from the
configured strategy's services, driven through one lifecycle.

The runtime calls the lifecycle here and never a protection by its name: a new protection is one
class and one line in :data:`PROTECTIONS`, and reaches the recovery report
(``RankReport.holdings``), the strategies (``RankContext.lent``), the start-up cost lines and the
usage record with no other edit.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.protect.buddy import BuddyCopier
from ds_swift.protect.digest_publisher import DigestPublisher
from ds_swift.protect.inflight_copy import InflightCopy
from ds_swift.protect.message_logging import MessageLogging
from ds_swift.protect.running_checkpoint import RunningCheckpoints
from ds_swift.protect.update_logger import UpdateLogger
from ds_swift.recovery.handover import Handover
from ds_swift.recovery.holdings import Held
from ds_swift.recovery.kept import KeptState

__all__ = ["PROTECTIONS", "Protections"]

P = TypeVar("P", bound=Protection)

#: Every protection a worker may run, in the order their lifecycle runs (the message log is flushed
#: first at a teardown, before the copier threads stop) and their cost lines are said.
PROTECTIONS: tuple[type[Protection], ...] = (
    MessageLogging,
    BuddyCopier,
    DigestPublisher,
    UpdateLogger,
    InflightCopy,
    RunningCheckpoints,
)


class Protections:
    """The protections of one worker (built once; kept across every recovery).

    Args:
        site: where they are built (config, services, context, hooks, the engine in force...).
    """

    def __init__(self, site: Site) -> None:
        self.site = site
        self.running: list[Protection] = []
        #: (class, why off) of those that are off, for their cost line
        self.off: list[tuple[type[Protection], str]] = []
        for cls in PROTECTIONS:  # read at build time: a test may add one
            made = cls.build(site)
            if isinstance(made, Protection):
                self.running.append(made)
            elif isinstance(made, str):
                self.off.append((cls, made))

    def get(self, kind: type[P]) -> P | None:
        """The running protection of type ``kind``, or None."""
        return next((p for p in self.running if isinstance(p, kind)), None)

    def start_generation(self) -> None:
        """Every rank, once per generation, at the same point (after generation 0's build, after each
        recovery, never during one): every protection hooks into the engine in force."""
        engine = self.site.engine()
        for p in self.running:
            p.start_generation(engine)

    def quiesce(self) -> None:
        """A survivor, before its teardown: what is in flight finishes or is said lost."""
        for p in self.running:
            p.quiesce(self.site.ctx.op_timeout_s)

    def holdings(self, kept: KeptState | None) -> dict[str, Held]:
        """What this rank's protections hold for the consensus, by name (``kept``: a survivor's kept
        state, None: a replacement). Called before the report is made: a protection may still help
        the kept state undo (the update log's gradients)."""
        out: dict[str, Held] = {}
        for p in self.running:
            held = p.held(kept)
            if held is not None and held != type(held)():  # holding nothing is the default: not carried
                out[p.name] = held
        return out

    def lend(self, kept: KeptState | None) -> Handover:
        """What the strategies may use in this recovery, kept by type."""
        return Handover(*(p.lent(kept) for p in self.running))

    def after_step(self, engine: Any) -> None:
        for p in self.running:
            p.after_step(engine)

    def after_checkpoint(self, done: int) -> None:
        """A global checkpoint of ``done`` iterations is complete: what only older iterations needed goes."""
        for p in self.running:
            p.after_checkpoint(done)

    def forget(self) -> None:
        """After an elastic resize: holdings keyed by the old ranks go; the new generation starts afresh."""
        for p in self.running:
            p.forget()

    def cost_lines(self, engine: Any, costs: CostInputs) -> list[str]:
        """One start-up line per protection, in :data:`PROTECTIONS` order (those off say why)."""
        lines = [(_index(type(p)), p.cost_line(engine, costs)) for p in self.running]
        lines += [(_index(cls), cls.off_line(why)) for cls, why in self.off]
        return [line for _, line in sorted(lines, key=lambda x: x[0])]

    def usage(self) -> dict[str, Any]:
        """What the protections cost this rank (their figures summed where two give the same one)."""
        out: dict[str, Any] = {}
        for p in self.running:
            for key, value in p.usage().items():
                both = isinstance(value, int | float) and isinstance(out.get(key), int | float)
                out[key] = out[key] + value if both else value
        return out

    def close(self) -> None:
        """The job ends: each protection finishes within the op timeout (one that raises is said; the others still close)."""
        for p in self.running:
            try:
                p.close(self.site.ctx.op_timeout_s)
            except Exception as exc:  # noqa: BLE001 - closing one must not leave the others running
                self.site.ctx.log(f"{p.label}: not closed cleanly: {type(exc).__name__}: {exc}", level=logging.WARNING)


def _index(cls: type[Protection]) -> int:
    """``cls``'s place in :data:`PROTECTIONS` (read now: a test may have added one)."""
    return PROTECTIONS.index(cls) if cls in PROTECTIONS else len(PROTECTIONS)
