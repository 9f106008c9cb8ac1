"""PipeChurn's erasure coding (ds_swift.recovery.state.erasure) and its strategy's choice, without processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.holdings import BuddyHeld, holdings_of
from ds_swift.recovery.registry import STRATEGIES, plan_recovery
from ds_swift.recovery.state.buddies import BuddyError, Member
from ds_swift.recovery.state.erasure import ErasureError, assign_holders, erasure_target, join_chunks, split_payload
from ds_swift.recovery.state.transfer import decode, encode


def payload() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "optimizer": {"masters": [torch.randn(37, generator=g)], "step": 7, "betas": (0.9, 0.95)},
        "bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "counters": torch.arange(3, dtype=torch.int64),
        "empty": torch.empty(0),
    }


def same(a: object, b: object) -> bool:
    ma, ta = encode(a)
    mb, tb = encode(b)
    return ma == mb and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


@pytest.mark.parametrize(("k", "r"), [(2, 1), (2, 2), (3, 2), (1, 2)])
def test_any_k_of_the_k_plus_r_chunks_rebuild_the_state_bitwise(k: int, r: int) -> None:
    state = payload()
    records = split_payload(*encode(state), k, r)
    assert [rec["ec"]["index"] for rec in records] == list(range(k + r))
    size = records[0]["chunk"].numel()
    assert all(rec["chunk"].numel() == size for rec in records)  # each holder keeps 1/k of it
    for subset in itertools.combinations(records, k):
        # What a holder sends is a payload of its own, carried like a buddy copy.
        carried = [
            decode(m, {d: torch.cat([t.reshape(-1) for t in ts if t.dtype == d]) for d in {t.dtype for t in ts}})
            for m, ts in (encode(rec) for rec in subset)
        ]
        assert same(join_chunks(carried), state)
    with pytest.raises(ErasureError, match=f"of the k = {k} needed" if k > 1 else "no chunk"):
        join_chunks(records[: k - 1])


def test_chunks_of_another_payload_are_refused() -> None:
    a = split_payload(*encode(payload()), 2, 1)
    b = split_payload(*encode({"x": torch.ones(4)}), 2, 1)
    with pytest.raises(ErasureError, match="different payloads"):
        join_chunks([a[0], b[1]])


def members(machines: int, per_machine: int = 1) -> list[Member]:
    return [Member(rank=r, machine=r // per_machine) for r in range(machines * per_machine)]


def test_holders_sit_on_distinct_machines_other_than_the_owners() -> None:
    placement = assign_holders(members(4, 2), k=2, r=1)
    for owner, holders in placement.items():
        machines = [h // 2 for h in holders]
        assert len(holders) == 3 and len(set(machines)) == 3 and owner // 2 not in machines
    with pytest.raises(BuddyError, match=r"pipechurn.data_chunks=2 \+ pipechurn.parity_chunks=2 needs 4 machines"):
        assign_holders(members(4, 2), k=2, r=2)


def reports(lost_machines: set[int], k: int = 2, r: int = 1, machines: int = 4, last: int = 9) -> list[RankReport]:
    """One rank per machine; each survivor reports the chunks it holds of iterations last-1 and last."""
    placement = assign_holders(members(machines), k, r)
    out = []
    for rank in range(machines):
        survivor = rank not in lost_machines
        held = (
            tuple(
                (owner, v, holders.index(rank))
                for owner, holders in sorted(placement.items())
                if rank in holders
                for v in (last - 1, last)
            )
            if survivor
            else ()
        )
        out.append(
            RankReport(
                rank=rank,
                survivor=survivor,
                stage=rank % 2,
                dp=rank // 2,
                tp=0,
                machine=rank,
                last_stepped=last if survivor else -1,
                can_undo=survivor,
                holdings=holdings_of(BuddyHeld(chunks=held, k=k)),
            )
        )
    return out


def test_r_plus_one_machine_losses_are_decoded_and_more_fall_back_saying_why() -> None:
    plan = plan_recovery(reports({1}), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn" and plan.consensus == 9, plan.reason
    target, sources, _ = erasure_target(RecoveryInputs.agree(reports({1}), forced="pipechurn"))
    assert target == 9 and len(sources[1]) == 2 and all(h != 1 for h, _ in sources[1])
    plan = plan_recovery(reports({1, 2}, r=2, machines=5), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn", plan.reason  # r = 2: two machines at once
    # A rank's own machine holds none of its chunks: with 4 machines, 2 losses leave k = 2 of each
    # lost rank's 3 chunks (r + 1 losses survived), 3 leave 1.
    plan = plan_recovery(reports({1, 2}), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn", plan.reason
    plan = plan_recovery(reports({1, 2, 3}), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "checkpoint"
    assert "fewer than k = 2 erasure-coded chunks of a lost rank's state survived" in plan.reason, plan.reason
    # auto never chooses it: the chunks exist only under its own name
    assert "pipechurn" not in [s.name for s in STRATEGIES.candidates(RecoveryInputs.agree(reports({1})))]
