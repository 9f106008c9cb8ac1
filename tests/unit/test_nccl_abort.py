"""Multi-rank NCCL made right by construction (issue 49), in one process: torch's NCCL settings and
the versions refused at start-up, the mark every abort is preceded by, and the step guard on real
DeepSpeed engines of each optimizer wrapper (a refused step changes nothing)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_kept_wrappers import CONFIGS, engine, world  # noqa: F401 - world is the fixture

import ds_swift.transport as transport
from ds_swift.detect.classify import CommunicatorFailure, PeerFailure, is_transport_error
from ds_swift.detect.monitor import FailureMonitor
from ds_swift.patches.deepspeed_optim_state import optimizer_scalars
from ds_swift.patches.step_guard import guard_step
from ds_swift.recovery.kept import KeptState
from ds_swift.transport.core import Transport
from ds_swift.transport.nccl import (
    NONBLOCKING_TIMEOUT,
    SETTINGS,
    NcclSettingError,
    environment_problems,
    nccl_environment,
    nccl_version_tuple,
    version_problems,
)
from ds_swift.undo import attach_to_engine


# ----------------------------------------------------------------------------- settings
def test_unset_settings_get_the_values_that_keep_survivors_alive_and_abortable() -> None:
    env: dict[str, str] = {}
    nccl_environment(env, nonblocking_timeout_s=300.0)
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
        NONBLOCKING_TIMEOUT: "300",
    }
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "false", NONBLOCKING_TIMEOUT: "60"}
    nccl_environment(mine, nonblocking_timeout_s=300.0)  # safe user values stay as they are
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and mine[NONBLOCKING_TIMEOUT] == "60"
    assert mine["TORCH_NCCL_ENABLE_MONITORING"] == "false"


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "end the process at the first NCCL error"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "end the process at the first NCCL error"),
        ("NCCL_ASYNC_ERROR_HANDLING", "1", "end the process at the first NCCL error"),  # torch's older name
        ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "1", "pytorch/pytorch#126544"),
        ("TORCH_NCCL_ENABLE_MONITORING", "1", "pytorch/pytorch#155916"),
        ("TORCH_NCCL_USE_COMM_NONBLOCKING", "0", "no abort reaches"),
    ],
)
def test_a_value_that_would_end_or_strand_survivors_is_refused_naming_the_variable_and_the_fix(
    name: str, value: str, said: str
) -> None:
    (problem,) = environment_problems({name: value, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "5"})
    assert problem.startswith(f"{name}={value} ") and said in problem and "unset it (ds-swift then sets" in problem
    env = {name: value}
    with pytest.raises(NcclSettingError, match=name):
        nccl_environment(env)
    assert env == {name: value}  # nothing set when refused


def test_every_setting_is_refused_for_some_value_and_accepts_its_own() -> None:
    for s in SETTINGS:
        assert environment_problems({s.name: s.value}) == [], s
        assert s.value in s.safe


# ----------------------------------------------------------------------------- versions
def test_nccl_and_torch_versions_are_checked_against_the_floor_and_the_refused_range() -> None:
    assert version_problems("2.13.0+cu130", (2, 27, 3)) == []
    assert version_problems("2.13.0", (2, 28, 9)) == [] and version_problems("2.9.1", (2, 29, 7)) == []
    assert version_problems("2.13.0", None) == []  # no NCCL loaded: nothing to say of it
    (bad,) = version_problems("2.13.0", (2, 28, 5))
    assert "2.28.3-2.28.8" in bad and "nvidia-resiliency-ext" in bad and "use NCCL >= 2.27.0" in bad
    (old,) = version_problems("2.13.0", (2, 26, 2))
    assert "NCCL 2.26.2" in old and "pytorch/pytorch#153960" in old and "use NCCL >= 2.27.0" in old
    (torch_old,) = version_problems("2.7.1+cu126", (2, 27, 3))
    assert "torch 2.7.1+cu126" in torch_old and "#119797" in torch_old and "torch >= 2.8" in torch_old
    assert nccl_version_tuple(22703) == (2, 27, 3) and nccl_version_tuple((2, 28, 9)) == (2, 28, 9)


# ----------------------------------------------------------------------------- the mark before the abort
class FakeComms:
    """Device communicators that record what ds-swift's step check would have seen at the abort."""

    def __init__(self, errors: list[str] | None = None) -> None:
        self.seen_at_abort: list[Any] = []
        self._errors = errors or []

    def present(self) -> bool:
        return True

    def abort(self) -> int:
        self.seen_at_abort.append(transport.step_taint())
        return 2

    def errors(self) -> list[str]:
        return list(self._errors)

    def synchronize(self) -> None:
        pass


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Transport:
    fake = Transport(world=object(), groups={"host": object()}, world_backends=frozenset({"nccl"}))
    fake.generation = 4
    monkeypatch.setattr(transport._REGISTRY, "transport", fake)
    return fake


def test_a_generation_is_marked_aborted_before_its_communicators_are_aborted(registered: Transport) -> None:
    comms = FakeComms()
    previous = transport.use_device_communicators(comms)
    try:
        assert transport.step_taint() is None
        assert transport.on_generation_failed(3) == 0 and comms.seen_at_abort == []  # not its generation
        assert transport.on_generation_failed(4, "rank 2: process exited") == 2
        (taint,) = comms.seen_at_abort
        assert taint is not None and taint.declared and "rank 2: process exited" in taint.why  # marked first
        assert transport.step_taint() == taint  # and for good: the generation is never trusted again
    finally:
        transport.use_device_communicators(previous)


