"""Verified recovery: every restored rank's state is checked against a reference digest before
training resumes (step 6 of the failure path in shared/DESIGN.md).

The references, by strategy:

- replication and buddy copies: the donor publishes the digest of what it sends
  (:func:`publish_reference`, store topic ``digest_sent``, keyed by the recipient); the recipient
  checks what it loaded, once every rank rebuilt its low-precision parameters (:func:`check_received`).
  That proves the transport, not the copy: a replica that drifted, or a buddy copy staged from the
  wrong buffers, arrives intact and wrong. So the restored state is then checked against the lost
  rank's *own* digest of the iteration restored, published while it trained (:func:`check_copy`).
  Digests are published every ``verify.digest_interval`` iterations: a restore to an iteration
  between two of them has no such reference, and its verdict is ``unverified`` (transport checked,
  copy not), said aloud by every restored rank and recorded in the timeline;
- logging-based replay: each rank publishes its own digest while it trains
  (ds_swift.protect.digest_publisher: every ``verify.digest_interval`` iterations, in a ring of
  :data:`SLOTS` job-store keys per rank, so that a dead rank's digests outlive it); a replaying
  rank checks its state at the newest iteration of the replay with one (:class:`ReplayCheck`);
- re-applied update logs (tranlogs) and states decoded from erasure-coded chunks (pipechurn): the
  same published digests, at the iteration the state was rebuilt to (:func:`check_published`);
- elastic resizes (ds_swift.recovery.strategies.elastic): every old partition a rank joins into its new one
  (its own, its peers', a lost rank's buddy copy), with the module it now holds, against the digest
  its old owner published of the consensus iteration before the failure (:func:`check_resharded`).

The coordinator then gathers every rank's :class:`~ds_swift.recovery.state.digest.Verdict`
(:func:`agree`): one mismatch anywhere makes every rank fall back to the global checkpoint, loudly,
naming the tensor. After each recovery, every rank forgets its own digests of the iterations it
trains again (:func:`forget_from`), which a later replay would otherwise be checked against: a
rank reads only the slots its process did not write itself (:class:`DigestSlots`, which the
digest publisher lends the recovery), so a survivor that published its ring reads none.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_swift.jobstore.agreement import agree, round_prefix
from ds_swift.recovery.state.digest import StateDigest, Verdict, digest_state, engine_state

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore
    from ds_swift.recovery.base import RankContext
    from ds_swift.recovery.consensus import RecoveryPlan

__all__ = [
    "OWN_COPY",
    "SLOTS",
    "DigestSlots",
    "ReplayCheck",
    "agree_verdicts",
    "check_copy",
    "check_published",
    "check_received",
    "check_resharded",
    "digest_key",
    "forget_from",
    "mismatch_reason",
    "publish_digest",
    "publish_reference",
    "published_digests",
]

#: digests kept per rank (a ring of job-store keys): a replay checks the newest one up to the
#: consensus, and a rank publishes at most one past it
SLOTS = 4
#: mismatching ranks named in the verify round's verdict (the lowest ones)
NAMED_MISMATCHES = 16


OWN_COPY = "my state undone from my own copy"
"""What a survivor that went back a step by its own copy checked against its own digest (the
coordinator's verdict detail starts with it)."""


def digest_key(rank: int, slot: int) -> str:
    """The job-store key of ``rank``'s digest slot ``slot``."""
    return f"digest/{rank}/{slot}"


class DigestSlots:
    """What this process wrote in ``rank``'s digest slots (slot -> the iteration there; None: dropped),
    so that :func:`forget_from` reads only the slots it does not know. Only the process holding a
    rank writes its slots, so what it wrote is what they hold while it keeps the rank: a slot it
    never wrote (its predecessor's), or whose write failed, is read. Lent to the recovery by the
    digest publisher (ds_swift.protect.digest_publisher), forgotten at an elastic renumbering."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._slots: dict[int, int | None] = {}

    def writing(self, slot: int) -> None:
        """A write of ``slot`` starts: unknown until it succeeded (a write that raised may have landed)."""
        with self._lock:
            self._slots.pop(slot, None)

    def wrote(self, slot: int, iteration: int | None) -> None:
        with self._lock:
            self._slots[slot] = iteration

    def known(self, slot: int) -> tuple[bool, int | None]:
        """(whether this process knows what ``slot`` holds, the iteration there: None for none)."""
        with self._lock:
            return slot in self._slots, self._slots.get(slot)

    def forget(self) -> None:
        with self._lock:
            self._slots.clear()


def publish_digest(
    store: JobStore, rank: int, iteration: int, interval: int, digest: StateDigest, slots: DigestSlots | None = None
) -> None:
    """Store ``rank``'s digest of its state after ``iteration``'s step (overwrites the oldest slot);
    ``slots``: this process's record of them, kept up to date."""
    slot = (iteration // interval) % SLOTS
    if slots is not None:
        slots.writing(slot)
    store.set(digest_key(rank, slot), digest.to_json(iteration))
    if slots is not None:
        slots.wrote(slot, iteration)


def published_digests(store: JobStore, rank: int) -> dict[int, dict[str, Any]]:
    """iteration -> the digest ``rank`` published of its state after that iteration's step."""
    out: dict[int, dict[str, Any]] = {}
    for slot in range(SLOTS):
        raw = store.get(digest_key(rank, slot))
        if raw:
            doc = json.loads(raw)
            out[int(doc["iteration"])] = doc
    return out


def forget_from(store: JobStore, rank: int, iteration: int, slots: DigestSlots | None = None) -> None:
    """Drop ``rank``'s digests of ``iteration`` and later: training resumes there, and what the
    recovery undid or rolled back is published again as it is trained again. ``slots``: what this
    process wrote in them (a slot it knows is not read: one request each saved)."""
    mine = slots if slots is not None and slots.rank == rank else None
    for slot in range(SLOTS):
        known, held = mine.known(slot) if mine is not None else (False, None)
        if not known:
            raw = store.get(digest_key(rank, slot))
            held = int(json.loads(raw)["iteration"]) if raw else None
        if held is not None and held >= iteration:
            if mine is not None:
                mine.writing(slot)
            store.set(digest_key(rank, slot), "")
        if mine is not None:
            mine.wrote(slot, held if held is None or held < iteration else None)


# ----------------------------------------------------------------------------- donors
def publish_reference(ctx: RankContext, recipient: int, state: Mapping[str, Any]) -> None:
    """A donor: the digest of ``state``, which it is about to send to ``recipient``."""
    ctx.store.publish(ctx.generation, "digest_sent", recipient, digest_state(state).to_json())


def check_received(ctx: RankContext, donor: int, state: Mapping[str, Any], what: str) -> Verdict:
    """A recipient: its loaded ``state`` against the digest ``donor`` published of what it sent."""
    raw = ctx.store.gather(ctx.generation, "digest_sent", [ctx.rank], ctx.gather_timeout_s)[ctx.rank]
    mine = digest_state(state)
    diff = mine.first_difference(json.loads(raw))
    if diff is not None:
        return Verdict("mismatch", f"{what} received from rank {donor}: {diff}")
    return Verdict("verified", f"{what} bitwise equal to donor rank {donor}'s ({len(mine.names)} tensors)")


def check_copy(ctx: RankContext, transported: Verdict, iteration: int, what: str) -> Verdict:
    """A restored copy (replication, buddy): ``transported`` (against the donor's digest of what it
    sent), then the whole restored state against the digest this rank's predecessor published of
    ``iteration`` while alive. Verified only if both hold; ``unverified`` when the lost rank
    published no digest of that iteration (between two ``verify.digest_interval`` points)."""
    if transported.status != "verified":
        return transported
    own = check_published(ctx.store, ctx.rank, ctx.engine, iteration, what)
    if own.status == "mismatch":
        return Verdict("mismatch", f"{own.detail} (though it arrived as the donor sent it: {transported.detail})")
    if own.status == "verified":
        return Verdict("verified", f"{transported.detail}; and {own.detail}")
    return Verdict(
        "unverified",
        f"{transported.detail}, but rank {ctx.rank} published no digest of iteration {iteration} (digests every "
        "verify.digest_interval iterations): the copy itself is unchecked against the lost rank's own state",
    )


def check_published(store: JobStore, rank: int, engine: Any, iteration: int, what: str) -> Verdict:
    """``rank``'s rebuilt state (``what``) against the digest it published of ``iteration`` while alive."""
    published = published_digests(store, rank).get(iteration)
    if published is None:
        return Verdict("unverified", f"rank {rank} published no digest of iteration {iteration}: {what} unchecked")
    mine = digest_state(engine_state(engine))
    diff = mine.first_difference(published)
    if diff is not None:
        return Verdict(
            "mismatch", f"{what} (iteration {iteration}) differs from the digest rank {rank} published then: {diff}"
        )
    return Verdict(
        "verified",
        f"{what} (iteration {iteration}) bitwise equal to the digest rank {rank} published ({len(mine.names)} tensors)",
    )


def check_resharded(store: JobStore, engine: Any, parts: Mapping[int, Any], iteration: int) -> Verdict:
    """An elastic resize: ``parts`` (old rank -> the optimizer partition of it joined here; None: that
    old rank's whole state, which this rank took over unpartitioned) with this rank's module, against
    the digest each old rank published of ``iteration`` before the failure. A mismatch anywhere wins;
    an old rank without a digest of ``iteration`` (between two digests) leaves its part unverified."""
    module = engine.module.state_dict()
    checked, missing = [], []
    for owner, part in sorted(parts.items()):
        published = published_digests(store, owner).get(iteration)
        if published is None:
            missing.append(owner)
            continue
        state = engine_state(engine) if part is None else {"module": module, "optimizer": part}
        diff = digest_state(state).first_difference(published)
        if diff is not None:
            what = "state" if part is None else "optimizer partition"
            return Verdict(
                "mismatch",
                f"old rank {owner}'s {what} of iteration {iteration}, resharded here, differs "
                f"from the digest it published then: {diff}",
            )
        checked.append(owner)
    if missing:
        return Verdict(
            "unverified",
            f"old ranks {missing} published no digest of iteration {iteration} (digests "
            f"every verify.digest_interval iterations): their parts are unchecked"
            + (f"; old ranks {checked} verified" if checked else ""),
        )
    return Verdict(
        "verified",
        f"the parts of old ranks {checked} joined here bitwise equal to the digests they "
        f"published of iteration {iteration}",
    )


# ----------------------------------------------------------------------------- replays
class ReplayCheck:
    """A replaying rank's check against the digests it published while alive: at the newest
    iteration of the replay with one (the consensus, unless its digest never left the rank).

    Args:
        store: the job store.
        rank: the replaying rank (a replacement checks its predecessor's digests: same rank).
        plan: the logging plan (iterations ``replay_from .. consensus`` are replayed).
        engine: the rank's engine, which the replay steps.
    """

    def __init__(self, store: JobStore, rank: int, plan: RecoveryPlan, engine: Any) -> None:
        self.rank, self.engine = rank, engine
        self.first, self.last = plan.replay_from, plan.consensus
        self.published = published_digests(store, rank)
        in_range = [i for i in self.published if self.first <= i <= self.last]
        self.target = max(in_range) if in_range else None
        self.verdict: Verdict | None = None

    def before_iteration(self, iteration: int) -> None:
        """The replay's hook: the state after ``iteration - 1`` is there now."""
        if self.target is not None and iteration - 1 == self.target and self.verdict is None:
            self.verdict = self._check(self.target)

    def finish(self, approximate: bool = False) -> Verdict:
        """The verdict once the replay stepped the consensus (``approximate``: not meant to be bitwise)."""
        if approximate:
            return Verdict("unverified", "parallel recovery mode fast is not bitwise: nothing to compare")
        if self.target is None:
            have = sorted(self.published) or "none"
            return Verdict(
                "unverified",
                f"rank {self.rank} published no digest of iterations {self.first}..{self.last} (it has: {have})",
            )
        if self.verdict is None:
            self.verdict = self._check(self.target)
        return self.verdict

    def _check(self, target: int) -> Verdict:
        mine = digest_state(engine_state(self.engine))
        diff = mine.first_difference(self.published[target])
        where = f"the state replayed to iteration {target}"
        if diff is not None:
            return Verdict("mismatch", f"{where} differs from the digest rank {self.rank} published then: {diff}")
        later = f"; iterations {target + 1}..{self.last} after it unchecked" if target < self.last else ""
        return Verdict(
            "verified",
            f"{where} bitwise equal to the digest rank {self.rank} published ({len(mine.names)} tensors){later}",
        )


# ----------------------------------------------------------------------------- agreement
def agree_verdicts(
    store: JobStore, generation: int, rank: int, world_size: int, verdict: Verdict | None, timeout_s: float
) -> dict[int, Verdict]:
    """Every rank's mismatch (ranks whose state matched, or who restored nothing, say nothing), the
    same on every rank: an agreement round (ds_swift.jobstore.agreement), the lowest
    :data:`NAMED_MISMATCHES` ranks' named."""
    said = agree(
        store,
        round_prefix(generation, "verify"),
        rank,
        verdict.to_json() if verdict is not None else "null",
        range(world_size),
        _mismatches,
        timeout_s=timeout_s,
        generation=generation,
    )
    return {int(r): Verdict.from_json(v) for r, v in json.loads(said).items()}


def _mismatches(verdicts: Mapping[int, str]) -> str:
    bad = {r: v for r, v in sorted(verdicts.items()) if v != "null" and Verdict.from_json(v).status == "mismatch"}
    return json.dumps(dict(list(bad.items())[:NAMED_MISMATCHES]))


def mismatch_reason(verdicts: Mapping[int, Verdict]) -> str | None:
    """Why every rank must fall back (naming each mismatching rank and tensor), or None."""
    bad = [f"rank {r}: {v.detail}" for r, v in sorted(verdicts.items()) if v.status == "mismatch"]
    return "restored state failed verification: " + "; ".join(bad) if bad else None
