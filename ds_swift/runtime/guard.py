"""The post-recovery guard: for ``verify.guard_iterations`` iterations after any recovery, a loss that
is not finite, or that diverges from the run's own trend before the failure, steps every rank back
to the global checkpoint, loudly, once; a second trip ends the job with the reason instead of
looping (users of other systems hit NaN a few iterations after loading a replicated checkpoint and
then looped through restarts: Megatron-LM#5281).

*What diverging means.* The reference is the run's last :data:`WINDOW` losses before the failure
(iterations the recovery did not roll back, loss-scale skips left out): a loss above
``max + (guard_loss_factor - 1) x max |loss|`` of them (for positive losses ``factor x max``)
diverges. A rising max would need the loss to more than double at the default factor 2: far above
the noise of a healthy run, and what a corrupt restore does. An iteration whose step the fp16 loss
scaler skipped (an overflow: ``engine.skipped_steps`` moved) is not judged: the scaler handles it.

*One verdict.* DeepSpeed's pipeline engine averages the loss over the data-parallel replicas and
broadcasts it from the last stage to the whole pipeline, so every rank judges the same number; the
reference is agreed through the job store at each recovery (a replacement has no history of its
own). A trip goes through the recovery protocol: every rank that trips declares the generation
failed with the reason and names it in :data:`ROLLBACK_KEY`; the rebuild then forces the global
checkpoint strategy for that recovery (:func:`forced_strategy`), on every rank, however each one
saw the failure. :data:`FIRST_TRIP_KEY` records the generation of the first trip: a trip in any
later generation ends the job (the launcher's abort key, then an error on every rank).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ds_swift.jobstore.agreement import agree, round_prefix
from ds_swift.logs import say
from ds_swift.recovery.base import Rider, loud
from ds_swift.recovery.registry import STRATEGIES

__all__ = ["FIRST_TRIP_KEY", "GuardTripped", "LossGuard", "ROLLBACK_KEY", "forced_strategy", "judge", "reference_of"]

#: pre-failure losses the divergence reference is taken over
WINDOW = 10
#: losses kept between recoveries, non-finite ones included until a recovery reads them
_KEPT = 4 * WINDOW
#: job-store key: the generation whose recovery must load the global checkpoint (the guard tripped)
ROLLBACK_KEY = "guard/rollback"
#: job-store key: the generation whose recovery served that request
SERVED_KEY = "guard/rollback_served"
#: job-store key: why the guard tripped (the step back's reason in its timeline)
REASON_KEY = "guard/reason"
#: job-store key: the generation of the guard's first trip
FIRST_TRIP_KEY = "guard/first_trip"
#: the launcher's abort key (launch/control.py): every agent stops the job with this reason
ABORT_KEY = "launch/abort"


class GuardTripped(RuntimeError):
    """The guard tripped a second time: the job ends instead of stepping back again."""


def reference_of(losses: Iterable[float]) -> float | None:
    """The divergence reference of a run's recent finite losses (None: none to judge by)."""
    finite = [x for x in losses if math.isfinite(x)]
    return max(finite) if finite else None


def judge(
    loss: float | None, reference: float | None, magnitude: float | None, factor: float, skipped: bool
) -> str | None:
    """Why ``loss`` trips the guard, or None.

    Args:
        loss: the iteration's loss (the same on every rank), None if the engine gave none.
        reference: the largest of the recent pre-failure losses (None: no history: only a
            non-finite loss trips).
        magnitude: the largest absolute value of those losses.
        factor: ``verify.guard_loss_factor``.
        skipped: the fp16 loss scaler skipped this iteration's step (an overflow, not a divergence).
    """
    if loss is None or skipped:
        return None
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if reference is None or magnitude is None:
        return None
    limit = reference + (factor - 1.0) * magnitude
    if loss > limit:
        return (
            f"the loss {loss:.6g} diverges from the run's trend before the failure (limit {limit:.6g}: "
            f"{factor:g} x the largest of its last {WINDOW} losses, {reference:.6g})"
        )
    return None


def forced_strategy(store: Any, configured: str) -> str:
    """The strategy a recovery must use: the global checkpoint while a guard trip is not yet served."""
    if store is None:
        return configured
    wanted = store.get(ROLLBACK_KEY)
    return STRATEGIES.fallback.name if wanted is not None and wanted != _served(store) else configured


def _served(store: Any) -> str | None:
    """The trip generation whose step back was served (SERVED_KEY holds ``<trip>:<recovery generation>``)."""
    value = store.get(SERVED_KEY)
    return value.split(":")[0] if value else None


