"""What a buddy copier keeps and when a round counts (ds_swift.protect.buddy).

:class:`BuddyHoldings`: the complete copies of other ranks' partitions this rank holds (the newest
two per owner), and this rank's own copies of its last two rounds, kept across generations.
:class:`StoreLanding`: a round has landed once every rank wrote its key for it in the job store.
:func:`stage`: a round's own copy, staged into host buffers before it is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.checkpoint.snapshot import PinnedCopier
from ds_swift.jobstore.agreement import agree
from ds_swift.jobstore.membership import JobStore
from ds_swift.recovery.state.transfer import decode, flat_sizes, flat_views

__all__ = ["BuddyHoldings", "StoreLanding", "stage", "stage_own"]


@dataclass
class _Copy:
    version: int
    manifest: bytes
    flats: dict[torch.dtype, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flats.values())


class BuddyHoldings:
    """The complete copies of other ranks' partitions this rank holds (the newest two per owner).
    Kept across generations: the copies of a lost rank are what its replacement needs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[int, list[_Copy]] = {}
        self._own: list[_Copy] = []
        """This rank's own state after its last two rounds (steps, or every ``buddy.interval``-th)."""

    def spare(self, owner: int | None, manifest: bytes, pin: bool = False) -> dict[torch.dtype, torch.Tensor]:
        """Buffers to receive ``owner``'s next copy into (None: this rank's own next copy): the oldest
        copy's, dropped from the complete ones first (so it is never reported while being
        overwritten), or new ones (``pin``: in pinned memory, for copies from a GPU)."""
        sizes = flat_sizes(manifest)
        with self._lock:
            held = self._held(owner)
            if len(held) >= 2:
                old = held.pop(0)
                if {d: t.numel() for d, t in old.flats.items()} == sizes:
                    return old.flats
        return {d: torch.empty(n, dtype=d, pin_memory=pin) for d, n in sizes.items()}

    def put(self, owner: int | None, version: int, manifest: bytes, flats: dict[torch.dtype, torch.Tensor]) -> None:
        """A complete copy of ``owner``'s state after iteration ``version`` (None: this rank's own)."""
        with self._lock:
            held = self._held(owner)
            kept = [c for c in held if c.version != version] + [_Copy(version, manifest, flats)]
            held[:] = sorted(kept, key=lambda c: c.version)[-2:]

    def _held(self, owner: int | None) -> list[_Copy]:
        """The complete copies of ``owner`` (None: this rank's own); call with the lock held."""
        return self._own if owner is None else self._copies.setdefault(owner, [])

    def own_state(self, version: int) -> dict[str, Any] | None:
        """This rank's own state after iteration ``version``, decoded into fresh tensors (a load must
        not alias buffers the next round overwrites), or None where no complete own copy of it is held."""
        with self._lock:
            found = next((c for c in self._own if c.version == version), None)
            if found is None:
                return None
            flats = {d: t.clone() for d, t in found.flats.items()}
        return decode(found.manifest, flats)

    def own_versions(self) -> tuple[int, ...]:
        """The iterations of the complete own copies held."""
        with self._lock:
            return tuple(c.version for c in self._own)

    def copies(self) -> tuple[tuple[int, int], ...]:
        """(owner, iteration) of every complete copy held."""
        with self._lock:
            return tuple((o, c.version) for o, held in sorted(self._copies.items()) for c in held)

    def chunks(self) -> tuple[tuple[int, int, int], ...]:
        """(owner, iteration, chunk index) of every complete erasure-coded chunk held (pipechurn)."""
        with self._lock:
            held = [(o, c.version, decode(c.manifest, c.flats)) for o, cs in sorted(self._copies.items()) for c in cs]
        return tuple((o, v, int(rec["ec"]["index"])) for o, v, rec in held if isinstance(rec, dict) and "ec" in rec)

    def state_of(self, owner: int, version: int) -> dict[str, Any]:
        """The copy of ``owner`` after iteration ``version``, decoded (tensors are views)."""
        with self._lock:
            for c in self._copies.get(owner, []):
                if c.version == version:
                    return decode(c.manifest, c.flats)
        raise KeyError(f"no complete buddy copy of rank {owner} at iteration {version}")

    def nbytes(self) -> int:
        """Host memory of every copy held: other ranks' and this rank's own."""
        with self._lock:
            return sum(c.nbytes for held in (*self._copies.values(), self._own) for c in held)


