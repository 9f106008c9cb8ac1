"""ds_swift.transport in one process: routing and strict mode, JSON agreements, and the decisions of
ending a generation on gloo and on NCCL (NCCL cannot run here: its branch is driven with fakes)."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ds_swift.transport as transport
import ds_swift.transport.shutdown as teardown
from ds_swift.detect.watchdog import FailureSeen, Watchdog
from ds_swift.transport.core import Transport, route_problem
from ds_swift.transport.shutdown import (
    TeardownPlan,
    check_nccl_environment,
    nccl_environment,
    parse_backends,
    plan_teardown,
    wake_action,
)

NCCL, GLOO = frozenset({"nccl"}), frozenset({"gloo"})


@pytest.fixture
def one_rank() -> Iterator[Transport]:
    """A one-rank gloo world with its transport open (strict mode on)."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=20)
    )
    transport.set_strict(True)
    try:
        yield transport.open_generation(20.0, generation=0)
    finally:
        transport.set_strict(None)
        transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_transports_gloo_threads_do_not_preempt_on_wakeup_and_the_caller_keeps_its_policy() -> None:
    """The threads gloo starts for ds-swift's groups (they carry the buddy copies beside training)
    run under SCHED_BATCH; the rank's own thread, and threads it starts later, do not."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=20)
    )
    try:
        before = set(os.listdir("/proc/self/task"))
        transport.open_generation(20.0, generation=0)
        started = set(os.listdir("/proc/self/task")) - before
        assert started  # gloo's loop and work threads of the transport's groups
        assert {os.sched_getscheduler(int(tid)) for tid in started} == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        before = set(os.listdir("/proc/self/task"))
        dist.new_group(backend="gloo")  # DeepSpeed's groups, made after: as the job's own
        later = set(os.listdir("/proc/self/task")) - before
        assert later and {os.sched_getscheduler(int(tid)) for tid in later} == {os.SCHED_OTHER}
    finally:
        transport.close()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- routing
def test_a_host_tensor_may_only_go_on_the_transports_gloo_groups() -> None:
    world = route_problem("send", "cpu", None)
    assert world is not None and "NCCL on a GPU cluster" in world and "leave group= unset" in world
    assert route_problem("isend", "cpu", transport.HOST) is None
    assert route_problem("irecv", "cpu", transport.COPIER) is None


def test_a_device_tensor_may_not_go_on_a_gloo_group() -> None:
    gloo = route_problem("send", "cuda", transport.HOST)
    assert gloo is not None and "cuda tensor on ds-swift's gloo group 'host'" in gloo
    assert route_problem("send", "cuda", None) is None


def test_strict_mode_follows_the_environment_unless_set_from_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(transport.STRICT_ENV, "1")
    assert transport.strict_enabled()
    monkeypatch.setenv(transport.STRICT_ENV, "0")
    assert not transport.strict_enabled()
    transport.set_strict(True)
    try:
        assert transport.strict_enabled()
    finally:
        transport.set_strict(None)
    assert not transport.strict_enabled()


def test_strict_mode_refuses_the_world_group_and_records_the_route(one_rank: Transport) -> None:
    with pytest.raises(transport.StrictTransportError, match="did not create as gloo"):
        one_rank.send(torch.zeros(2), 0, group=dist.group.WORLD)
    with pytest.raises(transport.StrictTransportError, match="meta tensor on ds-swift's gloo group"):
        one_rank.isend(torch.zeros(2, device="meta"), 0, group=one_rank.group(transport.COPIER))
    assert [(c.op, c.channel, c.device) for c in one_rank.calls] == [
        ("send", "foreign", "cpu"),
        ("isend", "copier", "meta"),
    ]


def test_without_strict_mode_the_route_is_only_counted(one_rank: Transport) -> None:
    transport.set_strict(False)
    out = [torch.zeros(2)]
    one_rank.all_gather(out, torch.tensor([1.0, 2.0]), group=dist.group.WORLD)  # gloo here: it works
    assert out[0].tolist() == [1.0, 2.0]
    assert one_rank.counts[("all_gather", "foreign", "cpu")] == 1 and not one_rank.calls


def test_agreements_are_json_not_pickle(one_rank: Transport) -> None:
    value = {"rank": 0, "sends": [[1, 4096]], "seconds": 0.25, "ok": True}
    assert one_rank.all_gather_json(value) == [value]
    assert one_rank.all_gather_json(True) == [True]
    assert one_rank.all_gather_ints([7, -3]) == [[7, -3]]
    with pytest.raises(TypeError):
        one_rank.all_gather_json(object())  # not JSON: refused before anything is sent


def test_a_malformed_value_names_its_rank(one_rank: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
    real = one_rank.all_gather

    def garbled(
        out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, channel: str = transport.HOST
    ) -> None:
        real(out, tensor, group, channel)
        if tensor.dtype == torch.uint8:
            out[0][0] = ord("{")  # a peer's bytes are not JSON
            out[0][-1] = ord("{")

    monkeypatch.setattr(one_rank, "all_gather", garbled)
    with pytest.raises(transport.TransportError, match="rank 0 sent a malformed value"):
        one_rank.all_gather_json([1, 2, 3])


RAN: list[str] = []


def _run(what: str) -> None:
    RAN.append(what)


class _Planted:
    """Unpickling this calls ``_run("code")``: what a peer could make ``all_gather_object`` do."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_run, ("code",))


