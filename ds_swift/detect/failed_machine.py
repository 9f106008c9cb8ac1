"""The machine whose failure ended a generation, as a survivor learns it before joining the next one."""

from __future__ import annotations

from ds_swift.jobstore.membership import JobStore

__all__ = ["FailedMachine", "ensure_generation_moved", "wait_failed_machine"]


class FailedMachine:
    """A survivor's look, before it joins the next generation, at the machine whose failure ended
    ``generation``, as its agent records it (launch/control.py ``record_failure_timeline``), waited
    for once, at most ``timeout_s``, whoever asks first. An agent records it after its declaration,
    the generation's move included, so where the record comes the generation has moved; where none
    comes (a failure a worker declared), or nobody asks, the generation is moved here before the
    join (its first declarer may have died half-way: the job must not stay in a failed generation).
    Three requests where an agent declared (a wait, the check that a write woke it, a read), as
    against a read of the generation, a wait, a check and a read."""

    def __init__(self, store: JobStore, generation: int, timeout_s: float) -> None:
        self.store, self.generation, self.timeout_s = store, generation, timeout_s
        self._known: list[int | None] = []

    def __call__(self) -> int | None:
        """The machine; None: no agent recorded one within the timeout (nobody dead)."""
        if not self._known:
            machine = wait_failed_machine(self.store, self.generation, self.timeout_s)
            if machine is None:
                ensure_generation_moved(self.store, self.generation)
            self._known.append(machine)
        return self._known[0]

    def settle(self) -> None:
        """Before the join: the generation has moved on (one request, where nobody asked for the machine)."""
        if not self._known:
            ensure_generation_moved(self.store, self.generation)


def ensure_generation_moved(store: JobStore, generation: int) -> None:
    """Move the job's generation past a failed one (only from ``generation``: never backwards)."""
    store.advance_generation(generation)


def wait_failed_machine(store: JobStore, generation: int, timeout_s: float) -> int | None:
    """The machine whose failure ended ``generation``, as its node agent records it (None if no
    agent says so within ``timeout_s``: a failure declared by a worker, with nobody dead)."""
    machine = store.wait_value(f"gen{generation}/failed_machine", timeout_s)
    return int(machine) if machine is not None else None
