"""Replicated and buddy copies are verified against the lost rank's own published digest, not only
against the donor's digest of what it sent (issue 30, item 6): a copy that arrives intact but is
not the lost rank's state (a replica that drifted, a copy staged from the wrong buffers) is a
mismatch; between two digests the restore is unverified, and says so. Elastic reshards are checked
against the old ranks' digests.

The strategies' restores run in-process with their transport stubbed: the donor's own check
(transport) passes, as it would for a wrong copy sent faithfully.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_swift.jobstore.membership import JobStore
from ds_swift.recovery.base import RankContext
from ds_swift.recovery.consensus import RecoveryPlan
from ds_swift.recovery.state.digest import Verdict, digest_state, engine_state
from ds_swift.recovery.strategies import buddy as buddy_mod
from ds_swift.recovery.strategies import replication as repl_mod
from ds_swift.recovery.timeline import RankTimeline
from ds_swift.recovery.verify import publish_digest

LOST = 2
CONSENSUS = 7


@pytest.fixture
def store() -> JobStore:
    return JobStore.host("unit-own-digest")


def engine(seed: int) -> Any:
    torch.manual_seed(seed)
    return SimpleNamespace(module=torch.nn.Linear(3, 2), optimizer=None)


def publish_lost_state(store: JobStore, iteration: int = CONSENSUS) -> Any:
    """The lost rank, while alive: its digest of ``iteration`` (interval 1)."""
    lost = engine(seed=1)
    publish_digest(store, LOST, iteration, 1, digest_state(engine_state(lost)))
    return lost


def context(store: JobStore, eng: Any) -> RankContext:
    return RankContext(
        store=store,
        generation=1,
        rank=LOST,
        engine=eng,
        kept=None,
        ckpt=None,
        timeline=RankTimeline(LOST, "replacement", 0),
        gather_timeout_s=5.0,
        verify=True,
    )


def stub_transport(monkeypatch: pytest.MonkeyPatch, module: Any, arrived: Any) -> None:
    """The copy ``arrived`` lands in the engine; the donor's digest of what it sent matches it."""

    def load(eng: Any, state: Any, iteration: int) -> None:
        eng.module.load_state_dict(arrived.module.state_dict())

    for name in ("capture_state", "partition_state"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *a, **k: {})
    monkeypatch.setattr(module, "hand_over", lambda recipients, state_for, donor, **k: ({}, 0))
    for name in ("load_state", "load_received"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, load)
    monkeypatch.setattr(module, "finish_restore", lambda eng: None)
    monkeypatch.setattr(
        module,
        "check_received",
        lambda ctx, donor, state, what: Verdict("verified", f"{what} bitwise equal to donor rank {donor}'s"),
    )


def restore(kind: str, store: JobStore, monkeypatch: pytest.MonkeyPatch, arrived: Any) -> Verdict:
    plan = RecoveryPlan(kind, "test", CONSENSUS, survivors=(0, 1, 3), replacements=(LOST,), donors={LOST: 0})
    if kind == "replication":
        stub_transport(monkeypatch, repl_mod, arrived)
        strategy: Any = repl_mod.ReplicationStrategy()
    else:
        stub_transport(monkeypatch, buddy_mod, arrived)
        strategy = buddy_mod.BuddyStrategy()
    # The agreed inputs: only their consensus is read here (no survivor had to go back further).
    outcome = strategy.restore(plan, SimpleNamespace(consensus=CONSENSUS), context(store, engine(seed=99)))
    assert outcome.verdict is not None
    return outcome.verdict


@pytest.mark.parametrize("kind", ["replication", "buddy"])
def test_a_faithful_copy_of_the_wrong_state_is_a_mismatch(
    kind: str, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_lost_state(store)
    drifted = engine(seed=5)  # arrives as sent, but is not what the lost rank held
    verdict = restore(kind, store, monkeypatch, drifted)
    assert verdict.status == "mismatch", verdict
    assert f"differs from the digest rank {LOST} published then: tensor" in verdict.detail
    assert "arrived as the donor sent it" in verdict.detail


@pytest.mark.parametrize("kind", ["replication", "buddy"])
def test_the_lost_ranks_own_state_is_verified_against_its_digest(
    kind: str, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = publish_lost_state(store)
    verdict = restore(kind, store, monkeypatch, lost)
    assert verdict.status == "verified", verdict
    assert f"bitwise equal to the digest rank {LOST} published" in verdict.detail


def test_between_two_digests_the_restore_is_unverified_and_says_why(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    lost = publish_lost_state(store, iteration=CONSENSUS - 2)  # the last digest before the failure: iteration 5
    verdict = restore("buddy", store, monkeypatch, lost)
    assert verdict.status == "unverified", verdict
    assert f"rank {LOST} published no digest of iteration {CONSENSUS}" in verdict.detail
    assert "verify.digest_interval" in verdict.detail and "donor rank 0" in verdict.detail


def test_an_elastic_reshard_is_checked_part_by_part_against_the_old_ranks_digests(store: JobStore) -> None:
    """Each old partition joined here, with this rank's module, against its old owner's digest."""
    from ds_swift.recovery.verify import check_resharded

    here = engine(seed=3)
    parts = {}
    for owner in (0, 1):
        part = {"exp_avg": torch.full((4,), float(owner)), "step": torch.tensor(7.0)}
        publish_digest(
            store, owner, CONSENSUS, 1, digest_state({"module": here.module.state_dict(), "optimizer": part})
        )
        parts[owner] = part
    assert check_resharded(store, here, parts, CONSENSUS).status == "verified"
    wrong = {0: parts[0], 1: {**parts[1], "exp_avg": parts[1]["exp_avg"] + 1e-3}}  # a wrong copy of old rank 1's
    bad = check_resharded(store, here, wrong, CONSENSUS)
    assert bad.status == "mismatch" and "old rank 1's optimizer partition" in bad.detail, bad
    later = check_resharded(store, here, parts, CONSENSUS + 1)
    assert later.status == "unverified" and "old ranks [0, 1] published no digest" in later.detail, later
