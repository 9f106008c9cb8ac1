"""State transfer (ds_swift.recovery.strategies.replication) and what a survivor keeps (ds_swift.recovery.kept)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.transfer import flatten, hand_over, recv_state, send_state, unflatten


class Wire:
    """In-process stand-in for dist.send/recv: a FIFO of tensor copies."""

    def __init__(self) -> None:
        self.q: collections.deque[torch.Tensor] = collections.deque()
        self.sends = 0
        self.sent_from: list[int] = []  # the storage each message was sent from

    def send(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self.q.append(t.clone())
        self.sends += 1
        self.sent_from.append(t.data_ptr())

    def recv(self, t: torch.Tensor, src: int, group: Any = None) -> None:
        t.copy_(self.q.popleft())


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "module": collections.OrderedDict(w=torch.randn(3, 4, generator=g), b=torch.randn(4, generator=g)),
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=g)}},
            "param_groups": [{"lr": 1e-3, "params": [0, 1], "betas": (0.9, 0.95)}],
        },
        "lr_scheduler": None,
        "counters": {"global_steps": 7},
        "rng": {"torch": torch.get_rng_state()},
        "ids": torch.arange(5, dtype=torch.long),
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_send_recv_round_trip_is_bitwise() -> None:
    wire = Wire()
    s = state()
    sent = send_state(s, dst=1, send=wire.send)
    got = recv_state(src=0, recv=wire.recv)
    assert_same(s, got)
    assert not wire.q
    # length + skeleton + each tensor as it lies in memory (w, b, step, exp_avg, the RNG state, ids):
    # no flat copy of the state before it goes (issue 50: a restore at link speed).
    assert wire.sends == 2 + 6
    assert wire.sent_from[2] == s["module"]["w"].data_ptr()
    assert sent > 0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16]),
            st.lists(st.integers(0, 4), max_size=3),
        ),
        max_size=6,
    )
)
def test_flatten_round_trip(specs: list[tuple[torch.dtype, list[int]]]) -> None:
    obj = {"t": [torch.zeros(shape, dtype=dtype) + i for i, (dtype, shape) in enumerate(specs)], "x": (1, "a")}
    skeleton, tensors = flatten(obj)
    assert len(tensors) == len(specs)
    assert_same(unflatten(skeleton, tensors), obj)
    wire = Wire()
    send_state(obj, 1, send=wire.send)
    assert_same(recv_state(0, recv=wire.recv), obj)


class FakeEngine:
    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1)
        self.global_steps = 8


class FakeUndo:
    """What KeptState.capture needs of ds_swift.undo.EngineUndoHandle (its public side only)."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine: FakeEngine | None = engine
        self.optimizer = self  # the InvertibleOptimizer
        self.last_stepped_iteration = 7
        self.last_record: Any = None
        self.can_undo = True
        self.undone = 0
        self.detached = False

    def detach(self) -> FakeUndo:
        self.detached = True
        self.engine = None
        return self.optimizer

    def undo(self) -> None:
        self.undone += 1


def test_kept_state_keeps_references_and_undoes_once() -> None:
    engine = FakeEngine()
    handle = FakeUndo(engine)
    kept = KeptState.capture(engine, handle)
    assert handle.detached and handle.engine is None
    assert kept.last_stepped == 7 and kept.can_undo
    w = engine.module.weight
    assert kept.module["weight"].data_ptr() == w.data_ptr()  # no copy
    kept.undo_to(7)
    assert handle.undone == 0  # already at the consensus
    kept.undo_to(6)
    assert handle.undone == 1 and kept.last_stepped == 6 and not kept.can_undo
    with pytest.raises(RuntimeError):
        kept.undo_to(5)


def test_kept_state_without_undo_counts_global_steps() -> None:
    kept = KeptState.capture(FakeEngine(), None)
    assert kept.last_stepped == 7 and not kept.can_undo
    assert set(kept.state()) == {"module", "optimizer", "lr_scheduler", "rng"}


def test_a_step_that_failed_before_touching_parameters_does_not_count() -> None:
    """DeepSpeed all-reduces the clipping norm inside the step: a peer dying there leaves the
    undo handle with a failed, empty record for iteration 8 while only 0..7 were applied."""
    engine = FakeEngine()  # global_steps 8: iterations 0..7 stepped
    handle = FakeUndo(engine)
    handle.last_stepped_iteration = 8

    class Record:
        iteration, complete, prev_iteration = 8, False, 7
        groups: list[Any] = []

    handle.last_record = Record()
    kept = KeptState.capture(engine, handle)
    assert kept.last_stepped == 7
    assert not kept.can_undo  # the record left describes the empty step, not iteration 7's


@pytest.mark.parametrize("posted", [False, True])
def test_hand_over_sends_to_each_recipient_then_receives_from_the_donor(
    monkeypatch: pytest.MonkeyPatch, posted: bool
) -> None:
    """One rank's part of a transfer, on an in-process wire: its sends first (each recipient's own
    state, in order, through the transport, every message of a state posted before any is waited
    for), then its receive; a posted send is waited for last, after the receive."""
    from ds_swift import transport

    wire, order, waited = Wire(), [], []

    class Work:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def wait(self) -> None:
            if self.kind == "send":
                waited.append(len(order))

    def isend(t: torch.Tensor, dst: int, group: Any = None) -> Work:
        order.append(("send", dst))
        wire.send(t, dst, group)
        return Work("send")

    def irecv(t: torch.Tensor, src: int, group: Any = None) -> Work:
        order.append(("recv", src))
        wire.recv(t, src, group)
        return Work("recv")

    monkeypatch.setattr(transport, "isend", isend)
    monkeypatch.setattr(transport, "irecv", irecv)
    states = {5: {"w": torch.arange(3.0)}, 6: {"w": torch.arange(4.0)}}
    said: list[tuple[int, int]] = []
    # The wire is one FIFO: what this rank sent to 5 and 6 comes back as if from a donor, 5's first.
    got, sent = hand_over([5, 6], states.__getitem__, 9, posted=posted, on_sent=lambda d, n: said.append((d, n)))
    assert torch.equal(got["w"], states[5]["w"])
    assert sent == sum(n for _, n in said) and [d for d, _ in said] == [5, 6]
    assert [o for o in order if o[0] == "send"][0] == ("send", 5) and order[-1] == ("recv", 9)
    sends = sum(1 for o in order if o[0] == "send")
    assert len(waited) == sends
    first_recv = order.index(("recv", 9))
    # posted: waited for after the receive; else each state's messages before the next one's, all before it
    assert all(w == len(order) for w in waited) if posted else all(w <= first_recv for w in waited)
    none, _ = hand_over([], states.__getitem__, None)
    assert none is None
