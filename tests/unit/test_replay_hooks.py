"""Replay's pieces without a pipeline: edge plan, tensor-meta synthesis, served/dropped p2p, collectives."""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe.engine import PipelineEngine
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.msglog.edge import LogEdge
from ds_swift.patches.pipe_p2p import drop_sends
from ds_swift.patches.step_collectives import wrap_collectives
from ds_swift.recovery.replay.collectives import (
    CollectiveGuard,
    CollectiveRecord,
    CollectiveRecorder,
    ReplayUnsupported,
)
from ds_swift.recovery.replay.log import LogUnavailable
from ds_swift.recovery.replay.plan import plan_replay
from ds_swift.recovery.replay.serve import meta_message, recv_from_log


# --------------------------------------------------------------------------- plan
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3), st.data())
def test_plan_reads_from_the_log_exactly_the_edges_leaving_the_group(pp: int, dp: int, data: st.DataObject) -> None:
    # rank = stage * dp + d ('pipe' outer), one data-parallel replica d
    d = data.draw(st.integers(0, dp - 1))
    ranks = [s * dp + d for s in range(pp)]
    group = frozenset(data.draw(st.sets(st.sampled_from(ranks), min_size=1)))
    for stage, rank in enumerate(ranks):
        if rank not in group:
            with pytest.raises(ValueError):
                plan_replay(rank, stage, pp, d, 0, 4, None, None, group)
            continue
        prev = ranks[stage - 1] if stage > 0 else None
        nxt = ranks[stage + 1] if stage + 1 < pp else None
        plan = plan_replay(rank, stage, pp, d, 0, 4, prev, nxt, group)
        want = []
        if prev is not None and prev not in group:
            want.append(LogEdge("act", stage - 1, stage, d, 0))
        if nxt is not None and nxt not in group:
            want.append(LogEdge("grad", stage + 1, stage, d, 0))
        assert list(plan.from_log) == want
        assert plan.drop_act == (nxt is not None and nxt not in group)
        assert plan.drop_grad == (prev is not None and prev not in group)


# --------------------------------------------------------------------------- tensor meta
FAKE_ENGINE = SimpleNamespace(DTYPE_TO_ID=PipelineEngine.DTYPE_TO_ID, device="cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.float64]
shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


def sent_meta(buffer: Any, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(p2p, "send", lambda t, dest, async_op=False: sent.append(t.clone()))
    PipelineEngine._send_tensor_meta(FAKE_ENGINE, buffer, 1)  # type: ignore[arg-type]
    assert len(sent) == 1
    return sent[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=4), st.booleans())
def test_meta_is_what_deepspeed_sends(parts: list[tuple[torch.dtype, tuple[int, ...]]], as_tuple: bool) -> None:
    tensors = tuple(torch.zeros(shape, dtype=dtype) for dtype, shape in parts)
    msg: Any = tensors if as_tuple or len(tensors) > 1 else tensors[0]
    with pytest.MonkeyPatch.context() as mp:
        want = sent_meta(msg, mp)
    # DeepSpeed sends an uninitialised buffer: only the prefix it filled is read by the receiver
    used = 2 + sum(2 + t.dim() for t in tensors) if isinstance(msg, tuple) else 3 + msg.dim()
    assert torch.equal(meta_message(FAKE_ENGINE, msg, "test")[:used], want[:used])


# --------------------------------------------------------------------------- served receives
def test_served_receive_fills_the_handlers_buffers_in_order() -> None:
    original = p2p.recv
    items = [torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8], dtype=torch.long)]
    bufs = [torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)]

    def handler() -> str:
        for b in bufs:
            p2p.recv(b, 0)
        return "done"

    assert recv_from_log(handler, {}, items, "test") == "done"
    assert p2p.recv is original
    assert all(torch.equal(a, b) for a, b in zip(bufs, items))


@pytest.mark.parametrize(
    "bufs, match",
    [
        ([torch.zeros(3)], "holds 2 tensors, the stage received 1"),
        ([torch.zeros(3), torch.zeros(3), torch.zeros(3)], "receives more tensors"),
        ([torch.zeros(3), torch.zeros(4)], r"tensor 1 of the log record is torch.float32 \(3,\)"),
        ([torch.zeros(3), torch.zeros(3, dtype=torch.float16)], "receive buffer is torch.float16"),
    ],
)
def test_served_receive_mismatch_is_log_unavailable(bufs: list[torch.Tensor], match: str) -> None:
    original = p2p.recv

    def handler() -> None:
        for b in bufs:
            p2p.recv(b, 0)

    with pytest.raises(LogUnavailable, match=match):
        recv_from_log(handler, {}, [torch.ones(3), torch.ones(3)], "test")
    assert p2p.recv is original


def test_served_receive_leaves_other_threads_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    wire: list[str] = []
    monkeypatch.setattr(p2p, "recv", lambda t, src, async_op=False: wire.append("wire"))

    def handler() -> None:
        t = threading.Thread(target=lambda: p2p.recv(torch.zeros(1), 0))
        t.start()
        t.join(10)
        p2p.recv(torch.zeros(1), 0)

    recv_from_log(handler, {}, [torch.ones(1)], "test")
    assert wire == ["wire"]