@dataclass
class _Window:
    iterations: int
    start: int = 0
    reference: float | None = None
    magnitude: float | None = None

    def covers(self, iteration: int) -> bool:
        return self.start <= iteration < self.start + self.iterations


class LossGuard:
    """Watches the loss after each recovery; see the module docstring.

    Args:
        iterations: ``verify.guard_iterations`` (0: off).
        factor: ``verify.guard_loss_factor``.
        rank: this rank (for the loud lines).
        store: the job store (None: no recovery happens, nothing to guard).
    """

    def __init__(self, iterations: int, factor: float, rank: int, store: Any) -> None:
        self.iterations, self.factor, self.rank, self.store = iterations, factor, rank, store
        # Losses as the engine returned them (device tensors on a GPU), read at a recovery: a float()
        # per step would make the host wait for every iteration. Room for non-finite ones, dropped then.
        self.history: deque[tuple[int, Any]] = deque(maxlen=_KEPT)
        self.window: _Window | None = None
        self._judged = -1
        self._rider: Rider | None = None  # what the recovery in progress agrees for the guard
        self._skipped = 0

    def log(self, msg: str) -> None:
        """One line on ds-swift's channel, tagged with this rank."""
        say(msg, self.rank, name=__name__)

    def after_iteration(self, engine: Any, loss: Any, generation: int) -> str | None:
        """After iteration ``engine.global_steps - 1`` was trained: the reason it trips the guard
        (the caller recovers with it), or None. Raises :class:`GuardTripped` on a second trip."""
        iteration = int(engine.global_steps) - 1
        skipped_now = int(getattr(engine, "skipped_steps", 0) or 0)
        skipped, self._skipped = skipped_now > self._skipped, skipped_now
        if iteration <= self._judged or self.iterations <= 0 or self.store is None:
            return None
        self._judged = iteration
        win = self.window
        if win is None or not win.covers(iteration):
            if loss is not None and not skipped:
                self.history.append((iteration, loss.detach() if hasattr(loss, "detach") else loss))
            return None
        value = float(loss) if loss is not None else None  # in the window only: judged now
        why = judge(value, win.reference, win.magnitude, self.factor, skipped)
        if why is None:
            self.history.append((iteration, value))  # type: ignore[arg-type]  # judged finite
            return None
        return self._trip(
            f"iteration {iteration} (watched: {win.iterations} iterations from the recovery's resume "
            f"at {win.start}): {why}",
            generation,
        )

    def _trip(self, why: str, generation: int) -> str:
        first = self.store.get(FIRST_TRIP_KEY)
        if first is not None and first != str(generation):
            reason = (
                f"post-recovery guard: {why}; the guard already stepped back to the global checkpoint once "
                f"(generation {first}): ending the job instead of looping through restarts. Look for the cause "
                "(data, learning rate, hardware) and restart from a checkpoint you trust"
            )
            loud(self.rank, f"POST-RECOVERY GUARD TRIPPED AGAIN: {reason}")
            # launch/control.py's set_once: the first reason is the one the launcher reports.
            if self.store.add(f"{ABORT_KEY}/n", 1) == 1:
                self.store.set(ABORT_KEY, reason)
            raise GuardTripped(f"ds-swift: {reason}")
        loud(
            self.rank,
            f"POST-RECOVERY GUARD TRIPPED: {why}: EVERY RANK STEPS BACK TO THE GLOBAL CHECKPOINT (once; a "
            "second trip ends the job)",
        )
        why = f"post-recovery guard: {why}"
        self.store.set(FIRST_TRIP_KEY, str(generation))
        self.store.set(REASON_KEY, why)
        self.store.set(ROLLBACK_KEY, str(generation))  # last: the request is whole once it is there
        self.store.declare_failure(generation, why)
        return why

    def rider(self, generation: int) -> Rider | None:
        """What the guard agrees in the recovery of ``generation`` (ds_swift.recovery.base.Rider): the
        same as its own round (:meth:`_round`), in the restore round (None: the guard is off)."""
        if self.iterations <= 0 or self.store is None:
            return None
        self._rider = Rider(
            generation, lambda resume: ",".join(repr(x) for _, x in self._kept_before(resume)), self._decide
        )
        return self._rider

    def _kept_before(self, resume_iteration: int) -> list[tuple[int, float]]:
        """This rank's last finite losses before ``resume_iteration`` (at most WINDOW)."""
        read = [(i, float(x)) for i, x in self.history if i < resume_iteration]
        return [(i, x) for i, x in read if math.isfinite(x)][-WINDOW:]

    def _decide(self, lists: Mapping[int, str]) -> str:
        """The leader's verdict: the longest of the ranks' losses, and the step back the guard asked
        for and whether it was served, read once (before rank 0 marks it served)."""
        wanted, served = self.store.get(ROLLBACK_KEY), self.store.get(SERVED_KEY)
        return json.dumps({"losses": _longest(lists), "wanted": wanted, "served": served, "agreed": True})

    def _round(self, generation: int, world: int, timeout_s: float, mine: str) -> dict[str, Any]:
        """The guard's round (ds_swift.jobstore.agreement): survivors hold the same losses (every rank
        judges the broadcast one), replacements none: its verdict is the longest list, and the step
        back the guard asked for and whether it was served, read once by the leader."""

        try:
            said: dict[str, Any] = json.loads(
                agree(
                    self.store,
                    round_prefix(generation, "guard_ref"),
                    self.rank,
                    mine,
                    range(world),
                    self._decide,
                    timeout_s=timeout_s,
                    generation=generation,
                )
            )
            return said
        except Exception as exc:  # noqa: BLE001 - a timeout or the next failure: the guard must not end the job
            self.log(f"post-recovery guard: the ranks' losses not gathered ({type(exc).__name__}: {exc})")
        try:
            wanted, served = self.store.get(ROLLBACK_KEY), self.store.get(SERVED_KEY)
        except Exception:  # noqa: BLE001 - the store too: no step back is known to be pending
            wanted = served = None
        return {"losses": "", "wanted": wanted, "served": served, "agreed": False}

    def after_recovery(
        self, engine: Any, outcome: Any, generation: int, world: int, timeout_s: float, rank: int | None = None
    ) -> None:
        """Every rank of ``generation``, after its recovery (``outcome``): agree on the reference,
        open the window; a step back the guard asked for says so in its plan (and timeline).
        ``rank``: this rank in the new generation, which an elastic resize renumbers (its peers
        gather ``range(world)``: a rank publishing under its old number would never be found)."""
        if rank is not None:
            self.rank = rank
        resume_iteration = int(engine.global_steps)
        self._skipped = int(getattr(engine, "skipped_steps", 0) or 0)
        self._judged = resume_iteration - 1
        if self.iterations <= 0 or self.store is None:
            return
        kept = self._kept_before(resume_iteration)
        self.history = deque(kept, maxlen=_KEPT)
        rider, self._rider = self._rider, None
        if rider is not None and rider.generation == generation and rider.said is not None:
            said: dict[str, Any] = json.loads(rider.said)  # agreed in the recovery's restore round
        else:  # a fallback, a membership change: a round of its own
            said = self._round(generation, world, timeout_s, ",".join(repr(x) for _, x in kept))
        wanted, served = said["wanted"], said["served"]
        # Read once, by the round's leader, before rank 0 marks it served: the same answer on every rank.
        pending = wanted is not None and (
            served is None or served.split(":")[0] != wanted or served == f"{wanted}:{generation}"
        )
        if pending and outcome.plan.strategy == STRATEGIES.fallback.name:
            why = self.store.get(REASON_KEY) or "post-recovery guard"
            outcome.plan = dataclasses.replace(outcome.plan, reason=f"{why} (the guard's step back)")
            if self.rank == 0:  # after the recovery's last round: every rank has the request
                self.store.set(SERVED_KEY, f"{wanted}:{generation}")
        longest = said["losses"]
        losses = [float(x) for x in longest.split(",")] if longest else []
        if not losses and not said["agreed"]:
            loud(
                self.rank,
                f"post-recovery guard: no rank's losses gathered within {timeout_s:g} s: "
                "only a non-finite loss trips it this time",
            )
        ref = reference_of(losses)
        mag = max((abs(x) for x in losses), default=None)
        self.window = _Window(self.iterations, resume_iteration, ref, mag)
        self.log(
            f"post-recovery guard: iterations {resume_iteration}..{resume_iteration + self.iterations - 1} "
            f"watched (non-finite, or above {self.factor:g} x {ref if ref is not None else '-'})"
        )


def _longest(lists: Mapping[int, str]) -> str:
    """The longest of the ranks' loss lists."""
    return max(lists.values(), key=lambda v: len(v.split(",")) if v else 0, default="")
