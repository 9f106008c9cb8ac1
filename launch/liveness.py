"""Multi-host: each agent's liveness in the job store, watched by the others.

A machine that dies whole (power, kernel panic, a SIGKILLed agent) takes its agent along, so
nobody is left to see its ranks die and request a spare. Every agent therefore bumps a counter
``launch/alive/<node>`` each beat, and every other agent watches the counters it can see: one
that has not moved for ``timeout_s`` of the watcher's own monotonic clock (no cross-host clock
comparison) is dead, and the first watcher to claim ``launch/lost/<node>`` handles its machine's
failure as that agent would have. This only helps where the store is not inside the dead agent:
``--store etcd://...`` (or a TCPStore on the launch host).

Keys (besides :mod:`.control`'s)::

    launch/alive/<node>          counter bumped by agent <node> every beat
    launch/gone/<node>           agent <node> ended normally (not a death)
    launch/machine_of/<node>     the machine agent <node> runs now ("" when none: a spare or retired)
    launch/lost/<node>           set once by the watcher that handles agent <node>'s death
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ds_swift.membership import JobStore

from .control import JobControl

__all__ = ["AgentLiveness"]

#: an agent that never beat gets this long (Python and torch imports on a busy host) before it counts as dead
FIRST_BEAT_GRACE_S = 60.0


class AgentLiveness:
    """Beats for this process's agents and finds the dead ones among the others."""

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
        self.others = [n for n in range(num_agents) if n not in self.own]
        self.timeout_s = timeout_s
        self.beat_s = max(0.05, timeout_s / 5)
        self._next_beat = 0.0
        now = clock()
        self._seen: dict[int, tuple[int, float]] = {n: (0, now) for n in self.others}
        self._dead: set[int] = set()

    def step(self) -> list[int]:
        """Beat if due; return the agents newly found dead (checked once per beat)."""
        now = self.clock()
        if now < self._next_beat:
            return []
        self._next_beat = now + self.beat_s
        for node in self.own:
            self.store.add(f"launch/alive/{node}", 1)
        found = []
        for node in self.others:
            if node in self._dead:
                continue
            count = self.store.add(f"launch/alive/{node}", 0)
            last, since = self._seen[node]
            if count != last:
                self._seen[node] = (count, now)
                continue
            limit = self.timeout_s if count > 0 else max(self.timeout_s, FIRST_BEAT_GRACE_S)
            if now - since > limit and self.store.get(f"launch/gone/{node}") is None:
                self._dead.add(node)
                found.append(node)
        return found

    def silent_for(self, node: int) -> float:
        return self.clock() - self._seen[node][1]

    def claim(self, node: int) -> bool:
        """True for the one watcher that handles agent ``node``'s death."""
        return self.control.set_once(f"launch/lost/{node}", "1")

    def leave(self) -> None:
        """This process's agents end normally: watchers must not take that for a death."""
        for node in self.own:
            self.store.set(f"launch/gone/{node}", "1")
