"""GPU health verdicts, with a fake NVML (no GPU on CI)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_swift.launch.gpu_health import GpuMonitor, check_gpus

NO_CVD: dict[str, str] = {}  # CUDA_VISIBLE_DEVICES unset, whatever the machine running the tests has


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-1111-2222-3333-444444444444"


class FakeNvml:
    """NVML over a few GPUs: handles are NVML indices, a MIG instance's handle is ("mig", parent).
    ``ecc`` can be changed between polls; ``xids`` holds (xid, NVML index of the device) events."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, ecc: list[int], lost: set[int] = frozenset(), xids: list[tuple[int, int]] | None = None) -> None:  # type: ignore[assignment]
        self.ecc, self.lost, self.xids = ecc, lost, list(xids or [])
        self.looked_up: list[int] = []
        self.registered: list[int] = []

    def nvmlDeviceGetCount(self) -> int:
        return len(self.ecc)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self.looked_up.append(i)
        if i in self.lost or i >= len(self.ecc):
            raise RuntimeError("GPU is lost")
        return i

    def nvmlDeviceGetHandleByUUID(self, u: str) -> object:
        for i in range(len(self.ecc)):
            if u == uuid(i):
                return self.nvmlDeviceGetHandleByIndex(i)
            if u == "MIG-" + uuid(i)[4:]:
                return ("mig", self.nvmlDeviceGetHandleByIndex(i))
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return uuid(h)

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceIsMigDeviceHandle(self, h: object) -> bool:
        return isinstance(h, tuple)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: tuple[str, int]) -> int:
        return h[1]

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert isinstance(h, int), "ECC is read on the physical GPU"
        return self.ecc[h]

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: int, kind: int, events: object) -> None:
        self.registered.append(h)

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int) -> SimpleNamespace:
        if not self.xids:
            raise TimeoutError("NVML_ERROR_TIMEOUT")
        xid, device = self.xids.pop(0)
        return SimpleNamespace(eventData=xid, device=device)


def test_no_nvml_is_healthy_and_says_it_did_not_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # As on a machine without an NVIDIA driver, also where the tests run on one that has it.
    monkeypatch.setattr("ds_swift.launch.gpu_health._load_nvml", lambda: None)
    monkeypatch.setattr("ds_swift.launch.gpu_health.GPU_DEVICE_FILE", tmp_path / "nvidia0")
    with caplog.at_level(logging.WARNING):
        h = GpuMonitor(nvml=None, environ=NO_CVD).poll()
        assert h.healthy and not h.checked
        assert not caplog.records  # a CPU machine: nothing to watch, nothing to say
        GpuMonitor(nvml=None, environ={"CUDA_VISIBLE_DEVICES": "0,1"})  # GPUs, but no NVML to watch them
        (tmp_path / "nvidia0").touch()
        GpuMonitor(nvml=None, environ=NO_CVD)  # the driver's device file, no NVML
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and all(m.startswith("GPU health checks are off on this machine: ") for m in said)
    assert "is not failed by its agent (training goes on)" in said[0]


def test_uncorrectable_ecc_marks_machine_failed() -> None:
    h = check_gpus(nvml=FakeNvml([0, 3]), environ=NO_CVD)
    assert h.checked and not h.healthy
    assert "GPU 1 (NVML 1): 3 uncorrectable ECC" in h.problems[0]


def test_lost_gpu_marks_machine_failed() -> None:
    h = check_gpus(nvml=FakeNvml([0, 0], lost={0}), environ=NO_CVD)
    assert not h.healthy and "GPU 0 (NVML 0): not reachable" in h.problems[0]


def test_critical_xid_fails_and_benign_xid_does_not() -> None:
    assert GpuMonitor(nvml=FakeNvml([0], xids=[(13, 0)]), environ=NO_CVD).poll().healthy  # 13: app bug
    h = GpuMonitor(nvml=FakeNvml([0], xids=[(13, 0), (79, 0)]), environ=NO_CVD).poll()
    assert not h.healthy and h.problems == ["GPU 0 (NVML 0): critical Xid 79"]


def test_ecc_errors_from_before_the_job_warn_once_and_do_not_fail(caplog: pytest.LogCaptureFixture) -> None:
    """A GPU with an uncorrectable error since boot would otherwise fail this machine, and every
    replacement on it, forever."""
    nv = FakeNvml([0, 2])
    with caplog.at_level(logging.WARNING):
        m = GpuMonitor(nvml=nv, environ=NO_CVD)
        assert m.baseline == {0: 0, 1: 2}
        assert m.poll().healthy and m.poll().healthy
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "GPU 1 (NVML 1) already has 2 uncorrectable ECC" in warnings[0]
    # The function alone, given the same baseline, agrees.
    assert check_gpus(nvml=nv, baseline={0: 0, 1: 2}, environ=NO_CVD).healthy