def test_torchs_own_recorded_error_taints_the_step_as_undeclared(registered: Transport) -> None:
    previous = transport.use_device_communicators(FakeComms(["NCCL group of 2 ranks (this rank 0): TIMEOUT"]))
    try:
        taint = transport.step_taint()
        assert taint is not None and not taint.declared and "TIMEOUT" in taint.why
        monitor = FailureMonitor(None, 4, 0.1)
        with pytest.raises(CommunicatorFailure, match="iteration 9 is not applied") as raised:
            monitor.check_step(9)
        assert is_transport_error(raised.value)  # classified on evidence: a dead rank or a stall
        registered.aborted = "the generation failed"
        with pytest.raises(PeerFailure, match="ds-swift aborted"):
            monitor.check_step(9)
    finally:
        transport.use_device_communicators(previous)


# ----------------------------------------------------------------------------- the step guard
def _state(eng: Any) -> dict[str, Any]:
    inner = eng.optimizer if isinstance(eng.optimizer, torch.optim.Optimizer) else eng.optimizer.optimizer
    return {
        "module": {k: v.clone() for k, v in eng.module.state_dict().items()},
        "inner": copy.deepcopy(inner.state_dict()),
        "masters": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
        "scalars": optimizer_scalars(eng.optimizer),
        "global_steps": int(eng.global_steps),
        "skipped": int(eng.skipped_steps),
    }


def _backward(eng: Any, i: int) -> None:
    dtype = next(eng.module.parameters()).dtype
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(100 + i)).to(dtype)
    eng.backward(eng(x).float().pow(2).mean())


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_refused_step_changes_nothing_and_counts_as_not_stepped(world: None, kind: str) -> None:  # noqa: F811
    """Each wrapper of the configuration users run (bf16 + ZeRO-1's BF16_Optimizer, fp16 + ZeRO-1
    with its loss scaler updated before the inner step, fp16 unfused, fp32): the check runs once per
    step, after undo's wrappers; a raise leaves parameters, masters, optimizer state, loss scaler
    and counters as they were, and the kept state counts the iteration as not stepped."""
    eng = engine(kind)
    undo = attach_to_engine(eng)
    calls: list[int] = []
    refuse = [True]

    def check() -> None:
        calls.append(int(eng.global_steps))
        if refuse[0]:
            raise PeerFailure("generation 0 aborted")

    handle = guard_step(eng, check)  # after undo, as the runtime installs it
    before = _state(eng)
    _backward(eng, 0)
    with pytest.raises(PeerFailure):
        eng.step()
    after = _state(eng)
    for name, value in before["module"].items():
        assert torch.equal(value, after["module"][name]), name
    for a, b in zip(before["masters"], after["masters"], strict=True):
        assert torch.equal(a, b)
    assert after["inner"]["state"].keys() == before["inner"]["state"].keys()
    assert (after["scalars"], after["global_steps"], after["skipped"]) == (
        before["scalars"],
        before["global_steps"],
        before["skipped"],
    )
    assert calls == [2]
    handle.remove()  # the runtime's hooks come off before a survivor keeps its state
    kept = KeptState.capture(eng, undo)  # what a survivor would report to the consensus
    assert kept.last_stepped == 1 and kept.undo is None
    # The same engine steps normally once the check passes (and still once per step).
    undo = attach_to_engine(eng)
    handle = guard_step(eng, check)
    refuse[0] = False
    _backward(eng, 1)
    eng.step()
    assert calls == [2, 2] and int(eng.global_steps) == 3
    handle.remove()
    undo.remove()


# ----------------------------------------------------------------------------- creation: the deadline
def test_a_rebuild_not_done_by_its_deadline_fails_the_generation_and_aborts() -> None:
    from ds_swift.detect.watchdog import FailureSeen, Watchdog
    from ds_swift.jobstore.membership import JobStore

    store = JobStore.host("unit-deadline")
    client = JobStore.connect("127.0.0.1", store.port, "unit-deadline")
    aborted: list[FailureSeen] = []
    wd = Watchdog(lambda: client, 1, 3, 0.01, 60.0, on_failure=aborted.append)
    wd.set_deadline(3600.0, "rebuilding generation 3")
    assert wd.poll_once(client) is None  # not yet
    wd.set_deadline(None)
    assert wd.poll_once(client) is None  # done: disarmed
    wd.set_deadline(0.0, "rebuilding generation 3")
    seen = wd.poll_once(client)
    assert seen is not None and wd.failed.is_set()
    assert seen.reason == "rank 1: rebuilding generation 3 not done within 0 s (the rebuild deadline)"
    assert store.failure(3) == seen.reason and [s.generation for s in aborted] == [3]


# ----------------------------------------------------------------------------- under ds-swift-launch
def test_the_launcher_sets_the_settings_and_refuses_a_value_that_would_end_survivors() -> None:
    from ds_swift.launch.preflight import nccl_problems
    from ds_swift.launch.spawn import nccl_defaults

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    nccl_defaults(env)
    assert env == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # the user's safe value stays
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
    }
    assert nccl_problems(env) == []
    (problem,) = nccl_problems({"TORCH_NCCL_ENABLE_MONITORING": "1"})
    assert problem.startswith("TORCH_NCCL_ENABLE_MONITORING=1 ") and "unset it" in problem
