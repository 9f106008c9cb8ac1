"""Failure injection: kill every worker of a machine (or of several at one instant) at a chosen
iteration and phase, once.

``ds-swift-launch --inject machine=1,iteration=7,phase=backward`` validates the spec, and every
worker receives the normalised list in ``SWIFT_INJECT``. The worker side builds an
:class:`Injector` and calls :meth:`Injector.maybe_fire` from its engine hooks. The first rank of
machine 1 to reach iteration 7's backward pass SIGKILLs itself; its node agent sees the death
and kills the rest of the machine, exactly as it handles a real crash.

``machine=1+2,iteration=7,phase=backward`` kills machines 1 and 2 at one instant: the first rank
of either to reach the point fires for both. It writes ``inject/<i>/kill`` (the job's generation)
and SIGKILLs itself; the agents of the group's machines kill them on that key, and none declares
the failure until every machine of the group is down (``inject/<i>/down``), so that all of them
fail together, in one generation. Two separate specs at the same point instead fire as each
machine's own rank reaches it: under load, in two generations.

Each spec fires once per job: the decision is ``store.add('inject/<i>/fired', 1) == 1`` in the
job store, so neither a sibling rank of the same machine nor a replacement worker that later
re-runs iteration 7 fires it again. Without that, a replacement would kill itself at the same
point forever.

Keys (relative to the job prefix, ``i`` = the spec's index in ``SWIFT_INJECT``)::

    inject/<i>/fired      counter; the rank that moved it to 1 fired
    inject/<i>/t_fire     time.time() just before the SIGKILL
    inject/<i>/rank       the rank that fired
    inject/<i>/kill       a group spec fired: the generation it fired in (the agents kill the group)
    inject/<i>/down       counter: machines of the group that are down (their agents add 1 each)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ds_swift.logs import say

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import WorkerEnv

__all__ = [
    "PHASES",
    "FaultSpec",
    "FaultSpecError",
    "Injector",
    "fire_time_key",
    "format_specs",
    "group_down_key",
    "group_kill_key",
    "unfired",
]

#: the points of an iteration where a fault can be injected (the worker side calls maybe_fire there)
PHASES = (
    "forward",
    "backward",
    "step",
    "send",
    "recv",
    "reduce",
)  # reduce: before the data-parallel gradient reduction
_FIELDS = ("machine", "iteration", "phase", "settled")
_EXAMPLE = "machine=1,iteration=7,phase=backward"


def group_kill_key(index: int) -> str:
    """Set (to the generation) when group spec ``index`` fired: every machine of it is to be killed now."""
    return f"inject/{index}/kill"


def group_down_key(index: int) -> str:
    """Counter of group spec ``index``'s machines whose agents killed them."""
    return f"inject/{index}/down"


def fire_time_key(index: int) -> str:
    """Set (``time.time()``) just before spec ``index``'s SIGKILL: absent, the spec never fired."""
    return f"inject/{index}/t_fire"


def unfired(specs: Sequence[FaultSpec], store: _Counter) -> str | None:
    """What the launcher says at a job's end about specs that never fired (None: all did). A spec
    past the job's last iteration, or of a phase the job never runs, tests nothing."""
    missed = [f"#{i} ({s})" for i, s in enumerate(specs) if store.get(fire_time_key(i)) is None]
    if not missed:
        return None
    return (
        f"--inject {', '.join(missed)} never fired: no rank of the machine reached that iteration and phase "
        "before the job ended (iterations count from 0; a job of N iterations runs 0..N-1)"
    )


class FaultSpecError(ValueError):
    """A ``--inject`` spec is malformed. The message names the field and what is allowed."""