def test_dropped_send_sends_nothing_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    wire: list[torch.Tensor] = []
    monkeypatch.setattr(p2p, "send", lambda t, dest, async_op=False: wire.append(t))
    installed = p2p.send

    def handler(x: int) -> int:
        p2p.send(torch.ones(2), 1)
        raise_now = x < 0
        if raise_now:
            raise RuntimeError("boom")
        return x

    with drop_sends():
        assert handler(3) == 3
    with pytest.raises(RuntimeError), drop_sends():
        handler(-1)
    assert wire == [] and p2p.send is installed


# --------------------------------------------------------------------------- collectives
def test_recorder_bytes_round_trip_and_discard() -> None:
    rec = CollectiveRecorder(
        {
            (3, 0): CollectiveRecord("all_reduce", (0, 1, 2, 3), torch.tensor(1.5)),
            (3, 1): CollectiveRecord("all_reduce", (2,), torch.tensor([0.25])),
            (4, 0): CollectiveRecord("broadcast", (0, 2), torch.arange(3, dtype=torch.int64)),
        }
    )
    back = CollectiveRecorder.from_bytes(rec.to_bytes())
    assert back.records.keys() == rec.records.keys()
    for k, v in rec.records.items():
        w = back.records[k]
        assert (w.name, w.ranks, w.tensor.dtype, w.tensor.shape) == (v.name, v.ranks, v.tensor.dtype, v.tensor.shape)
        assert torch.equal(w.tensor, v.tensor)
    back.discard_before(4)
    assert list(back.records) == [(4, 0)]


def test_guard_takes_step_collectives_from_records_and_refuses_the_rest(gloo_world: Any) -> None:
    original = dist.all_reduce
    records = {(7, 0): CollectiveRecord("all_reduce", (0,), torch.tensor(42.0))}  # shape () stands in for (1,)
    guard = CollectiveGuard(frozenset({5}), records)
    with wrap_collectives("test", guard.make):
        t = torch.tensor([1.0])
        with pytest.raises(ReplayUnsupported, match="ranks \\[0\\] are not replaying"):
            dist.all_reduce(t)  # outside the optimizer step
        guard.begin_step(7)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        assert t.tolist() == [42.0] and guard.substituted == 1
        with pytest.raises(LogUnavailable, match="no recorded result of optimizer step collective #1"):
            dist.all_reduce(torch.tensor([1.0]))
        guard.end_step()
        guard.begin_step(7)
        with pytest.raises(LogUnavailable, match="record of step collective #0"):
            dist.all_reduce(torch.zeros(2))  # a different collective than the one recorded
        guard.end_step()
    assert dist.all_reduce is original
    # inside the group: live (and an async all-reduce of a 1-rank world just works)
    live = CollectiveGuard(frozenset({0}), None)
    with wrap_collectives("test", live.make):
        t = torch.tensor([3.0])
        dist.all_reduce(t)
        assert t.tolist() == [3.0]
    none = CollectiveGuard(frozenset({5}), None)
    with wrap_collectives("test", none.make):
        none.begin_step(0)
        with pytest.raises(ReplayUnsupported, match="CollectiveRecorder"):
            dist.all_reduce(torch.tensor([1.0]))


def test_guard_async_collective_returns_a_completed_work(gloo_world: Any) -> None:
    guard = CollectiveGuard(frozenset({5}), {(0, 0): CollectiveRecord("broadcast", (0,), torch.tensor([9.0]))})
    with wrap_collectives("test", guard.make):
        guard.begin_step(0)
        t = torch.tensor([1.0])
        work = dist.broadcast(t, src=0, async_op=True)
        assert work.wait() and work.is_completed() and t.tolist() == [9.0]


def test_recorder_keeps_a_copy_of_each_step_all_reduce_where_the_tensor_lives(gloo_world: Any) -> None:
    # The record is a copy taken after the collective (a later in-place change of the tensor does not
    # reach it), made where the tensor lives (no host copy in the step: tests/gpu checks no sync).
    rec = CollectiveRecorder()
    rec._begin_step(SimpleNamespace(global_steps=5))
    make = rec._make
    t = torch.tensor([2.0, 3.0])
    call = make("all_reduce", dist.all_reduce, inspect.signature(dist.all_reduce))
    call(t)
    t.add_(1.0)
    assert list(rec.records) == [(5, 0)]
    got = rec.records[(5, 0)]
    assert got.name == "all_reduce" and got.ranks == (0,) and got.tensor.tolist() == [2.0, 3.0]
    assert got.tensor.device == t.device and got.tensor.data_ptr() != t.data_ptr()
    assert CollectiveRecorder.from_bytes(rec.to_bytes()).records[(5, 0)].tensor.tolist() == [2.0, 3.0]


def test_recorder_numbers_every_step_collective_as_the_replay_guard_does(gloo_world: Any) -> None:
    # The guard counts every collective of the step; a record keyed by another count would be
    # substituted for the wrong collective in a replay.
    rec = CollectiveRecorder()
    rec._begin_step(SimpleNamespace(global_steps=2))
    gather = rec._make("all_gather", dist.all_gather, inspect.signature(dist.all_gather))
    reduce = rec._make("all_reduce", dist.all_reduce, inspect.signature(dist.all_reduce))
    out = [torch.zeros(1)]
    gather(out, torch.ones(1))
    reduce(torch.tensor([4.0]), group=dist.group.WORLD)
    assert list(rec.records) == [(2, 1)] and rec.records[(2, 1)].ranks == (0,)
    rec._begin_step(SimpleNamespace(global_steps=3))
    reduce(torch.tensor([5.0]))
    assert list(rec.records) == [(2, 1), (3, 0)]
