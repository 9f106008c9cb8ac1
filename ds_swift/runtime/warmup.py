"""The warm-up allowance: a generation's first iterations get a longer op timeout, scaled from its start-up.

A job's first iterations are slower by nature: memory is allocated, kernels are compiled or tuned,
communicators are created lazily (NCCL's on first use), caches are cold; after a recovery the
replacements' are all of that, and every rank waits for them. Measured: a healthy 25M-parameter
bf16 job on a CPU without bf16 instructions took longer than its 15 s op timeout in its first
iteration, was declared a stall and re-formed (13.6 s) for nothing. The op timeout is for a peer
that stopped answering, not for a slow first step.

So the first :data:`ITERATIONS` iterations of each generation run with
``min(cap, max(op timeout, FACTOR x start-up))``, where the start-up is what this rank measured
before its first iteration of the generation: from the process's start (generation 0, a
replacement) or from the failure's detection (a survivor) to the resume. The cap keeps the
allowance under the hang timeout (a rank still hung in a step is its own watchdog's to declare)
and at most :data:`MAX_FACTOR` op timeouts. Rank 0 says the allowance in the log once per
generation. Only the op timeout of those iterations changes (ds_swift.patches.op_timeout puts the
groups' timeouts back after each).
"""

from __future__ import annotations

import datetime
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = ["FACTOR", "ITERATIONS", "MAX_FACTOR", "WarmUp"]

#: iterations of each generation that get the allowance
ITERATIONS = 2
#: allowance = FACTOR x the measured start-up
FACTOR = 2.0
#: and at most this many op timeouts
MAX_FACTOR = 10.0


class WarmUp:
    """The op timeout of the first iterations of each generation.

    Args:
        hang_timeout_s: ``watchdog.hang_timeout_s`` (None: no hang detection).
        rank: this rank (rank 0 says the allowance).
    """

    def __init__(self, hang_timeout_s: float | None, rank: int) -> None:
        self.hang_timeout_s = hang_timeout_s
        self.rank = rank
        self.left = 0
        """Iterations of the generation in force that still get the allowance."""
        self.allowance_s = 0.0
        self.generation = -1

    def start(self, generation: int, since: float, op_timeout_s: float, log: Any = None) -> float:
        """Generation ``generation`` begins; its start-up on this rank began at ``since`` (wall clock).
        Returns the allowance (said by rank 0 through ``log``)."""
        startup = max(0.0, time.time() - since)
        cap = MAX_FACTOR * op_timeout_s
        if self.hang_timeout_s is not None:
            cap = min(cap, 0.9 * self.hang_timeout_s)
        self.allowance_s = max(op_timeout_s, min(cap, FACTOR * startup))
        self.generation, self.left = generation, ITERATIONS
        if log is not None and self.rank == 0 and self.allowance_s > op_timeout_s:
            log(
                f"warm-up allowance: the first {ITERATIONS} iterations of generation {generation} run with a "
                f"{self.allowance_s:.0f} s op timeout ({FACTOR:g} x this rank's {startup:.1f} s start-up, at most "
                f"{cap:.0f} s), then {op_timeout_s:g} s: a slow first iteration is neither a stall nor a failure"
            )
        return self.allowance_s

    def scope(self, op_timeout_s: float, generation: Any) -> AbstractContextManager[Any]:
        """Around one iteration: the allowance on every process group while the generation warms up."""
        if self.left <= 0 or self.allowance_s <= op_timeout_s:
            return nullcontext()
        from ds_swift.patches.op_timeout import op_timeout_scope

        return op_timeout_scope(self.allowance_s, datetime.timedelta(seconds=op_timeout_s), generation)

    def stepped(self) -> None:
        """An iteration of the generation finished."""
        self.left = max(0, self.left - 1)
