"""The bubble queue and hooks on a stand-in pipeline engine (same instruction seam, no processes).

``FakeEngine`` has what the hooks touch: an ``_INSTRUCTION_MAP`` whose handlers call
``p2p.send`` like DeepSpeed's do (including a ``_send_tensor_meta`` on the first send), a grid,
``global_steps`` advanced by the optimizer step, and ``module.training``. ``p2p.send`` itself is
replaced by a recorder: nothing goes on a wire.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MethodType
from typing import Any

import pytest
import torch
from deepspeed.runtime.pipe import p2p

from ds_swift.config import SwiftConfig
from ds_swift.msglog import LogReader, MachineBoundaryPlan, MessageLogError, install_message_logging
from ds_swift.patches.instructions import schedule
from ds_swift.testing.s3 import S3Server, s3_server


class FakeGrid:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_data_parallel_id(self) -> int:
        return 0

    def get_slice_parallel_rank(self) -> int:
        return 0

    def stage_to_global(self, stage_id: int) -> int:
        return stage_id  # pp only: rank == stage


class FakeModule:
    training = True


def _send_act(self: Any, buffer_id: int) -> None:
    outputs = self.outputs[buffer_id]
    if self.first_output_send:
        self.first_output_send = False
        self._send_tensor_meta(outputs, self.stage_id + 1)
    for t in outputs if isinstance(outputs, tuple) else (outputs,):
        p2p.send(t, self.stage_id + 1)


def _send_grad(self: Any, buffer_id: int) -> None:
    if self.fail_next_send:
        self.fail_next_send = False
        raise RuntimeError("Connection reset by peer")
    p2p.send(self.grads[buffer_id], self.stage_id - 1)


def _noop(self: Any, **kw: Any) -> None:
    pass


def _step(self: Any) -> None:
    self.global_steps += 1


class FakeEngine:
    _INSTRUCTION_MAP: dict[type, Callable[..., Any]] = {
        schedule.SendActivation: _send_act,
        schedule.SendGrad: _send_grad,
        schedule.RecvActivation: _noop,
        schedule.RecvGrad: _noop,
        schedule.OptimizerStep: _step,
        schedule.ForwardPass: _noop,
        schedule.BackwardPass: _noop,
        schedule.LoadMicroBatch: _noop,
        schedule.ReduceGrads: _noop,
        schedule.ReduceTiedGrads: _noop,
    }

    def __init__(self, rank: int, num_stages: int = 4) -> None:
        self.global_rank = rank
        self.stage_id = rank
        self.num_stages = num_stages
        self.grid = FakeGrid(rank)
        self.module = FakeModule()
        self.global_steps = 0
        self.first_output_send = True
        self.fail_next_send = False
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, torch.Tensor] = {}

    def _send_tensor_meta(self, outputs: Any, stage: int) -> None:
        p2p.send(torch.tensor([2, 3], dtype=torch.long), stage)

    def run(self, cmd: Any) -> None:
        MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    sent: list[torch.Tensor] = []

    def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> None:
        sent.append(tensor.clone())

    monkeypatch.setattr(p2p, "send", send)
    return sent


def cfg(tmp_path: Path, **logging: Any) -> SwiftConfig:
    return SwiftConfig.from_dict({"logging": {"storage": str(tmp_path / "logs"), "chunk_iterations": 2, **logging}})


PLAN = MachineBoundaryPlan(gpus_per_node=2)  # ranks 0,1 | 2,3: logged edges 1->2 (act), 2->1 (grad)


def one_iteration(e: FakeEngine, gas: int, seed: int) -> list[torch.Tensor]:
    """Stage-1-like: sends gas activations (recv-grad bubbles between), then the step."""
    produced = []
    for mb in range(gas):
        e.outputs[0] = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed * 100 + mb))
        produced.append(e.outputs[0])
        e.run(schedule.SendActivation(buffer_id=0))
        e.run(schedule.RecvGrad(buffer_id=0))
    e.run(schedule.OptimizerStep())
    return produced


def test_only_planned_edges_are_hooked(tmp_path: Path, wire: list) -> None:
    for rank, edges in ((0, []), (1, ["act"]), (2, ["grad"]), (3, [])):
        e = FakeEngine(rank)
        h = install_message_logging(e, PLAN, cfg(tmp_path), native=False)
        assert sorted(h.edges) == edges
        assert h.active == bool(edges)
        if rank == 1:
            assert e._INSTRUCTION_MAP[schedule.SendGrad] is FakeEngine._INSTRUCTION_MAP[schedule.SendGrad]
        h.remove()
        assert "_INSTRUCTION_MAP" not in e.__dict__


def test_bubble_only_copies_at_idle_points_and_numbers_timestamps(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(1)
    with install_message_logging(e, PLAN, cfg(tmp_path), native=False) as h:
        e.outputs[0] = torch.ones(3)
        e.run(schedule.SendActivation(buffer_id=0))
        assert h.stats.pending == 1 and h.stats.records == 0  # queued by reference, not staged
        e.run(schedule.RecvGrad(buffer_id=0))  # an idle point: drained to the writer
        assert h.stats.pending == 0 and h.stats.drains == 1
        e.run(schedule.OptimizerStep())
        produced = [torch.ones(3)] + one_iteration(e, 3, seed=1)[:]
        h.flush(10)
        assert h.stats.records == 4 and h.stats.messages_logged == 4
    # the meta send (first send only) went on the wire but not into the log
    assert len(wire) == 5 and wire[0].dtype == torch.long
    r = LogReader(tmp_path / "logs")
    assert torch.equal(r.get(0, 0, "act", 1, 2), produced[0])  # type: ignore[arg-type]
    for mb in range(3):
        assert torch.equal(r.get(1, mb, "act", 1, 2), produced[1 + mb])  # type: ignore[arg-type]
    assert [(rec.header.iteration, rec.header.micro_batch, rec.header.dst_rank) for rec in r.iter_records()] == [
        (0, 0, 2),
        (1, 0, 2),
        (1, 1, 2),
        (1, 2, 2),
    ]


def test_everything_is_drained_by_the_end_of_the_iteration(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(1)
    with install_message_logging(e, PLAN, cfg(tmp_path), native=False) as h:
        for mb in range(4):  # warm-up: sends with no receive in between
            e.outputs[mb] = torch.full((2,), float(mb))
            e.run(schedule.SendActivation(buffer_id=mb))
        assert h.stats.pending == 4
        e.run(schedule.OptimizerStep())
        assert h.stats.pending == 0


def test_tuples_are_one_message_of_several_parts(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(1)
    with install_message_logging(e, PLAN, cfg(tmp_path), native=False):
        e.outputs[0] = (torch.randn(4, 2), torch.arange(4))
        e.run(schedule.SendActivation(buffer_id=0))
        e.run(schedule.OptimizerStep())
    got = LogReader(tmp_path / "logs").get(0, 0, "act", 1, 2)
    assert isinstance(got, tuple) and len(got) == 2
    assert torch.equal(got[0], e.outputs[0][0]) and torch.equal(got[1], e.outputs[0][1])


def test_bubble_only_false_stages_at_the_send(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(2)
    with install_message_logging(e, PLAN, cfg(tmp_path, bubble_only=False), native=False) as h:
        e.grads[0] = torch.randn(5)
        e.run(schedule.SendGrad(buffer_id=0))
        assert h.stats.pending == 0 and h.stats.drains == 0
        h.flush(10)
        assert h.stats.records == 1
    assert torch.equal(LogReader(tmp_path / "logs").get(0, 0, "grad", 2, 1), e.grads[0])  # type: ignore[arg-type]


def test_eval_and_failed_sends_are_not_logged(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(2)
    with install_message_logging(e, PLAN, cfg(tmp_path), native=False) as h:
        e.module.training = False
        e.grads[0] = torch.randn(5)
        e.run(schedule.SendGrad(buffer_id=0))
        e.module.training = True
        e.fail_next_send = True
        with pytest.raises(RuntimeError, match="reset by peer"):
            e.run(schedule.SendGrad(buffer_id=0))
        assert h.stats.messages_logged == 0
        e.run(schedule.SendGrad(buffer_id=0))
        h.flush(10)
        assert h.stats.records == 1
    # the one logged send is micro-batch 0: failed/eval sends took no number
    assert LogReader(tmp_path / "logs").get(0, 0, "grad", 2, 1) is not None


def test_a_sent_tensor_modified_in_place_later(tmp_path: Path, wire: list) -> None:
    """Why copy_mode exists: 'ref' logs whatever the buffer holds at the bubble, 'clone' what was sent.

    DeepSpeed never writes a sent tensor in place (see msglog.staging); an engine that did would
    need copy_mode='clone'. The pipeline test checks 'ref' against what the receiver got.
    """
    for mode, expected in (("ref", 7.0), ("clone", 1.0)):
        e = FakeEngine(1)
        d = tmp_path / mode
        with install_message_logging(e, PLAN, cfg(d), native=False, copy_mode=mode):  # type: ignore[arg-type]
            e.outputs[0] = torch.ones(3)
            e.run(schedule.SendActivation(buffer_id=0))
            e.outputs[0].fill_(7.0)  # reuse of the buffer before the bubble
            e.run(schedule.OptimizerStep())
        assert torch.equal(LogReader(d / "logs").get(0, 0, "act", 1, 2), torch.full((3,), expected))  # type: ignore[arg-type]


def test_flush_from_another_thread_writes_the_queue(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(1)
    h = install_message_logging(e, PLAN, cfg(tmp_path), native=False)
    for mb in range(3):
        e.outputs[0] = torch.full((4,), float(mb))
        e.run(schedule.SendActivation(buffer_id=0))
    assert h.stats.pending == 3  # the training thread is now "blocked"; a watchdog flushes
    t = threading.Thread(target=h.flush, args=(10,))
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert h.stats.records == 3 and h.stats.pending == 0
    r = LogReader(tmp_path / "logs")
    assert [float(r.get(0, mb, "act", 1, 2)[0]) for mb in range(3)] == [0.0, 1.0, 2.0]  # type: ignore[index]
    h.remove()


def test_restart_iteration_numbers_a_rerun_from_zero(tmp_path: Path, wire: list) -> None:
    e = FakeEngine(1)
    with install_message_logging(e, PLAN, cfg(tmp_path), native=False) as h:
        e.outputs[0] = torch.zeros(2)
        e.run(schedule.SendActivation(buffer_id=0))  # iteration 0, micro-batch 0, then a failure
        h.restart_iteration()
        e.outputs[0] = torch.ones(2)
        e.run(schedule.SendActivation(buffer_id=0))  # the re-run's first send
        e.run(schedule.OptimizerStep())
    assert torch.equal(LogReader(tmp_path / "logs").get(0, 0, "act", 1, 2), torch.ones(2))  # type: ignore[arg-type]


def test_a_failed_write_surfaces_on_the_training_thread(
    tmp_path: Path, wire: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = FakeEngine(1)
    h = install_message_logging(e, PLAN, cfg(tmp_path), native=False)
    real = os.writev
    disk_full = threading.Event()

    def writev(fd: int, buffers: list) -> int:
        if disk_full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    disk_full.set()
    e.outputs[0] = torch.zeros(2)
    e.run(schedule.SendActivation(buffer_id=0))
    e.run(schedule.OptimizerStep())
    with pytest.raises(OSError, match="disk full"):
        h.flush(10)  # the failure path hears of it
    e.outputs[0] = torch.zeros(2)
    e.run(schedule.SendActivation(buffer_id=0))
    e.run(schedule.RecvGrad(buffer_id=0))  # drained: the write fails on the writer thread
    assert h._writer is not None
    h._writer.call(lambda w: None, 10)  # wait for it without consuming the error
    with pytest.raises(MessageLogError, match="rank 1 lost records.*disk full"):
        e.run(schedule.RecvGrad(buffer_id=0))  # and so does training, at its next idle point
    disk_full.clear()
    assert h.stats.failed_messages == 2
    h.remove()


def test_a_disk_that_takes_nothing_stops_logging_and_training_goes_on(
    tmp_path: Path, wire: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung disk used to hold the send (the writer's queue full) until the hang detector took this
    healthy machine; after watchdog.op_timeout_s without one message written, logging stops, loudly."""
    e = FakeEngine(1)
    said: list[str] = []
    config = SwiftConfig.from_dict(
        {"logging": {"storage": str(tmp_path / "logs"), "chunk_iterations": 2}, "watchdog": {"op_timeout_s": 0.5}}
    )
    h = install_message_logging(e, PLAN, config, native=False, max_inflight_bytes=64, on_error=said.append)
    real, hung = os.writev, threading.Event()

    def writev(fd: int, buffers: list) -> int:
        hung.wait(60.0)
        return real(fd, buffers)

    monkeypatch.setattr(os, "writev", writev)
    try:
        for mb in range(3):  # 128-byte messages: the first is in writev, the second waits for room
            e.outputs[0] = torch.full((8, 4), float(mb))
            e.run(schedule.SendActivation(buffer_id=0))
            e.run(schedule.RecvGrad(buffer_id=0))  # the idle point drains: returns, it does not hang
        assert len(said) == 1 and "rank 1 lost records" in said[0] and "no item finished" in said[0]
        assert h.lost == said[0]
        e.run(schedule.OptimizerStep())  # training goes on
    finally:
        hung.set()
        h.remove()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.mark.parametrize("scheme", ["memory", "s3"])