class _Counter(Protocol):
    """What the injector needs of the job store (JobStore satisfies it; tests pass a dict-backed fake)."""

    def add(self, key: str, amount: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def generation(self) -> int: ...

    def get(self, key: str) -> str | None: ...

    def wait_value(self, key: str, timeout_s: float) -> str | None: ...


#: how long a ``settled`` spec waits for the copies of the iteration before (then fires anyway, saying so)
SETTLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FaultSpec:
    """Kill every worker of ``machine`` (and of ``machines``, at the same instant) when one of them
    reaches ``phase`` of ``iteration``."""

    machine: int
    """Machine id (``0 .. nnodes-1``); a replacement of that machine carries the same id."""

    iteration: int
    """Training iteration (0-based, as the worker side counts its ``train_batch`` calls)."""

    phase: str = "forward"
    """One of :data:`PHASES`."""

    machines: tuple[int, ...] = ()
    """Every machine killed together (``machine`` first; empty: ``machine`` alone). Written
    ``machine=1+2`` in a spec."""

    settled: bool = False
    """Fire only once every rank's buddy (or erasure-coded) copies of the iteration before have
    landed (``settled=1``): they are sent in the background during the iteration, so a kill early
    in it may find them one step behind, and a test of what happens otherwise would be left to chance."""

    def __post_init__(self) -> None:
        if not self.machines:
            object.__setattr__(self, "machines", (self.machine,))
        for m in self.machines:
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise FaultSpecError(f"fault spec: machine={m!r} is invalid: a machine id >= 0")
        if self.machines[0] != self.machine:
            raise FaultSpecError(f"fault spec: machines={self.machines} must start with machine={self.machine}")
        if len(set(self.machines)) != len(self.machines):
            raise FaultSpecError(f"fault spec: machine={'+'.join(map(str, self.machines))} names a machine twice")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise FaultSpecError(f"fault spec: iteration={self.iteration!r} is invalid: an iteration >= 0")
        if self.phase not in PHASES:
            raise FaultSpecError(f"fault spec: phase={self.phase!r} is invalid: one of {'|'.join(PHASES)}")

    @property
    def group(self) -> bool:
        """Several machines, killed at one instant."""
        return len(self.machines) > 1

    def __str__(self) -> str:
        settled = ",settled=1" if self.settled else ""
        return f"machine={'+'.join(map(str, self.machines))},iteration={self.iteration},phase={self.phase}{settled}"

    @classmethod
    def parse(cls, text: str) -> list[FaultSpec]:
        """Parse ``machine=M,iteration=I[,phase=P]`` specs separated by ``;`` (empty text: none)."""
        return [cls._parse_one(part.strip()) for part in text.split(";") if part.strip()]

    @classmethod
    def _parse_one(cls, text: str) -> FaultSpec:
        fields: dict[str, str] = {}
        if any(len(item.split()) > 1 and item.count("=") > 1 for item in text.split(",")):
            raise FaultSpecError(f"fault spec {text!r}: separate its fields with commas, not spaces (e.g. {_EXAMPLE})")
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not key or not value:
                raise FaultSpecError(f"fault spec {text!r}: {item.strip()!r} is not field=value (e.g. {_EXAMPLE})")
            if key not in _FIELDS:
                raise FaultSpecError(
                    f"fault spec {text!r}: unknown field {key!r}; the fields are {', '.join(_FIELDS)} (e.g. {_EXAMPLE})"
                )
            if key in fields:
                raise FaultSpecError(f"fault spec {text!r}: field {key!r} is given twice")
            fields[key] = value
        for key in ("machine", "iteration"):
            if key not in fields:
                raise FaultSpecError(f"fault spec {text!r} lacks {key}= (e.g. {_EXAMPLE})")
        try:
            iteration = int(fields["iteration"])
        except ValueError:
            raise FaultSpecError(
                f"fault spec {text!r}: iteration={fields['iteration']!r} is invalid: a non-negative integer"
            ) from None
        try:
            machines = tuple(int(m) for m in fields["machine"].split("+"))
        except ValueError:
            raise FaultSpecError(
                f"fault spec {text!r}: machine={fields['machine']!r} is invalid: a non-negative integer, or several "
                "joined by + (machine=1+2: machines 1 and 2 at one instant)"
            ) from None
        phase = fields.get("phase", "forward").lower()
        settled = fields.get("settled", "0")
        if settled not in ("0", "1"):
            raise FaultSpecError(f"fault spec {text!r}: settled={settled!r} is invalid: 0 or 1")
        try:
            return cls(machine=machines[0], iteration=iteration, phase=phase, machines=machines, settled=settled == "1")
        except FaultSpecError as exc:
            raise FaultSpecError(f"fault spec {text!r}: {str(exc).removeprefix('fault spec: ')}") from None


def format_specs(specs: Sequence[FaultSpec]) -> str:
    """The ``SWIFT_INJECT`` value: normalised specs joined by ``;`` (parse(format(x)) == x)."""
    return ";".join(str(s) for s in specs)


def _landed_key(generation: int, iteration: int) -> str:
    """The key the buddy round of ``iteration`` sets once every rank's copies landed."""
    from ds_swift.jobstore.membership import JobStore

    return JobStore.buddy_done_key(generation, iteration)


def _sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Injector:
    """Fires the specs that target this worker's machine, each at most once per job.

    Args:
        specs: every spec of the job, in ``SWIFT_INJECT`` order (the index keys the store).
        store: the job store (:class:`ds_swift.jobstore.membership.JobStore`).
        machine: this worker's machine id (``SWIFT_MACHINE``).
        rank: this worker's rank, recorded with the firing (for the timeline and messages).
        kill: what firing does; SIGKILL of this process by default. Tests pass a recorder.
    """

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        store: _Counter,
        machine: int,
        rank: int | None = None,
        kill: Callable[[], None] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.store = store
        self.machine = machine
        self.rank = rank
        self._kill = kill or _sigkill_self
        # Only this machine's specs are looked at per call: maybe_fire runs in every hook.
        self._mine = [(i, s) for i, s in enumerate(self.specs) if machine in s.machines]
        # Specs already decided in this process: the store is asked once per spec, not per call.
        self._decided: set[int] = set()
        self.fired_specs: list[FaultSpec] = []

    @classmethod
    def from_env(cls, store: _Counter, env: WorkerEnv | None = None) -> Injector:
        """The injector for a worker started by ``ds-swift-launch`` (reads SWIFT_INJECT)."""
        from ds_swift.jobstore.membership import WorkerEnv

        env = env or WorkerEnv.from_env()
        return cls(FaultSpec.parse(env.inject), store, machine=env.machine, rank=env.rank)

    @property
    def fired(self) -> int:
        """How many specs this injector fired (only visible when ``kill`` does not end the process)."""
        return len(self.fired_specs)

    @property
    def armed(self) -> bool:
        """True while some spec for this machine may still fire here."""
        return any(i not in self._decided for i, _ in self._mine)

    def _settle(self, iteration: int) -> None:
        """Wait until the copies of ``iteration - 1`` landed on every rank (a ``settled`` spec)."""
        key = _landed_key(self.store.generation(), iteration - 1)
        if self.store.wait_value(key, SETTLE_TIMEOUT_S) is None:
            say(
                f"the copies of iteration {iteration - 1} did not land within {SETTLE_TIMEOUT_S:.0f} s: firing anyway",
                name=__name__,
                prefix="ds-swift inject",
            )

    def maybe_fire(self, phase: str, iteration: int) -> None:
        """Fire a spec matching (this machine, ``iteration``, ``phase``) that no rank fired yet."""
        if phase not in PHASES:
            # A typo in a hook name would silently never fire: fail loudly instead.
            raise ValueError(f"maybe_fire: phase={phase!r} is not one of {'|'.join(PHASES)}")
        for i, spec in self._mine:
            if spec.iteration != iteration or spec.phase != phase or i in self._decided:
                continue
            self._decided.add(i)
            if int(self.store.add(f"inject/{i}/fired", 1)) != 1:
                continue  # a sibling rank fired it, or it fired before this worker was a replacement
            if spec.settled:  # only the rank that fires waits (a replacement redoing the iteration must not)
                self._settle(iteration)
            self.store.set(fire_time_key(i), repr(time.time()))
            if self.rank is not None:
                self.store.set(f"inject/{i}/rank", str(self.rank))
            if spec.group:  # the agents of every machine of the group kill theirs on this key
                self.store.set(group_kill_key(i), str(self.store.generation()))
            self.fired_specs.append(spec)
            who = f"rank {self.rank}" if self.rank is not None else f"pid {os.getpid()}"
            together = f", machines {'+'.join(map(str, spec.machines))} at once" if spec.group else ""
            say(f"{who}: firing #{i} ({spec}{together}): SIGKILL", name=__name__, prefix="ds-swift inject")
            self._kill()
