"""What becomes of a failed machine: the node agent's failure handling (:class:`MachineFate`).

The agent that sees a machine fail (its own, or a dead agent's: launch/liveness.py) declares the
generation failed in the job store, records the failure's timeline, and decides, in this order: a
spare takes the machine over, if one is left; with ``--elastic`` the job goes on without it (a
shrink); with ``--restart-delay`` its own agent restarts its ranks; otherwise, or past
``--max-failures``, the job is aborted. The decision is written to the store for the workers
(``launch/fate/<g>/<m>``).
"""

from __future__ import annotations

import time

from ds_swift.jobstore.membership import JobStore

from .control import EventLog, JobControl
from .job import JobSpec

__all__ = ["MachineFate"]


class MachineFate:
    """One agent's handling of machine failures.

    Args:
        node: the agent's node (named in its events).
        control: the agents' keys in the job store (spares, failures counter, abort).
    """

    def __init__(self, node: int, job: JobSpec, store: JobStore, control: JobControl, events: EventLog) -> None:
        self.node = node
        self.job = job
        self.store = store
        self.control = control
        self.events = events
        #: a spare was requested since the launcher last asked (:meth:`take_request`)
        self.requested = False

    def handle(
        self, machine: int, reason: str, t_detected: float, own: bool, generation: int | None = None, **fields: object
    ) -> tuple[str, int]:
        """Declare ``machine``'s failure, then request a spare; returns its fate ("spare", "restart",
        "shrink" or "abort") and the generation the failure ends."""
        failed_generation, declared = self._declare(reason, generation)
        t_declared = time.time()
        self.control.record_failure_timeline(failed_generation, machine, t_detected, t_declared)
        t_fire = self._injected_kill_time(machine, t_detected)
        latency = ""
        if t_fire is not None:
            fields = {
                **fields,
                "kill_to_detected_ms": (t_detected - t_fire) * 1e3,
                "kill_to_flag_ms": (t_declared - t_fire) * 1e3,
            }
            latency = (
                f" (injected kill -> seen {fields['kill_to_detected_ms']:.1f} ms, "
                f"-> gen{failed_generation}/failed {fields['kill_to_flag_ms']:.1f} ms)"
            )
        self.events(
            f"{reason}: generation {failed_generation} failed{'' if declared else ' (already declared)'}{latency}",
            event="failure",
            node=self.node,
            machine=machine,
            generation=failed_generation,
            declared=declared,
            t_detected=t_detected,
            t_declared=t_declared,
            **fields,
        )
        fate = self._fate(machine, failed_generation, reason, own)
        self.control.set_fate(failed_generation, machine, fate)
        return fate, failed_generation

    def take_request(self) -> bool:
        """Whether a spare was requested since the last call (the launcher then looks at the store
        at once, so that a spare it runs takes over now rather than at its next look)."""
        requested, self.requested = self.requested, False
        return requested

    def one_too_many(self, reason: str) -> bool:
        """Count a failure; past ``--max-failures`` the job is aborted with ``reason`` (True)."""
        count = self.control.record_failure()
        if count <= self.job.max_failures:
            return False
        self.control.abort(f"{reason}; that is failure {count}, more than --max-failures {self.job.max_failures}")
        return True

    def _declare(self, reason: str, generation: int | None = None) -> tuple[int, bool]:
        """Declare the generation in force (or ``generation``: the one a group of machines was killed
        in) failed; returns (the generation this failure ends, first declarer)."""
        if generation is not None:
            return generation, self.store.declare_failure(generation, reason)
        g = self.store.generation()
        if g >= 1 and not self.store.joined(g, [0]) and self.store.failure(g - 1) is not None:
            # The join of g has not begun (its leader, rank 0, has not arrived), so this machine's
            # dead ranks are not in it: g-1's failure covers them (a survivor saw the broken
            # connection first, or another machine died at the same moment, or a replacement died
            # before joining). g can still form, with this machine's replacement; failing it too
            # would only cost every rank one more round.
            return g - 1, False
        return g, self.store.declare_failure(g, reason)

    def _fate(self, machine: int, failed_generation: int, reason: str, own: bool) -> str:
        """What becomes of the failed ``machine``: "spare", "restart", "shrink" or "abort"."""
        if self.one_too_many(reason):
            return "abort"
        if self.job.num_spares > 0:
            slot = self.control.take_spare()
            if slot <= self.job.num_spares:
                self.control.request_replacement(slot, machine, failed_generation)
                self.requested = True
                self.events(
                    f"machine {machine}: spare {slot} of {self.job.num_spares} requested",
                    event="spare_requested",
                    node=self.node,
                    machine=machine,
                    slot=slot,
                )
                return "spare"
        if self.job.elastic:
            left = self.control.remove_machine(machine, self.job.num_machines)
            if left:
                back = (
                    f"; it comes back after {self.job.restart_delay_s:g} s"
                    if own and self.job.restart_delay_s is not None
                    else ""
                )
                self.events(
                    f"machine {machine}: no spare left; the job goes on without it on machines {left} "
                    f"(--elastic){back}",
                    event="shrink",
                    node=self.node,
                    machine=machine,
                    machines=left,
                )
                return "shrink"
        if own and self.job.restart_delay_s is not None:
            return "restart"
        why = (
            f"all {self.job.num_spares} spares are in use" if self.job.num_spares else "no spare machines (--spares 0)"
        )
        if not own:
            why += " (a dead agent's machine cannot restart in place)"
        elif self.job.restart_delay_s is None:
            why += " and no --restart-delay"
        self.control.abort(f"{reason}; no replacement: {why}")
        return "abort"

    def _injected_kill_time(self, machine: int, t_detected: float) -> float | None:
        """When an injected fault killed a rank of ``machine`` just before (for the latency line)."""
        times = []
        for i, spec in enumerate(self.job.inject):
            if machine in spec.machines:
                value = self.store.get(f"inject/{i}/t_fire")
                if value is not None and 0 <= t_detected - float(value) < 60:
                    times.append(float(value))
        return max(times) if times else None