def test_upload_and_gc_in_the_store(tmp_path: Path, wire: list, scheme: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("s3").url() if scheme == "s3" else f"memory://ds-swift-logger-{uuid.uuid4().hex}"
    e = FakeEngine(1)
    c = SwiftConfig.from_dict(
        {"logging": {"storage": url, "local_dir": str(tmp_path / "local"), "chunk_iterations": 2}}
    )
    with install_message_logging(e, PLAN, c, native=False) as h:
        for it in range(5):
            one_iteration(e, 2, seed=it)
        uploaded = h.upload()
        assert len(uploaded) == 3 * 2  # 3 chunks (iterations 0-1, 2-3, 4) + their indexes
        assert h.upload() == []  # nothing changed since
        r = LogReader(url, cache_dir=str(tmp_path / "cache"))
        assert len(r.chunk_names()) == 3 and r.verify().ok
        deleted = h.gc_before(4, store_url=url)  # checkpoint at iteration 4
        assert len(deleted) == 2 * 2 * 2  # local + store, 2 chunks, chunk + index
    assert {cn.first_iteration for cn in LogReader(url, cache_dir=str(tmp_path / "c2")).chunk_names()} == {4}
    from ds_swift.storage import open_store

    # nothing of the collected chunks is left, and of each upload only the last version
    left = open_store(url).backend.list()
    assert len(left) == 2 * 2 and all("_it0000000004-" in n for n in left), left
    assert {cn.first_iteration for cn in LogReader(tmp_path / "local").chunk_names()} == {4}


@pytest.mark.parametrize("bubble_only", [False, True])
@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("CUDA error: out of memory")])
def test_a_staging_error_stops_logging_loudly_and_training_goes_on(
    tmp_path: Path, wire: list, monkeypatch: pytest.MonkeyPatch, bubble_only: bool, error: Exception
) -> None:
    """Staging a sent tensor (host or pinned memory) can fail with more than an OSError; raised from
    the hook, it reached DeepSpeed's p2p send and ended a healthy job."""
    from ds_swift.msglog import logger

    class Failing:
        def stage(self, tensors: list[torch.Tensor]) -> object:
            raise error

    monkeypatch.setattr(logger, "make_stager", lambda device, native: Failing())
    e = FakeEngine(1)
    said: list[str] = []
    h = install_message_logging(e, PLAN, cfg(tmp_path, bubble_only=bubble_only), native=False, on_error=said.append)
    try:
        e.outputs[0] = torch.zeros(2)
        e.run(schedule.SendActivation(buffer_id=0))
        e.run(schedule.RecvGrad(buffer_id=0))
        e.run(schedule.OptimizerStep())  # training goes on
        assert len(said) == 1 and "rank 1 lost records" in said[0] and h.lost == said[0], said
        assert ("out of memory" in said[0]) == isinstance(error, RuntimeError)
    finally:
        h.remove()
