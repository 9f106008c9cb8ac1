"""Multi-host: each agent's liveness in the job store, watched by the others.

A machine that dies whole (power, kernel panic, a SIGKILLed agent) takes its agent along, so
nobody is left to see its ranks die and request a spare. Every agent therefore bumps a counter
``launch/alive/<node>`` each beat, and its nearest live agents around the ring watch it (a bounded
set: :class:`AgentLiveness`): one that has not moved for ``timeout_s`` of the watcher's own monotonic clock (no cross-host clock
comparison, :class:`ds_swift.detect.beats.CounterClock`, shared with the workers' watchdogs) is
dead, and the first watcher to claim ``launch/lost/<node>`` handles its machine's
failure as that agent would have. This only helps where the store is not inside the dead agent:
``--store etcd://...`` (or a TCPStore on the launch host). A watcher cut off from the store itself
(an error, or a stall longer than a few beats) starts every silence afresh: a stalled store stalls
every agent's beat, and is no agent's death.

Keys (besides :mod:`.control`'s)::

    launch/alive/<node>          counter bumped by agent <node> every beat
    launch/gone/<node>           agent <node> ended normally (not a death)
    launch/machine_of/<node>     the machine agent <node> runs now ("" when none: a spare or retired)
    launch/lost/<node>           set once by the watcher that handles agent <node>'s death
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ds_swift.detect.beats import CounterClock
from ds_swift.jobstore.membership import JobStore

from .control import JobControl

__all__ = ["AgentLiveness"]

#: an agent that never beat gets this long (Python and torch imports on a busy host) before it counts as dead
FIRST_BEAT_GRACE_S = 60.0
#: live agents watched on each side around the ring of agents
WATCHED = 2


class AgentLiveness:
    """Beats for this process's agents and finds the dead ones among its ring neighbours.

    Every agent watches its :data:`WATCHED` nearest live agents on each side in node order (skipping
    the ones found dead or gone), so every agent is watched by up to twice that many, whatever the
    job's size: watching every other agent cost each one a read per agent per beat, O(machines^2)
    for the job. Two consecutive dead agents are still each watched by a live one; a third found
    dead moves the watch on to the next live agent."""

    def __init__(
        self,
        store: JobStore,
        own_nodes: list[int],
        num_agents: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.clock = clock
        self.control = JobControl(store)
        self.own = list(own_nodes)
        self.num_agents = num_agents
        self.timeout_s = timeout_s
        self.beat_s = max(0.05, timeout_s / 5)
        self._next_beat = 0.0
        # A gap of more than 3 beats between two looks: this watcher's own store stalled.
        self._beats: CounterClock[int] = CounterClock(
            timeout_s, clock=clock, max_gap_s=3 * self.beat_s, first_grace_s=FIRST_BEAT_GRACE_S
        )
        self._dead: set[int] = set()
        now = clock()
        for node in self.watched():
            self._beats.observe(node, 0, now)
        self._counts = {node: store.add(f"launch/alive/{node}", 0) for node in self.own}

    @property
    def others(self) -> list[int]:
        return [n for n in range(self.num_agents) if n not in self.own]

    def watched(self) -> list[int]:
        """The live agents this process watches: the nearest :data:`WATCHED` on each side of each of
        its own agents, in node order around the ring, past the ones found dead."""
        out: set[int] = set()
        for node in self.own:
            for step in (1, -1):
                found, other = 0, node
                for _ in range(self.num_agents - 1):
                    other = (other + step) % self.num_agents
                    if other in self.own or other in self._dead:
                        continue
                    out.add(other)
                    found += 1
                    if found == WATCHED:
                        break
        return sorted(out)

    def step(self) -> list[int]:
        """Beat if due; return the agents newly found dead (checked once per beat)."""
        if self.clock() < self._next_beat:
            return []
        now = self._beats.begin_round()
        self._next_beat = now + self.beat_s
        try:
            found = self._look(now)
        except Exception:
            self._beats.store_error()
            raise
        self._beats.end_round()
        return found

    def pause_s(self) -> float:
        """Until the next beat is due."""
        return max(0.0, self._next_beat - self.clock())

    def _look(self, now: float) -> list[int]:
        for node in self.own:  # each agent is its counter's one writer: a signed set, no compare-and-swap
            self._counts[node] += 1
            self.store.set(f"launch/alive/{node}", str(self._counts[node]))
        found = []
        for node in self.watched():
            count = self.store.add(f"launch/alive/{node}", 0)
            if self._beats.stale(node, count, now) is not None and self.store.get(f"launch/gone/{node}") is None:
                self._dead.add(node)
                found.append(node)
        return found

    def silent_for(self, node: int) -> float:
        return self._beats.silent_for(node)

    def claim(self, node: int) -> bool:
        """True for the one watcher that handles agent ``node``'s death."""
        return self.control.set_once(f"launch/lost/{node}", "1")

    def leave(self) -> None:
        """This process's agents end normally: watchers must not take that for a death."""
        for node in self.own:
            self.store.set(f"launch/gone/{node}", "1")
