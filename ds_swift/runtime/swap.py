"""A survivor keeps its engine across a failure (issue 50; shared/DESIGN.md, failure path step 4).

Its model, optimizer and state do not change when a machine fails: only the process groups under
them do. So a survivor does not destroy its DeepSpeed engine and build another one: at the teardown
it cuts every group reference out of the engine (ds_swift.patches.group_swap.GroupSwap: the failed
generation's sockets then close, and peers blocked on it fail at once), and once the next generation's
world is joined it replays the start-up's group creations and ops (the StartupLedger the context
recorded between joining and ``ds_swift.initialize``, which a replacement runs for real), puts each new
group where its predecessor was, and clears what the failed iteration left half done
(ds_swift.patches.deepspeed_fresh). Only replacements build an engine.

Survivors rebuild as before, and say why, where a swap cannot be proven whole: the start-up was not
recorded (not under ds-swift-launch) or ran an op a replay cannot repeat, the engine holds a group the
start-up did not create, the world changes shape (an elastic shrink or grow), or a replay failed once
(from then on, for the rest of the job: a replay that disagrees with a replacement's start-up would
fail again).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_swift.patches.group_swap import GroupSwap
    from ds_swift.runtime.context import SwiftContext

__all__ = ["EngineSwap", "startup_times"]


class EngineSwap:
    """Whether this survivor keeps its engine through the recovery in progress, and the swap itself.

    Args:
        ctx: the distributed context (its ``ledger``: the start-up's groups and ops).
    """

    def __init__(self, ctx: SwiftContext) -> None:
        self._ctx = ctx
        self.swap: GroupSwap | None = None
        """The kept engine's group references, cut (None: no engine is kept)."""
        self.refused: str | None = None
        """Why survivors rebuild their engine for the rest of the job (a replay failed)."""
        self._cut: list[Any] = []
        self._releasing: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """A survivor's engine is kept through the recovery in progress."""
        return self.swap is not None

    def why_not(self) -> str | None:
        """Why no engine can be kept (None: it can, once its groups are found)."""
        ledger = self._ctx.ledger
        if ledger is None:
            return "the start-up's process groups were not recorded (a job not started by ds-swift-launch)"
        return self.refused or ledger.why_not

    def find(self, engine: Any) -> bool:
        """At the teardown, with the failed generation's groups still in place: find every group
        reference ``engine`` holds; True where the engine can be kept (else the reason is logged)."""
        from ds_swift.patches.group_swap import GroupSwap, SwapRefused

        why = self.why_not()
        if why is None:
            try:
                self.swap = GroupSwap([engine], self._ctx.ledger)
            except SwapRefused as exc:
                why = str(exc)
        if why is not None:
            self.swap = None
            self._ctx.log(f"survivors rebuild their DeepSpeed engine: {why}")
        return self.swap is not None

    def cut(self, engine: Any) -> None:
        """Drop the failed generation's groups and activations from the kept engine (see
        :meth:`ds_swift.patches.group_swap.GroupSwap.cut`); the groups are let go of by
        :meth:`release`, after torch's registry."""
        from ds_swift.patches.deepspeed_rebuild import release_pipeline_activations

        assert self.swap is not None
        release_pipeline_activations(engine)
        self._cut.extend(self.swap.cut())

    def release(self, also: list[Any] | None = None) -> None:
        """Let go of the groups :meth:`cut` took out, and ``also`` (those torch's registry let go of:
        ds_swift.patches.deepspeed_rebuild.teardown_process_groups), on a thread of their own: their
        sockets close and their threads end there (~15 ms a group, without the GIL) while this rank
        joins the next generation. The previous release is waited for first (bounded by its groups'
        count)."""
        from ds_swift.patches.deepspeed_rebuild import free_groups

        self.join_release()
        groups, self._cut = [*self._cut, *(also or [])], []
        if also:
            also.clear()  # the thread's list holds the last references: none may be dropped here

        def free() -> None:
            took = free_groups(groups)
            if took > 2.0:
                self._ctx.log(f"the failed generation's process groups took {took:.1f} s to close")

        self._releasing = threading.Thread(target=free, name="ds-swift-group-release", daemon=True)
        self._releasing.start()

    def join_release(self, timeout_s: float = 60.0) -> None:
        """Wait for the groups of the last release to be let go of."""
        if self._releasing is not None:
            self._releasing.join(timeout_s)
            self._releasing = None

    def swap_in(self, engine: Any) -> dict[str, float]:
        """On the next generation's world (joined, DeepSpeed attached): the start-up's groups made
        again and put in place, the failed iteration's leftovers cleared. A failure in here refuses
        swaps for the rest of the job (:attr:`refused`)."""
        from ds_swift.patches.deepspeed_fresh import fresh_iteration
        from ds_swift.patches.deepspeed_rebuild import patient_group_creation

        ctx, swap = self._ctx, self.swap
        assert swap is not None and ctx.ledger is not None
        t0 = time.perf_counter()
        try:
            # The groups' members include replacements still starting: wait for them as long as for
            # their join, then the op timeout applies again.
            with patient_group_creation(ctx.join_timeout_s, ctx.op_timeout_s):
                made = ctx.ledger.replay()
        except BaseException as exc:
            self.refused = f"the replay of the start-up failed in an earlier recovery ({type(exc).__name__})"
            raise
        t1 = time.perf_counter()
        swap.refill(made)
        fresh_iteration(engine)
        took = {"replay": round(t1 - t0, 4), "refill": round(time.perf_counter() - t1, 4)}
        ctx.log(
            f"kept the DeepSpeed engine: {len(swap)} process-group references swapped in place, "
            f"{len(ctx.ledger.calls)} start-up calls replayed ({took['replay']:.2f} s), "
            f"leftovers of the failed iteration cleared ({took['refill']:.2f} s)"
        )
        return took

    def drop(self, engine: Any, why: str) -> str | None:
        """Give the kept engine up (the caller rebuilds one): its groups cut, DeepSpeed's
        ``destroy``. Returns what went wrong freeing it, if anything."""
        from ds_swift.patches.deepspeed_rebuild import release_failed_engine

        if self.swap is not None:
            self._cut.extend(self.swap.cut())
            self.swap = None
            self.release()
            self._ctx.log(f"survivors rebuild their DeepSpeed engine: {why}")
        return release_failed_engine(engine)


def startup_times(ctx: SwiftContext, now: float) -> dict[str, float]:
    """A replacement's start-up after joining its generation, in parts (its recovery timeline's
    ``extra["startup_s"]``): the script up to ``ds_swift.initialize`` (of which creating process
    groups and the start-up's ops, which its survivors wait for in their replay), then ds-swift's set-up
    up to the recovery."""
    ledger = ctx.ledger
    if ledger is None or ledger.closed_at is None or not ctx.t_joined:
        return {}
    return {
        "script": round(ledger.closed_at - ctx.t_joined, 4),
        "groups": round(ledger.seconds["new_group"], 4),
        "ops": round(ledger.seconds["ops"], 4),
        "ds_swift_setup": round(now - ledger.closed_at, 4),
    }
