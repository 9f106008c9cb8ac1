"""SwiftPipelineEngine plumbing without processes: initialize, passthrough, error triage,
the watchdog, and the DeepSpeed rebuild patches."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p

from ds_swift.data.keyed import global_micro_batch, rng_seed
from ds_swift.detect.classify import PeerFailure, is_comm_error
from ds_swift.detect.monitor import FailureMonitor
from ds_swift.detect.watchdog import Watchdog, declare_failure, suspect_key
from ds_swift.jobstore.membership import JobStore
from ds_swift.patches._base import PatchError
from ds_swift.patches.deepspeed_rebuild import patch_default_timeout, patch_recv_check, reset_pipeline_globals
from ds_swift.runtime.engine import SwiftPipelineEngine, initialize
from ds_swift.runtime.hooks import key_forward_rng
from ds_swift.testing.procs import free_port
from ds_swift.transport.shutdown import POISON_MARK, carries_poison


class Engine:
    global_steps = 3

    def train_batch(self) -> str:
        return "loss"


def test_disabled_returns_the_engine_untouched() -> None:
    e = Engine()
    assert initialize(e, {"swift": {"enabled": False}}) is e
    assert initialize(e, {}) is e


def test_enabled_needs_model_fn_and_batch_fn() -> None:
    cfg = {"swift": {"enabled": True}}
    with pytest.raises(ValueError, match="model_fn"):
        initialize(Engine(), cfg, batch_fn=lambda i, m: None)
    with pytest.raises(ValueError, match="batch_fn"):
        initialize(Engine(), cfg, model_fn=lambda: None)
    with pytest.raises(ValueError, match="config"):
        initialize(Engine(), None)


def test_attributes_pass_through_to_the_engine() -> None:
    inner = Engine()
    w = object.__new__(SwiftPipelineEngine)
    object.__setattr__(w, "_engine", inner)
    assert w.global_steps == 3
    w.global_steps = 9  # a user setting an engine attribute sets it on the engine
    assert inner.global_steps == 9
    assert w.engine is inner
    with pytest.raises(AttributeError):
        _ = w.no_such_attribute


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"), True),
        (RuntimeError("Read error: Connection reset by peer"), True),
        (dist.DistBackendError("Timed out waiting 15000ms for recv operation to complete"), True),
        (PeerFailure("generation 0 failed"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Connection closed"), False),
    ],
)
def test_comm_errors_are_told_from_bugs(exc: BaseException, expected: bool) -> None:
    assert is_comm_error(exc) is expected


@pytest.fixture
def store() -> JobStore:
    return JobStore.host("unit-watchdog")


def test_watchdog_sees_the_failure_flag(store: JobStore) -> None:
    client = JobStore.connect("127.0.0.1", store.port, "unit-watchdog")
    wd = Watchdog(lambda: client, rank=1, generation=0, poll_interval_s=0.01, heartbeat_timeout_s=5.0)
    assert wd.poll_once(client) is None and not wd.failed.is_set()
    assert client.last_heartbeat(1) is not None
    store.declare_failure(0, "machine 1: rank 3 killed")
    seen = wd.poll_once(client)
    assert seen is not None and seen.reason == "machine 1: rank 3 killed" and wd.failed.is_set()
    wd.set_generation(1)
    assert not wd.failed.is_set() and wd.poll_once(client) is None


def test_watchdog_declares_a_stale_peer_two_observers_agree_on(store: JobStore) -> None:
    client = JobStore.connect("127.0.0.1", store.port, "unit-watchdog")
    client.heartbeat(2)  # rank 2 beat once, then stopped
    store.add(f"{suspect_key(0, 2)}/n", 1)  # another observer suspects its machine already
    wd = Watchdog(lambda: client, rank=1, generation=0, poll_interval_s=0.01, heartbeat_timeout_s=0.05, watch_ranks=[2])
    assert wd.poll_once(client) is None  # the first read of rank 2's counter
    for _ in range(500):  # then it stands still past the timeout on this watchdog's clock
        time.sleep(0.01)
        seen = wd.poll_once(client)
        if seen is not None:
            break
    assert seen is not None and "rank 2: no heartbeat" in seen.reason
    assert store.failure(0) is not None and store.generation() == 1


def test_watchdog_thread_starts_and_stops(store: JobStore) -> None:
    wd = Watchdog(
        lambda: JobStore.connect("127.0.0.1", store.port, "unit-watchdog"),
        rank=0,
        generation=0,
        poll_interval_s=0.01,
        heartbeat_timeout_s=5.0,
    ).start()
    try:
        store.declare_failure(0, "x")
        assert wd.failed.wait(timeout=5.0)
    finally:
        wd.stop()


def test_default_timeout_patch_is_reversible() -> None:
    c10d = dist.distributed_c10d
    before = c10d.default_pg_timeout
    with patch_default_timeout(7.0):
        assert c10d.default_pg_timeout == datetime.timedelta(seconds=7)
        with pytest.raises(PatchError):
            patch_default_timeout(8.0)
    assert c10d.default_pg_timeout == before


def test_recv_check_runs_after_every_recv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(p2p, "recv", lambda tensor, src_stage, async_op=False: calls.append("recv"))
    original = p2p.recv

    buffer, seen = torch.zeros(3), []

    def check(received: torch.Tensor | None) -> None:
        calls.append("check")
        seen.append(received)
        raise PeerFailure("poisoned")

    handle = patch_recv_check(check)
    try:
        with pytest.raises(PatchError):
            patch_recv_check(check)
        with pytest.raises(PeerFailure):
            p2p.recv(buffer, 0)
        with pytest.raises(PeerFailure):
            p2p.recv(buffer, 0, async_op=True)  # not filled yet: the check gets no buffer to read
        assert calls == ["recv", "check", "recv", "check"]
        assert seen[0] is buffer and seen[1] is None
    finally:
        handle.remove()
    assert p2p.recv is original


def test_reset_pipeline_globals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "_grid", object())
    monkeypatch.setattr(p2p, "_async", [object()])
    reset_pipeline_globals()
    assert p2p._grid is None and p2p._groups is None and p2p._async == []


def test_declare_repairs_a_half_written_failure(store: JobStore) -> None:
    """The first declarer (a rank of the failing machine) was killed after counting itself in but
    before writing the flag and moving the generation: the next declarer completes the record."""
    store.kv.add("gen0/failed_n", 1)
    assert store.failure(0) is None and store.generation() == 0
    assert declare_failure(store, 0, "rank 1: connection closed") is False
    assert store.failure(0) == "rank 1: connection closed"
    assert store.generation() == 1
    assert declare_failure(store, 0, "late") is False  # idempotent: no second bump, reason kept
    assert store.failure(0) == "rank 1: connection closed" and store.generation() == 1


def test_release_process_groups_cuts_only_group_references() -> None:
    """On a real (single-rank) gloo group: groups in attributes, lists and nested dicts are cut;
    parameters, plain values and objects outside deepspeed.runtime are left alone."""
    from ds_swift.patches.deepspeed_rebuild import release_process_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        module = torch.nn.Linear(2, 2)
        module.world_group = group  # type: ignore[assignment]
        module.tied_comms = {"emb": {"group": group, "ranks": [0]}}  # type: ignore[assignment]

        class Holder:
            pass

        holder = Holder()
        holder.groups = [group, group]  # type: ignore[attr-defined]
        holder.name = "kept"  # type: ignore[attr-defined]
        # DeepSpeed's mixed-precision linkage stores the data-parallel group on each parameter.
        module.weight._dp_group = group  # type: ignore[attr-defined]
        assert release_process_groups(module, holder) == 4
        assert module.world_group is None and module.tied_comms == {"emb": {"group": None, "ranks": [0]}}
        assert holder.groups is None and holder.name == "kept"  # type: ignore[attr-defined]
        assert isinstance(module.weight, torch.nn.Parameter) and module.weight._dp_group is None  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def test_megatrons_leftover_groups_are_released() -> None:
    """megatron-core's destroy_model_parallel leaves some groups in its globals; all go."""
    from megatron.core import parallel_state as ps

    from ds_swift.patches.deepspeed_rebuild import release_megatron_groups

    def groups_left() -> list[str]:
        return [name for name, v in vars(ps).items() if isinstance(v, dist.ProcessGroup)]

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel(create_gloo_process_groups=False)
        assert groups_left()
        assert release_megatron_groups() > 0
        assert groups_left() == [] and not ps.model_parallel_is_initialized()
    finally:
        dist.destroy_process_group()