def test_ecc_errors_during_the_job_fail_the_gpu() -> None:
    nv = FakeNvml([0, 2])
    m = GpuMonitor(nvml=nv, environ=NO_CVD)
    nv.ecc[1] = 3
    h = m.poll()
    assert not h.healthy and len(h.problems) == 1
    assert h.problems[0].startswith("GPU 1 (NVML 1): 1 new uncorrectable ECC error(s) during this job")


def test_visible_devices_map_local_slots_to_nvml_indices() -> None:
    nv = FakeNvml([0, 0, 0, 5])
    h = check_gpus([0, 1], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "3,1"})
    assert not h.healthy and h.problems == ["GPU 0 (NVML 3): 5 uncorrectable ECC error(s) since the driver loaded"]
    nv.looked_up.clear()
    assert check_gpus([0, 1], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "1,2"}).healthy  # NVML 3 is not ours
    assert nv.looked_up == [1, 2]
    # With no indices, every visible GPU; a slot past them has no GPU to check.
    nv.looked_up.clear()
    assert check_gpus([0, 1, 2], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "2"}).healthy and nv.looked_up == [2]


def test_visible_devices_by_uuid() -> None:
    nv = FakeNvml([0, 0, 0, 5])
    for entry in (uuid(3), uuid(3)[:12]):  # CUDA also takes a unique prefix
        h = check_gpus([0], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": entry})
        assert h.problems == ["GPU 0 (NVML 3): 5 uncorrectable ECC error(s) since the driver loaded"], entry
    # A MIG instance: ECC is the physical GPU's.
    h = check_gpus([0], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "MIG-" + uuid(3)[4:]})
    assert h.problems == ["GPU 0 (NVML 3): 5 uncorrectable ECC error(s) since the driver loaded"]
    # A UUID NVML does not know: named as the job named it.
    h = check_gpus([0], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": uuid(9)})
    assert not h.healthy and h.problems[0].startswith(f"GPU 0 ({uuid(9)}): not reachable")


@pytest.mark.parametrize("spec", ["", "-1", "NoDevFiles"])
def test_no_visible_devices_checks_nothing(spec: str) -> None:
    nv = FakeNvml([4, 4], xids=[(79, 0)])
    m = GpuMonitor([0, 1], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": spec})
    assert m.poll().healthy and nv.looked_up == [] and nv.registered == []


def test_visible_devices_stop_at_the_first_invalid_entry() -> None:
    nv = FakeNvml([0, 0, 7])
    assert check_gpus(nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "0,-1,2"}).healthy and nv.looked_up == [0]


def test_xid_counts_only_on_this_agents_gpus() -> None:
    """Two agents share a host: an Xid on the other agent's GPU is its agent's to act on."""
    nv = FakeNvml([0, 0, 0, 0], xids=[(79, 0), (79, 3)])
    m = GpuMonitor([0, 1], nvml=nv, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert nv.registered == [2, 3]
    h = m.poll()
    assert not h.healthy and h.problems == ["GPU 1 (NVML 3): critical Xid 79"]
    assert m.poll().healthy  # events are consumed
    nv.xids = [(48, 1)]
    assert m.poll().healthy


def test_agent_treats_a_failing_gpu_as_a_failed_machine() -> None:
    """The node agent polls its GPU monitor; an unhealthy GPU kills the machine's ranks and
    declares the failure with the GPU's problem as the reason."""
    from ds_swift.jobstore.membership import JobStore
    from ds_swift.launch import health as health_mod
    from ds_swift.launch.agent import MachineAgent
    from ds_swift.launch.gpu_health import GpuHealth

    class SickGpu:
        def poll(self) -> GpuHealth:
            return GpuHealth(healthy=False, checked=True, problems=["GPU 1: 3 uncorrectable ECC error(s) since boot"])

    class FakeWorker:
        def __init__(self, rank: int) -> None:
            self.rank, self.pid, self.killed = rank, 1000 + rank, False

        def poll(self) -> int | None:
            return -9 if self.killed else None

        def signal_group(self, sig: int) -> None:
            self.killed = True

    class Job:
        num_machines, nproc_per_node, num_spares, max_failures, restart_delay_s, elastic = 2, 2, 0, 3, None, False
        inject: tuple[object, ...] = ()

    events: list[str] = []
    store = JobStore.host("tok-gpu")
    a = MachineAgent(1, Job(), store, lambda msg, **kw: events.append(msg), gpu_monitor=SickGpu())  # type: ignore[arg-type]
    a.workers = [FakeWorker(2), FakeWorker(3)]  # type: ignore[list-item]
    a.control.record_failure = lambda: 1  # type: ignore[method-assign]
    given_up: list[str] = []
    a.control.abort = given_up.append  # type: ignore[method-assign]  # every way of giving up ends here
    health_mod.GPU_POLL_S = 2.0
    a.tick()
    assert a.workers == [] and all(w.killed for w in a._dying)
    assert "failing GPU (GPU 1: 3 uncorrectable ECC" in (store.failure(0) or "")
    assert given_up and "failing GPU" in given_up[0]  # no spare, no restart: the job gives up, saying why
