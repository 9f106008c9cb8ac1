"""Protections a benchmark switched off, one at a time, to measure what each costs.

``benchmarks/gpu_overhead.py --breakdown`` runs the same job with every protection on, then with
one of them off at a time. The protections with a config field of their own are switched off
through it (``verify.enabled``, ``buddy.enabled``, ``checkpoint.interval``); the others have
none, because a user must not be able to lose them by accident, and are switched off here, by
the environment variable :data:`ENV` (comma-separated names of :data:`SWITCHES`), which only that
benchmark sets. Every worker that reads it says so at start-up in a warning (the variable may have
leaked from a benchmark's shell), and a recovery in such a job is not what the defaults would have
done: never set it for training.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["ENV", "SWITCHES", "switched_off"]

ENV = "SWIFT_BENCH_WITHOUT"

#: name -> what switching it off leaves out
SWITCHES: Mapping[str, str] = {
    "logging": "message logging and the step-collective records (logging-based recovery)",
    "undo": "update-undo's step records (a survivor ahead then reloads the checkpoint)",
    "determinism": "torch's deterministic algorithms (replays may differ from the first run)",
    "rng": "RNG keying per forward pass (replayed dropout may differ)",
    "wakeup": "SCHED_BATCH for ds-swift's background threads and its transport's gloo threads (they preempt "
    "the training thread when they wake, as before; ds_swift.threadname)",
    "watchdog": "the watchdog thread (heartbeats, failure-flag polls, hang detection) and the failure-flag "
    "checks after every receive and before every iteration",
}


def switched_off(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The protections :data:`ENV` names (empty when unset). Raises ValueError on an unknown name."""
    raw = (os.environ if env is None else env).get(ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(SWITCHES))
    if unknown:
        raise ValueError(
            f"{ENV}={raw!r}: unknown protection(s) {unknown}; known: {', '.join(SWITCHES)} "
            "(unset it to keep every protection on)"
        )
    return names