def test_the_rebuild_replaces_the_engine_in_force() -> None:
    w = object.__new__(SwiftPipelineEngine)
    object.__setattr__(w, "_engine", Engine())
    new = Engine()
    w.engine = new  # what the rebuild does: the wrapper's slot, not an attribute of the old engine
    assert w.engine is new and w.global_steps == 3


def poisoned(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """A receive buffer of ``dtype`` after gloo delivered a poison message into it (fewer bytes)."""
    buffer = torch.ones(n, dtype=dtype)
    buffer.view(-1).view(torch.uint8)[:4] = torch.tensor([POISON_MARK], dtype=torch.int32).view(torch.uint8)
    return buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32])
def test_the_poison_mark_is_seen_in_every_dtype_a_pipeline_receives(dtype: torch.dtype) -> None:
    assert carries_poison(poisoned(dtype))
    assert not carries_poison(torch.ones(6, dtype=dtype))
    # What arithmetic can make of a diverged activation is the canonical NaN, never the mark.
    if dtype.is_floating_point:
        assert not carries_poison(torch.full((6,), float("nan"), dtype=dtype))
        assert not carries_poison(torch.full((6,), float("inf"), dtype=dtype))
    assert not carries_poison(torch.ones(1, dtype=torch.bfloat16))  # smaller than the mark
    # A receive buffer that is a view into a larger one: the mark is read at the view's start.
    outer = torch.ones(12, dtype=dtype)
    outer[4:] = poisoned(dtype, 8)
    assert carries_poison(outer[4:]) and not carries_poison(outer)


