"""PipeChurn's partial recomputation, its pieces: who may recompute partially (a pure decision on the
consensus reports), who feeds whom, and the copy each rank keeps of the iteration in flight."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from ds_swift.config import SwiftConfig
from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.registry import plan_recovery
from ds_swift.recovery.state.buddies import Member
from ds_swift.recovery.state.erasure import assign_holders
from ds_swift.recovery.state.inflight import InflightKeeper, kept_inflight
from ds_swift.recovery.strategies.pipechurn_partial import feeders, partial_blocker, retrain_summary


def reports(lost: set[int], inflight: dict[int, int] | None = None, pp: int = 2, dp: int = 2, last: int = 9,
            k: int = 2, r: int = 1) -> list[RankReport]:  # fmt: skip
    """One rank per machine, rank = stage * dp + dp_rank (DeepSpeed's pipe-data order); every
    survivor holds chunks of ``last`` and a complete copy of ``last + 1`` unless ``inflight`` says otherwise."""
    machines = pp * dp
    placement = assign_holders([Member(rank=m, machine=m) for m in range(machines)], k, r)
    out = []
    for rank in range(machines):
        survivor = rank not in lost
        held = tuple((o, last, hs.index(rank)) for o, hs in sorted(placement.items()) if rank in hs) if survivor else ()
        out.append(RankReport(
            rank=rank, survivor=survivor, stage=rank // dp, dp=rank % dp, tp=0, machine=rank,
            last_stepped=last if survivor else -1, can_undo=survivor, ec_chunks=held, ec_k=k,
            inflight=(inflight or {}).get(rank, last + 1) if survivor else -1,
        ))  # fmt: skip
    return out


def test_lost_passes_alone_are_recomputed_when_every_survivor_holds_the_iteration_in_flight() -> None:
    inputs = RecoveryInputs.agree(reports({1}), forced="pipechurn")
    assert partial_blocker(inputs) is None
    # Rank 1 (stage 0 of replica 1) gets the gradients rank 3 (its stage 1) sent it.
    assert feeders(inputs) == {1: [(3, "grad")]}
    plan = plan_recovery(reports({1}), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn" and "of iteration 10, only the lost ranks' passes are recomputed" in plan.reason
    # A middle stage is fed from both sides, activations from the stage before it.
    inputs = RecoveryInputs.agree(reports({3}, pp=3, dp=2, r=2), forced="pipechurn")
    assert partial_blocker(inputs) is None and feeders(inputs) == {3: [(1, "act"), (5, "grad")]}


@pytest.mark.parametrize(
    ("lost", "inflight", "why"),
    [
        ({1}, {3: -1}, "ranks [3] hold no complete copy of iteration 10"),
        ({1}, {0: 9}, "ranks [0] hold no complete copy of iteration 10"),
        ({1, 3}, {}, "ranks 1 and 3, adjacent stages of one pipeline, were both lost"),
    ],
    ids=["neighbour-incomplete", "other-replica-incomplete", "adjacent-stages-lost"],
)
def test_where_a_precondition_fails_every_rank_retrains_and_the_plan_says_why(
    lost: set[int], inflight: dict[int, int], why: str
) -> None:
    rep = reports(lost, inflight, r=2, k=1)
    assert why in (partial_blocker(RecoveryInputs.agree(rep, forced="pipechurn")) or "")
    plan = plan_recovery(rep, forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn", plan.reason
    assert "FULL RETRAIN of iteration 10 by every rank" in plan.reason and why in plan.reason


def test_a_survivor_that_stepped_the_iteration_in_flight_blocks_it() -> None:
    rep = [dataclasses.replace(r, last_stepped=10) if r.rank == 2 else r for r in reports({1})]
    inputs = RecoveryInputs.agree(rep, forced="pipechurn").rebased(9)
    assert "ranks [2] already stepped iteration 10" in (partial_blocker(inputs) or "")


def test_the_work_counted_for_the_full_retrain_is_every_ranks_passes() -> None:
    inputs = RecoveryInputs.agree(reports({1}), forced="pipechurn")
    got = retrain_summary(inputs, 4, "why")
    assert got["micro_batch_passes"] == 16 and got["micro_batch_passes_busiest"] == 4 and not got["partial"]


# ----------------------------------------------------------------------------- the keeper
class FakeEngine:
    """What the keeper reads of a PipelineEngine: a torch optimizer (gradients in ``param.grad``)."""

    def __init__(self, first: bool, last: bool, micro_batches: int = 2) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.global_steps = 5
        self.micro_batches = micro_batches
        self._first, self._last = first, last
        self.total_loss: Any = torch.tensor(1.5) if last else None

    def is_first_stage(self) -> bool:
        return self._first

    def is_last_stage(self) -> bool:
        return self._last

    def backward(self) -> None:
        self.module(torch.ones(4, 3)).sum().backward()


def test_the_keeper_holds_a_complete_copy_only_after_every_send_and_copies_the_gradients() -> None:
    eng = FakeEngine(first=True, last=False)
    keeper = InflightKeeper(lambda i, m: None, seed=1)
    eng.backward()
    acts = [torch.full((2,), float(m)) for m in range(2)]
    keeper.on_send(eng, "act", [acts[0]])
    keeper.before_reduce(eng)
    assert keeper.complete == -1  # one activation of two sent: the failure hit before the last pass
    keeper.restart()
    for a in acts:
        keeper.on_send(eng, "act", [a])
    keeper.before_reduce(eng)
    assert keeper.complete == 5
    assert [m[0] for m in keeper.messages("act", 5)] == acts and keeper.messages("grad", 5) == []
    kept = {n: p.grad.clone() for n, p in eng.module.named_parameters()}
    # An aborted all-reduce leaves the buffer half reduced: the copy is what the passes computed.
    for p in eng.module.parameters():
        assert p.grad is not None
        p.grad.mul_(3.0)
    rebuilt = FakeEngine(first=True, last=False)
    assert keeper.load_into(rebuilt, 5) == sum(g.numel() * 4 for g in kept.values())
    for n, p in rebuilt.module.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, kept[n])
    with pytest.raises(RuntimeError, match="no complete copy of iteration 6"):
        keeper.load_into(rebuilt, 6)


def test_the_last_stage_keeps_its_loss_and_a_new_iteration_drops_the_old_copy() -> None:
    eng = FakeEngine(first=False, last=True)
    keeper = InflightKeeper(lambda i, m: None, seed=1)
    eng.backward()
    for _ in range(2):
        keeper.on_send(eng, "grad", [torch.zeros(3), torch.ones(1)])  # a tuple message stays a tuple
    keeper.before_reduce(eng)
    assert keeper.complete == 5 and [len(m) for m in keeper.messages("grad", 5)] == [2, 2]
    rebuilt = FakeEngine(first=False, last=True)
    rebuilt.total_loss = None
    keeper.load_into(rebuilt, 5)
    assert torch.equal(rebuilt.total_loss, torch.tensor(1.5))
    eng.global_steps = 6
    keeper.on_send(eng, "grad", [torch.zeros(3)])
    assert keeper.complete == -1 and keeper.iteration == 6 and len(keeper.sends["grad"]) == 1


def test_the_keeper_exists_only_for_pipechurn_with_partial_recomputation() -> None:
    def cfg(strategy: str, partial: bool) -> Any:
        return SwiftConfig.from_dict({"strategy": strategy, "pipechurn": {"partial_recompute": partial}})

    assert kept_inflight(cfg("pipechurn", True), lambda i, m: None, 0) is not None
    assert kept_inflight(cfg("pipechurn", False), lambda i, m: None, 0) is None
    assert kept_inflight(cfg("tranlogs", True), lambda i, m: None, 0) is None


def test_finishing_the_iteration_runs_only_its_reductions_and_step_then_the_loss_aggregation() -> None:
    from ds_swift.recovery.state.inflight import finish_iteration

    ran: list[str] = []

    class Engine:
        module = torch.nn.Linear(1, 1)

        def _exec_schedule(self, sched: Any) -> None:
            assert sched.num_pipe_buffers() >= 1
            ran.extend(type(cmd).__name__ for step in sched for cmd in step)

        def _aggregate_total_loss(self) -> torch.Tensor:
            ran.append("loss")
            return torch.tensor(2.0)

    eng = Engine()
    eng.module.eval()
    assert float(finish_iteration(eng)) == 2.0 and eng.module.training
    assert ran == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep", "loss"]


def test_the_report_carries_the_iteration_in_flight_through_the_store() -> None:
    rep = reports({1})[0]
    assert rep.inflight == 10 and RankReport.from_json(rep.to_json()) == rep
