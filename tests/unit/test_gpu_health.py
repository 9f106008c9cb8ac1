"""GPU health verdicts, with a fake NVML (no GPU on CI)."""

from __future__ import annotations

from types import SimpleNamespace

from ds_swift.launch.gpu_health import GpuMonitor, check_gpus


class FakeNvml:
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, ecc: list[int], lost: set[int] = frozenset(), xids: list[int] | None = None) -> None:  # type: ignore[assignment]
        self.ecc, self.lost, self.xids = ecc, lost, list(xids or [])

    def nvmlDeviceGetCount(self) -> int:
        return len(self.ecc)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise RuntimeError("GPU is lost")
        return i

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return self.ecc[h]

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: int, kind: int, events: object) -> None:
        pass

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int) -> SimpleNamespace:
        if not self.xids:
            raise TimeoutError("NVML_ERROR_TIMEOUT")
        return SimpleNamespace(eventData=self.xids.pop(0))


def test_no_nvml_is_healthy_and_says_it_did_not_check() -> None:
    h = GpuMonitor(nvml=None).poll()
    assert h.healthy


def test_uncorrectable_ecc_marks_machine_failed() -> None:
    h = check_gpus(nvml=FakeNvml([0, 3]))
    assert h.checked and not h.healthy
    assert "GPU 1: 3 uncorrectable ECC" in h.problems[0]


def test_lost_gpu_marks_machine_failed() -> None:
    h = check_gpus(nvml=FakeNvml([0, 0], lost={0}))
    assert not h.healthy and "GPU 0" in h.problems[0]


def test_critical_xid_fails_and_benign_xid_does_not() -> None:
    assert GpuMonitor(nvml=FakeNvml([0], xids=[13])).poll().healthy  # 13: graphics engine exception (app bug)
    h = GpuMonitor(nvml=FakeNvml([0], xids=[13, 79])).poll()
    assert not h.healthy and "Xid 79" in h.problems[0]


def test_agent_treats_a_failing_gpu_as_a_failed_machine() -> None:
    """The node agent polls its GPU monitor; an unhealthy GPU kills the machine's ranks and
    declares the failure with the GPU's problem as the reason."""
    from ds_swift.launch import agent as agent_mod
    from ds_swift.launch.agent import MachineAgent
    from ds_swift.launch.gpu_health import GpuHealth
    from ds_swift.membership import JobStore

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
        num_machines, nproc_per_node, num_spares, max_failures, restart_delay_s = 2, 2, 0, 3, None
        inject: tuple[object, ...] = ()

    events: list[str] = []
    store = JobStore.host("tok-gpu")
    a = MachineAgent(1, Job(), store, lambda msg, **kw: events.append(msg), gpu_monitor=SickGpu())  # type: ignore[arg-type]
    a.workers = [FakeWorker(2), FakeWorker(3)]  # type: ignore[list-item]
    a.control.record_failure = lambda: 1  # type: ignore[method-assign]
    given_up: list[str] = []
    a.control.abort = given_up.append  # type: ignore[method-assign]  # every way of giving up ends here
    agent_mod.GPU_POLL_S = 2.0
    a.tick()
    assert a.workers == [] and all(w.killed for w in a._dying)
    assert "failing GPU (GPU 1: 3 uncorrectable ECC" in (store.failure(0) or "")
    assert given_up and "failing GPU" in given_up[0]  # no spare, no restart: the job gives up, saying why