def test_a_receive_reads_the_store_only_when_it_carries_the_poison_mark(store: JobStore) -> None:
    monitor = FailureMonitor(store, generation=0, poll_interval_s=0.01)
    reads: list[int] = []
    original = store.failure
    store.failure = lambda g: reads.append(g) or original(g)  # type: ignore[method-assign]
    for _ in range(5):
        monitor.check_after_receive(torch.ones(8))
    assert reads == []
    with pytest.raises(PeerFailure, match="poison message from a pipeline neighbour"):
        monitor.check_after_receive(poisoned(torch.float32))  # the mark, and no flag within the wait
    assert reads == [0]
    monitor.check_after_receive()  # before a step: the store is read
    assert reads == [0, 0]


def test_with_a_watchdog_running_the_check_before_an_iteration_reads_no_store(store: JobStore) -> None:
    """The watchdog thread reads the flag; the training thread only looks at its event (a store
    read per iteration was a round trip to the store host on the critical path)."""
    monitor = FailureMonitor(store, generation=0, poll_interval_s=0.01)
    watchdog = Watchdog(lambda: store, rank=0, generation=0, poll_interval_s=0.01, heartbeat_timeout_s=5.0)
    monitor._watchdog = watchdog  # not started: its polls are driven here
    reads: list[int] = []
    original = store.failure
    store.failure = lambda g: reads.append(g) or original(g)  # type: ignore[method-assign]
    assert monitor.failure_seen() is None and reads == []
    store.declare_failure(0, "machine 1: rank 3 killed")
    reads.clear()  # the declarer's own look at the flag
    assert monitor.failure_seen() is None  # the watchdog has not polled yet: met inside the iteration
    assert reads == []
    watchdog.poll_once(store)
    assert monitor.failure_seen() == "failure flag (watchdog)"
    assert reads == [0]  # the watchdog's one read


def test_failure_monitor_checks_the_generation_in_force(store: JobStore) -> None:
    monitor = FailureMonitor(store, generation=0, poll_interval_s=0.01)
    assert monitor.failure_seen() is None
    monitor.check_after_receive()
    with pytest.raises(ValueError, match="a bug"):
        monitor.classify(ValueError("a bug"))  # not a failure: raised as DeepSpeed alone would
    store.declare_failure(0, "machine 1: rank 3 killed")
    assert monitor.failure_seen() == "failure flag"
    with pytest.raises(PeerFailure, match="rank 3 killed"):
        monitor.check_after_receive()
    assert monitor.classify(ValueError("late")) == "ValueError after the failure flag"
    with pytest.raises(PeerFailure, match="rank 3 killed"):
        monitor.check_after_receive(poisoned(torch.bfloat16))
    monitor.check_after_receive(torch.ones(4))  # a real message: no store read (the watchdog tells)
    monitor.set_armed(False)
    monitor.check_after_receive()  # disarmed during a recovery
    monitor.set_generation(1)
    monitor.set_armed(True)
    assert monitor.failure_seen() is None and monitor.generation == 1


def test_a_comm_error_without_evidence_of_a_dead_rank_is_raised(store: JobStore) -> None:
    """No failure flag and no stale heartbeat: the error is the job's own (see test_failure_classify)."""
    monitor = FailureMonitor(store, generation=0, poll_interval_s=0.01)
    error = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        monitor.classify(error)
    assert store.failure(0) is None and store.generation() == 0
    with pytest.raises(RuntimeError, match="no recovery"):
        FailureMonitor(None, 0, 0.01).classify(RuntimeError("no recovery"))


def test_training_and_replay_key_the_rng_alike() -> None:
    class Grid:
        def get_data_parallel_id(self) -> int:
            return 1

    class Eng:
        global_steps, stage_id, grid = 7, 2, Grid()

        def gradient_accumulation_steps(self) -> int:
            return 4

    key_forward_rng(Eng(), 1234, 3)
    a = torch.rand(3)
    torch.manual_seed(rng_seed(1234, 7, global_micro_batch(1, 4, 3), 2))
    assert torch.equal(a, torch.rand(3))
