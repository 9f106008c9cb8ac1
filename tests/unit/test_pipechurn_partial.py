"""PipeChurn's partial recomputation, its pieces: who may recompute partially (a pure decision on the
consensus reports; who keeps which passes: test_pipechurn_passes.py), and the copy each rank keeps
of the iteration in flight."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from ds_swift.config import SwiftConfig
from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.holdings import BuddyHeld, InflightHeld, holdings_of
from ds_swift.recovery.registry import plan_recovery
from ds_swift.recovery.state.buddies import Member
from ds_swift.recovery.state.erasure import assign_holders
from ds_swift.recovery.state.inflight import InflightKeeper, kept_inflight
from ds_swift.recovery.strategies.pipechurn import partial_blocker, retrain_summary
from ds_swift.recovery.strategies.pipechurn_passes import transfers


def reports(
    lost: set[int],
    inflight: dict[int, int] | None = None,
    pp: int = 2,
    dp: int = 2,
    last: int = 9,
    k: int = 2,
    r: int = 1,
) -> list[RankReport]:
    """One rank per machine, rank = stage * dp + dp_rank (DeepSpeed's pipe-data order); every
    survivor holds chunks of ``last`` and a complete copy of ``last + 1`` unless ``inflight`` says otherwise."""
    machines = pp * dp
    placement = assign_holders([Member(rank=m, machine=m) for m in range(machines)], k, r)
    out = []
    for rank in range(machines):
        survivor = rank not in lost
        held = tuple((o, last, hs.index(rank)) for o, hs in sorted(placement.items()) if rank in hs) if survivor else ()
        out.append(
            RankReport(
                rank=rank,
                survivor=survivor,
                stage=rank // dp,
                dp=rank % dp,
                tp=0,
                machine=rank,
                last_stepped=last if survivor else -1,
                can_undo=survivor,
                holdings=holdings_of(
                    BuddyHeld(chunks=held, k=k),
                    InflightHeld(
                        iteration=(inflight or {}).get(rank, last + 1) if survivor else -1,
                        passes=(-1 if (inflight or {}).get(rank) == -1 else 4) if survivor else -1,
                    ),
                ),
            )
        )
    return out


def test_lost_passes_alone_are_recomputed_when_every_survivor_holds_the_iteration_in_flight() -> None:
    inputs = RecoveryInputs.agree(reports({1}), forced="pipechurn")
    assert partial_blocker(inputs) is None
    # Rank 1 (stage 0 of replica 1) gets the gradients rank 3 (its stage 1) sent it.
    assert [(t.src, t.dst, t.kind, list(t.micro_batches)) for t in transfers(inputs, 4)] == [
        (3, 1, "grad", [0, 1, 2, 3])
    ]
    plan = plan_recovery(reports({1}), forced="pipechurn", checkpoint_step=6)
    assert plan.strategy == "pipechurn" and "of iteration 10, only the lost ranks' passes are recomputed" in plan.reason
    assert "had not finished" not in plan.reason
    # A middle stage is fed from both sides, activations from the stage before it.
    inputs = RecoveryInputs.agree(reports({3}, pp=3, dp=2, r=2), forced="pipechurn")
    assert partial_blocker(inputs) is None
    assert {(t.src, t.kind) for t in transfers(inputs, 4) if t.dst == 3} == {(1, "act"), (5, "grad")}
    # Two lost ranks on adjacent stages redo their passes together, live between them.
    inputs = RecoveryInputs.agree(reports({1, 3}, r=2, k=1), forced="pipechurn")
    assert partial_blocker(inputs) is None and transfers(inputs, 4) == []


def test_a_survivor_midway_through_the_iteration_redoes_the_rest_and_the_plan_says_so() -> None:
    def two_passes(r: RankReport) -> RankReport:
        held = dataclasses.replace(InflightHeld.of(r), passes=2)
        return dataclasses.replace(r, holdings={**r.holdings, **holdings_of(held)})

    rep = [two_passes(r) if r.rank == 3 else r for r in reports({1})]
    plan = plan_recovery(rep, forced="pipechurn", checkpoint_step=6)
    assert "only the lost ranks' passes are recomputed, and the passes survivors [3] had not finished" in plan.reason


def test_survivors_that_all_stopped_midway_are_all_said_to_redo_passes() -> None:
    """Every survivor two passes into an iteration of four (the kill came early for all of them):
    each redoes two, and the plan says so, which it could not when it compared survivors only with
    one another (a timing-dependent reason: tests/dist/test_pipechurn_midway.py)."""

    def midway(r: RankReport) -> RankReport:
        held = dataclasses.replace(InflightHeld.of(r), passes=2, micro_batches=4) if r.survivor else InflightHeld.of(r)
        return dataclasses.replace(r, holdings={**r.holdings, **holdings_of(held)})

    plan = plan_recovery([midway(r) for r in reports({1})], forced="pipechurn", checkpoint_step=6)
    assert "the passes survivors [0, 2, 3] had not finished when the failure hit (they hold [2, 2, 2]" in plan.reason


def test_where_a_survivor_keeps_no_copy_every_rank_retrains_and_the_plan_says_why() -> None:
    rep = reports({1}, {3: -1}, r=2, k=1)
    why = "ranks [3] keep no copy of iteration 10 (pipechurn.partial_recompute off)"
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
        # What DeepSpeed's backward leaves for SendGrad (patches.deepspeed_engine.backward_output).
        self.is_grad_partitioned = self.has_attention_mask = self.has_bool_tensors = False
        self.pipe_buffers: dict[str, list[Any]] = {"inputs": [None, None]}

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
    with pytest.raises(RuntimeError, match="no copy of iteration 6's gradients"):
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


def test_a_failure_between_passes_keeps_the_finished_backward_passes_and_their_unsent_gradient() -> None:
    """The last stage ran forward and backward of micro-batches 0 and 1 and sent gradient 0; the
    failure hit at the send of gradient 1. The teardown copies the gradients accumulated over both
    passes, and gradient 1 is kept from the backward pass itself."""
    eng = FakeEngine(first=False, last=True)
    keeper = InflightKeeper(lambda i, m: None, seed=1)
    outs = [torch.full((3,), float(k)) for k in range(2)]

    def backward(k: int) -> None:
        eng.backward()
        x = torch.zeros(3, requires_grad=True)
        x.grad = outs[k]
        eng.pipe_buffers["inputs"][k] = x

    for k in range(2):
        keeper._forward(eng, lambda: None)
        keeper._backward(eng, lambda k=k, **kw: backward(k), buffer_id=k)
        if k == 0:
            keeper.on_send(eng, "grad", [outs[0]])
    keeper.on_teardown(eng)
    assert keeper.held() == InflightHeld(5, 2, 2, micro_batches=2)
    assert [m[0] for m in keeper.kept_messages("grad", 5, range(2))] == outs
    kept = {n: p.grad.clone() for n, p in eng.module.named_parameters()}
    rebuilt = FakeEngine(first=False, last=True)
    keeper.load_into(rebuilt, 5)
    for n, p in rebuilt.module.named_parameters():
        assert torch.equal(p.grad, kept[n])
    with pytest.raises(RuntimeError, match="no kept grad of micro-batch 2"):
        keeper.kept_messages("grad", 5, range(3))


def test_a_failure_inside_a_backward_pass_keeps_no_pass(caplog: pytest.LogCaptureFixture) -> None:
    eng = FakeEngine(first=True, last=False)
    keeper = InflightKeeper(lambda i, m: None, seed=1)
    keeper._backward(eng, lambda **kw: eng.backward(), buffer_id=0)

    def dies(**kw: Any) -> None:
        raise RuntimeError("a tensor-parallel all-reduce inside the pass failed")

    with pytest.raises(RuntimeError):
        keeper._backward(eng, dies, buffer_id=1)
    with caplog.at_level(logging.INFO):
        keeper.on_teardown(eng)
    assert keeper.held() == InflightHeld(5, 0, 0) and keeper.grads is None
    assert "the failure hit inside a backward pass" in caplog.text


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
    back = RankReport.from_json(rep.to_json())
    assert InflightHeld.of(back) == InflightHeld(iteration=10, passes=4, forwards=0) and back == rep