class StoreLanding:
    """Every rank's copies of a round are held: an agreement round (ds_swift.jobstore.agreement)
    under ``buddy/<g>/<version>``.

    Each rank writes its own key for the round (one request); the round's leader (rank 0) waits
    for all of them and writes the verdict; the others wait for it. A shared counter did the same
    with a compare-and-swap per rank per round, which retried whenever ranks finished together:
    quadratic in the ranks at every step (a thousand ranks, ~500k store requests per step), where
    this is about four requests per rank and one batch read of ``world`` values for the leader.

    Args:
        store: a job-store connection of the copier thread's own.
        generation: the generation (rounds of an earlier one never count).
        world: ranks taking part.
        rank: this rank (default: torch.distributed's).
        timeout_s: the longest a round waits for the other ranks' keys (their transfers are bounded
            by the copier group's op timeout): then it raises, the copier stops, and the training
            thread turns copying off, loudly. Without it a rank that never wrote its key (its copier
            died, and the write of the ``off`` key failed too) held every other copier for good.
    """

    #: the rank that declares each round done
    LEADER = 0

    def __init__(
        self, store: Any, generation: int, world: int, rank: int | None = None, timeout_s: float = 300.0
    ) -> None:
        self.store, self.generation, self.world = store, generation, world
        self.timeout_s = timeout_s
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank()
        self.rank = rank
        self._rounds: list[int] = []
        """The rounds this rank counted itself in, newest last (the keys of two rounds back go)."""
        self.done_value: str | None = None
        """What the leader wrote into the last round's verdict: ``"1"``, or the interval
        ``buddy.interval: "auto"`` chose (ds_swift.protect.buddy_interval.decision)."""

    def turn_off(self, reason: str) -> None:
        """This rank stopped copying (a copier error): every rank's copier stops too, rather than
        wait for its count in every later round."""
        self.store.set(f"buddy/{self.generation}/off", reason)

    def __call__(self, version: int, stopped: Callable[[], bool], note: str = "1") -> bool:
        """Count this rank in for round ``version`` and wait until every rank is in (True), or until
        ``stopped()`` (False). The leader's ``note`` is the round's verdict; every rank finds it in
        :attr:`done_value`. Raises once another rank turned copying off."""
        self.done_value = None
        prefix = JobStore.buddy_round_key(self.generation, version)
        # A step waits for the previous round, so the round two back is over everywhere (rounds are
        # ``buddy.interval`` iterations apart: the same rounds on every rank).
        self._rounds.append(version)
        old = self._rounds.pop(0) if len(self._rounds) > 2 else None
        self.done_value = agree(
            self.store,
            prefix,
            self.rank,
            "1",
            range(self.world),
            lambda _: note,
            timeout_s=self.timeout_s,
            stopped=lambda: self._stopped(stopped),
            leader=self.LEADER,
        )
        if old is not None:
            self.store.delete(f"{JobStore.buddy_round_key(self.generation, old)}/{self.rank}")
            if self.rank == self.LEADER:
                self.store.delete(JobStore.buddy_done_key(self.generation, old))
        return self.done_value is not None

    def _stopped(self, stopped: Callable[[], bool]) -> bool:
        """Between two waits: this copier was told to stop (True), or another rank turned copying off (raises)."""
        if stopped():
            return True
        why = self.store.get(f"buddy/{self.generation}/off")
        if why is not None:
            raise RuntimeError(f"buddy copies turned off on another rank ({why})")
        return False


def stage_own(holdings: BuddyHoldings, version: int, manifest: bytes, live: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's own copy of a round: the live tensors (flat, in the manifest's order) copied into
    host buffers (the older own copy's), kept as complete once copied. Returns the staged views: the
    round sends those, not the live tensors."""
    return stage(holdings, version, manifest, live)[0]


def stage(
    holdings: BuddyHoldings, version: int, manifest: bytes, live: list[torch.Tensor], ready: Any = None
) -> tuple[list[torch.Tensor], dict[torch.dtype, torch.Tensor]]:
    """:func:`stage_own`, also returning the flat buffers (one per dtype) the views are cut from.

    Device tensors are copied into pinned host buffers on a side stream that first waits for
    ``ready`` (the step's event; ds_swift.checkpoint.snapshot.PinnedCopier.copy_into, the
    asynchronous checkpoint's copy): on the training thread's stream, or into pageable memory, the
    copy of the partition would hold up the next iteration's kernels for its whole PCIe time
    (hundreds of MB per step on a large model). Only this, the copier thread, waits for it."""
    flats = holdings.spare(None, manifest, pin=any(t.is_cuda for t in live))
    staged = flat_views(manifest, flats)
    _COPIER.copy_into(staged, live, ready)
    holdings.put(None, version, manifest, flats)
    return staged, flats


#: The buddy copier's side streams (its own: the checkpoint snapshots' copies do not queue behind it).
_COPIER = PinnedCopier()
