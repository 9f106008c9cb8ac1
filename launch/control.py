"""What node agents tell each other through the job store, and the launcher's event log.

Agents never talk to each other directly: on one host they are simulated side by side, across
hosts they are separate processes, and the same keys serve both. All keys sit under the job
prefix next to :mod:`ds_swift.jobstore.membership`'s (``launch/`` for the agents' own protocol, and the
``gen<g>/...`` timeline keys the workers' recovery timeline reads)::

    launch/abort                 why the job gives up (first writer wins); every agent kills its workers
    launch/failures              counter of machine failures seen (bounded by --max-failures)
    launch/spares_taken          counter of spares handed out; value s -> request s
    launch/replace/<s>           "<machine>:<failed generation>": a spare must take over that machine
    launch/replace/<s>/claim     counter; the spare that moved it to 1 owns the request
    launch/done/<m>              every current rank of machine m exited 0 ("removed": it left the job)
    launch/done_count            how many machines are done (unsigned: a hint, see JobControl.all_done)
    launch/layout                the job's machines in rank order (JSON), after an elastic shrink or grow
    launch/fate/<g>/<m>          what became of machine m, failed in generation g: spare, restart, shrink or abort
    launch/grow/<g>              machine m came back (--elastic with --restart-delay): generation g ends for it
    launch/exited                agents (other than 0) that saw the end; agent 0 keeps the store up until all did
    gen<g>/failed_machine        the machine whose failure ended generation g (first one, if several)
    gen<g>/t/detected            time.time() when that machine's agent saw the death
    gen<g>/t/declared            time.time() when the agent had set gen<g>/failed
    gen<g>/t/replacement_spawned time.time() when the replacement workers were started
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ds_swift.jobstore.layout import LAYOUT_KEY, fate_key, grown_layout, read_layout
from ds_swift.jobstore.membership import JobStore
from ds_swift.logs import say

__all__ = ["DONE_COUNT", "EventLog", "JobControl"]

DONE_COUNT = "launch/done_count"


class JobControl:
    """The agents' keys in the job store (see the module docstring)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    # ------------------------------------------------------------------ end of the job
    def abort(self, reason: str) -> bool:
        """Ask every agent to stop the job; True if this reason is the one recorded."""
        return self.set_once("launch/abort", reason)

    def abort_reason(self) -> str | None:
        return self.store.get("launch/abort")

    def mark_machine_done(self, machine: int) -> None:
        self.store.set(f"launch/done/{machine}", "1")
        self._count_done(1)

    def _count_done(self, amount: int) -> None:
        if not hasattr(self.store.raw, "count"):  # etcd counts the marks themselves (done_count)
            self.store.kv.add(DONE_COUNT, amount)

    def done_count(self) -> int:
        """How many machines are marked done (unsigned: a hint, see :meth:`all_done`): one request,
        a TCPStore's atomic counter, or etcd's count of the marks (its add would be a compare-and-swap
        that machines finishing together retry)."""
        count = getattr(self.store.raw, "count", None)
        if count is not None:
            return int(count(self.store.prefix + "launch/done/"))
        return int(self.store.kv.add(DONE_COUNT, 0))

    def all_done(self, num_machines: int) -> bool:
        """Every machine marked done: one request while the count says not yet (an unsigned hint,
        never trusted alone); then the signed marks, one batched read, so that a count or a mark
        written by someone without the job secret cannot end the job. Reading one mark per machine
        at every look was O(machines) per launcher, O(machines^2) for a multi-host job."""
        if self.done_count() < num_machines:
            return False
        keys = [f"launch/done/{m}" for m in range(num_machines)]
        return bool(self.store.kv.check(keys)) and all(v is not None for v in self.store.read_present(keys))

    def ack_exit(self) -> None:
        self.store.add("launch/exited", 1)

    def exits(self) -> int:
        return self.store.add("launch/exited", 0)

    # ------------------------------------------------------------------ failures and spares
    def record_failure(self) -> int:
        """Count one machine failure; returns its number (1 for the first of the job)."""
        return self.store.add("launch/failures", 1)

    def failures(self) -> int:
        return self.store.add("launch/failures", 0)

    def take_spare(self) -> int:
        """Reserve a spare; the result ``s`` is usable iff ``s <= --spares``."""
        return self.store.add("launch/spares_taken", 1)

    def spares_taken(self) -> int:
        return self.store.add("launch/spares_taken", 0)

    def request_replacement(self, slot: int, machine: int, failed_generation: int) -> None:
        self.store.set(f"launch/replace/{slot}", f"{machine}:{failed_generation}")

    def request(self, slot: int) -> tuple[int, int] | None:
        """(machine, failed generation) of request ``slot``, or None while it is not written yet."""
        value = self.store.get(f"launch/replace/{slot}")
        if value is None:
            return None
        machine, _, gen = value.partition(":")
        return int(machine), int(gen)

    def set_fate(self, failed_generation: int, machine: int, fate: str) -> None:
        """Tell the survivors what becomes of ``machine`` (spare, restart, shrink, abort)."""
        self.store.set(fate_key(failed_generation, machine), fate)

    def remove_machine(self, machine: int, num_machines: int) -> list[int]:
        """The job goes on without ``machine`` (an elastic shrink); returns the machines left."""
        layout = [m for m in read_layout(self.store, num_machines) if m != machine]
        if layout:
            self.store.set(LAYOUT_KEY, json.dumps(layout))
            self.store.set(f"launch/done/{machine}", "removed")
            self._count_done(1)
        return layout

    def return_machine(self, machine: int, num_machines: int) -> list[int]:
        """``machine`` rejoins the job after a shrink, last in rank order; returns the layout."""
        layout = grown_layout(read_layout(self.store, num_machines), machine)
        self.store.set(LAYOUT_KEY, json.dumps(layout))
        if self.store.delete(f"launch/done/{machine}"):
            self._count_done(-1)
        return layout

    def claim(self, slot: int) -> bool:
        return self.store.add(f"launch/replace/{slot}/claim", 1) == 1

    # ------------------------------------------------------------------ timeline
    def set_once(self, key: str, value: str) -> bool:
        """Set ``key`` unless some caller did before; True if this call set it.

        A counter decides, not compare_set: compare_set reports success by returning the value,
        which cannot tell "I set it" from "someone set the same value before".
        """
        if self.store.add(f"{key}/n", 1) != 1:
            return False
        self.store.set(key, value)
        return True

    def record_failure_timeline(self, generation: int, machine: int, t_detected: float, t_declared: float) -> bool:
        """The first failed machine of a generation owns its timeline keys; True for that one."""
        if not self.set_once(f"gen{generation}/failed_machine", str(machine)):
            return False
        self.store.set(f"gen{generation}/t/detected", repr(t_detected))
        self.store.set(f"gen{generation}/t/declared", repr(t_declared))
        return True

    def record_replacement_spawned(self, generation: int, t: float) -> None:
        self.set_once(f"gen{generation}/t/replacement_spawned", repr(t))


class EventLog:
    """One ``[ds-swift-launch]`` line per event on stderr, and a JSON line in the run directory."""

    def __init__(self, run_dir: str | None, node: int | None = None) -> None:
        self.path: str | None = None
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
            name = "launcher-events.jsonl" if node is None else f"launcher-events.node{node}.jsonl"
            self.path = os.path.join(run_dir, name)

    def __call__(self, message: str, **fields: Any) -> None:
        say(message, name=__name__, prefix="ds-swift-launch")
        if self.path is not None:
            record = {"t": time.time(), "message": message, **fields}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