def test_a_peers_pickle_is_refused_never_run(one_rank: Transport, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = pickle.dumps(_Planted())
    pickle.loads(payload)
    assert RAN == ["code"]  # the payload does run code when unpickled...
    RAN.clear()
    monkeypatch.setattr(one_rank, "all_gather_ints", lambda values, channel=transport.HOST: [[len(payload)]])

    def peer_sends_pickle(out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, channel: str = "") -> None:
        out[0].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    monkeypatch.setattr(one_rank, "all_gather", peer_sends_pickle)
    with pytest.raises(transport.TransportError, match="rank 0 sent a malformed value"):
        one_rank.all_gather_json({"written": True})
    assert RAN == []  # ...but an agreement decodes JSON only


def test_a_torn_down_generation_has_no_transport(one_rank: Transport) -> None:
    transport.teardown_world()
    assert not dist.is_initialized()
    with pytest.raises(transport.TransportError, match="closed"):
        one_rank.send(torch.zeros(1), 0)
    with pytest.raises(transport.TransportError, match="not initialised"):
        transport.current()


# ----------------------------------------------------------------------------- ending a generation
def test_backend_names_are_read_from_torchs_strings() -> None:
    assert parse_backends("gloo") == GLOO
    assert parse_backends("nccl") == NCCL
    assert parse_backends("cpu:gloo,cuda:nccl") == frozenset({"gloo", "nccl"})


def test_gloo_destroys_everything_as_before_and_nccl_aborts() -> None:
    assert plan_teardown([("world", GLOO), ("dp", GLOO)], GLOO) == TeardownPlan(destroy_world=True)
    groups = [("world", NCCL), ("dp", NCCL), ("ds_swift_host", GLOO), ("megatron_gloo", GLOO)]
    assert plan_teardown(groups, NCCL) == TeardownPlan(destroy=("ds_swift_host", "megatron_gloo"), abort_world=True)
    mixed = frozenset({"gloo", "nccl"})
    assert plan_teardown([("world", mixed)], mixed) == TeardownPlan(destroy=(), abort_world=True)
    assert (wake_action(GLOO), wake_action(NCCL), wake_action(mixed)) == ("poison", "abort", "abort")


def test_the_nccl_settings_keep_survivors_alive() -> None:
    env: dict[str, str] = {}
    nccl_environment(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    nccl_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    for unsafe in ("1", "3"):
        problem = check_nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": unsafe})
        assert problem is not None and f"TORCH_NCCL_ASYNC_ERROR_HANDLING={unsafe}" in problem and "2 or 0" in problem
        with pytest.raises(ValueError, match="no survivor"):
            nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": unsafe})


class FakeBackend:
    def __init__(self, name: str, log: list[str]) -> None:
        self._name, self.log = name, log

    def name(self) -> str:
        return self._name

    def abort(self) -> None:
        self.log.append(f"abort {self._name}")

    def _group_start(self) -> None:
        self.log.append("group start")

    def _group_end(self) -> None:
        self.log.append("group end")


class FakeGroup:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def _get_backend(self, device: torch.device) -> FakeBackend:
        return self.backend


def test_the_watchdogs_abort_touches_nccl_communicators_only(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    groups = [
        FakeGroup(FakeBackend("nccl", log)),
        FakeGroup(FakeBackend("gloo", log)),
        FakeGroup(FakeBackend("nccl", log)),
    ]
    monkeypatch.setattr(teardown.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(teardown, "_live_groups", lambda: groups)
    assert teardown.abort_device_communicators() == 2
    assert log == ["group start", "abort nccl", "abort nccl", "group end"]


def test_ending_an_nccl_world_destroys_gloo_groups_first_then_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(teardown.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(teardown.dist, "destroy_process_group", lambda g=None: calls.append(f"destroy {g}"))
    monkeypatch.setattr(
        teardown.dist.distributed_c10d, "_abort_process_group", lambda g=None: calls.append("abort world")
    )
    teardown.execute(TeardownPlan(destroy=("ds_swift_host", "ds_swift_copier"), abort_world=True))
    assert calls == ["destroy ds_swift_host", "destroy ds_swift_copier", "abort world"]
    calls.clear()
    teardown.execute(TeardownPlan(destroy_world=True))
    assert calls == ["destroy None"]


def _registered(monkeypatch: pytest.MonkeyPatch, backends: frozenset[str], generation: int) -> list[str]:
    fake = Transport(world=object(), groups={"host": object()}, world_backends=backends)
    fake.generation = generation
    monkeypatch.setattr(transport._REGISTRY, "transport", fake)
    calls: list[str] = []
    monkeypatch.setattr(transport, "abort_device_communicators", lambda: calls.append("abort") or 3)
    monkeypatch.setattr(transport, "poison", lambda peers: calls.append(f"poison {sorted(peers)}") or [])
    return calls


def test_the_watchdog_hook_aborts_only_its_own_nccl_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _registered(monkeypatch, NCCL, generation=4)
    assert transport.on_generation_failed(3) == 0 and calls == []  # a late hook: the next world is not aborted
    assert transport.on_generation_failed(4) == 3 and calls == ["abort"]
    calls = _registered(monkeypatch, GLOO, generation=4)
    assert transport.on_generation_failed(4) == 0 and calls == []  # gloo: the training thread's teardown wakes


@pytest.mark.parametrize(("world", "expected"), [(GLOO, ["poison [1, 3]"]), (NCCL, ["abort"])])
def test_neighbours_are_poisoned_on_gloo_and_aborted_on_nccl(
    monkeypatch: pytest.MonkeyPatch, world: frozenset[str], expected: list[str]
) -> None:
    calls = _registered(monkeypatch, world, generation=0)
    monkeypatch.setattr(transport.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(transport, "backends_of", lambda group=None: world)
    assert transport.wake_neighbours([3, 1]) == wake_action(world)
    assert calls == expected


class FailingStore:
    def heartbeat(self, rank: int, note: str) -> None:
        pass

    def failure(self, generation: int) -> str | None:
        return "rank 2: process exited"


def test_the_watchdog_calls_its_failure_hook_once_and_survives_its_error(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[FailureSeen] = []

    def hook(s: FailureSeen) -> None:
        seen.append(s)
        raise RuntimeError("abort failed")

    wd = Watchdog(FailingStore, rank=1, generation=5, poll_interval_s=0.01, heartbeat_timeout_s=60.0, on_failure=hook)
    store: Any = FailingStore()
    first = wd.poll_once(store)
    assert first is not None and wd.failed.is_set() and wd.poll_once(store) == first
    assert [(s.generation, s.reason) for s in seen] == [(5, "rank 2: process exited")]
    assert "after the failure of generation 5: RuntimeError: abort failed" in capsys.readouterr().err
    (said,) = [r for r in caplog.records if r.name == "ds_swift.detect.watchdog"]
    assert said.levelno == logging.WARNING
    assert said.getMessage().endswith(
        "this rank's communicators were not aborted: a training thread blocked on a dead peer may wait up to "
        "watchdog.op_timeout_s"
    )
