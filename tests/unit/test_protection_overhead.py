"""The failure-free path's own costs on CPU (issue 29): what the training thread and the watchdog do
per iteration, the benchmark's switches and CPU sampler, and the start-up cost lines."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_swift.config import SwiftConfig
from ds_swift.data.keyed import global_micro_batch, key_forward_rng, rng_seed, seed_generators
from ds_swift.detect.watchdog import Watchdog
from ds_swift.jobstore.membership import JobStore
from ds_swift.patches.determinism import ScopedDeterminism
from ds_swift.protect.costs import ENV, _runtime_lines, switched_off
from ds_swift.protect.message_logging import MessageLogging
from ds_swift.testing.cpu_sampler import CpuSample, per_iteration, sample_tree
from ds_swift.threadname import name_os_thread, os_thread_name

TOKEN = "unit-overhead"


class _Eng:
    global_steps, stage_id = 7, 1

    class grid:  # noqa: N801 - DeepSpeed's attribute name
        @staticmethod
        def get_data_parallel_id() -> int:
            return 1

    def gradient_accumulation_steps(self) -> int:
        return 4


def test_rng_keying_draws_what_torch_manual_seed_draws() -> None:
    key_forward_rng(_Eng(), 1234, 2)
    a = torch.rand(5)
    torch.manual_seed(rng_seed(1234, 7, global_micro_batch(1, 4, 2), 1))
    assert torch.equal(a, torch.rand(5))
    seed_generators(99)
    b = torch.randn(3)
    torch.manual_seed(99)
    assert torch.equal(b, torch.randn(3))


def test_rng_keying_formats_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.manual_seed queued the seed for CUDA, XPU and MTIA with a formatted stack each time:
    # ~1 ms of the training thread per forward pass from inside the pipeline engine.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA initialised: torch seeds it directly, no traceback either way")
    calls: list[int] = []
    real = traceback.format_stack

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(traceback, "format_stack", counting)
    for i in range(3):
        key_forward_rng(_Eng(), 1234, i)
    assert calls == []


def _watchdog(store: JobStore, **kw: Any) -> tuple[Watchdog, JobStore]:
    client = JobStore.connect("127.0.0.1", store.port, TOKEN)
    return Watchdog(lambda: client, rank=1, generation=0, poll_interval_s=0.01, **kw), client


def test_the_watchdog_beats_once_per_tenth_of_the_timeout_and_reads_the_flag_every_poll() -> None:
    store = JobStore.host(TOKEN)
    wd, client = _watchdog(store, heartbeat_timeout_s=600.0)  # a beat every 60 s: only the first poll's
    assert wd.beat_every_s == 60.0
    assert wd.poll_once(client) is None
    first = client.heartbeat_of(1)
    assert first is not None
    for _ in range(5):
        assert wd.poll_once(client) is None
    assert client.heartbeat_of(1) == first  # not written again
    store.declare_failure(0, "machine 0: rank 0 killed")
    seen = wd.poll_once(client)  # the flag is read at every poll all the same
    assert seen is not None and seen.reason == "machine 0: rank 0 killed"


def test_the_watchdog_beats_at_least_every_poll() -> None:
    store = JobStore.host(TOKEN)
    wd, client = _watchdog(store, heartbeat_timeout_s=0.05)
    assert wd.beat_every_s == 0.01
    wd.poll_once(client)
    first = client.heartbeat_of(1)
    time.sleep(0.02)
    wd.poll_once(client)
    second = client.heartbeat_of(1)
    assert first is not None and second is not None and second[0] > first[0]


def test_benchmark_switches_are_named_and_checked() -> None:
    assert switched_off({}) == frozenset()
    assert switched_off({ENV: "logging, rng"}) == {"logging", "rng"}
    with pytest.raises(ValueError, match=f"{ENV}=.*unknown protection.*'digest'"):
        switched_off({ENV: "digest"})


def test_scoped_determinism_off_changes_nothing() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    scoped = ScopedDeterminism(on=False)
    assert torch.are_deterministic_algorithms_enabled() == before
    scoped.restore()
    assert torch.are_deterministic_algorithms_enabled() == before


def test_startup_lines_say_what_detection_undo_and_determinism_cost() -> None:
    cfg = SwiftConfig.from_dict({"enabled": True})
    text = "\n".join(_runtime_lines(cfg, frozenset()))
    assert "waits on the failure flag (under ds-swift-launch its node agent waits on it" in text
    assert "else a blocking job-store wait" in text and "beats every 1 s" in text
    assert "update-undo: a step record" in text and "deterministic algorithms on" in text
    off = "\n".join(_runtime_lines(cfg, frozenset({"watchdog", "undo"})))
    assert f"failure detection: OFF (benchmark: {ENV})" in off and f"update-undo: OFF (benchmark: {ENV})" in off


def test_os_thread_names() -> None:
    assert os_thread_name("ds-swift-buddy") == "sw-buddy"
    assert os_thread_name("ds-swift-watchdog-12345") == "sw-watchdog-123"  # 15 bytes at most
    seen: list[str] = []

    def run() -> None:
        name_os_thread()
        path = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        seen.append(path.read_text().strip() if path.exists() else "sw-test")

    t = threading.Thread(target=run, name="ds-swift-test")
    t.start()
    t.join()
    assert seen == ["sw-test"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_cpu_sampler_counts_a_child_by_role_and_thread() -> None:
    # A child that burns CPU in a thread named as ds-swift names its threads, under a rank's env.
    code = (
        "import threading, time, sys\n"
        "from ds_swift.threadname import name_os_thread\n"
        "def burn():\n"
        "    name_os_thread()\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.3: pass\n"
        "    print('done', flush=True); time.sleep(30)\n"
        "threading.Thread(target=burn, name='ds-swift-digest-3', daemon=True).start()\n"
        "sys.stdin.read()\n"
    )
    env = dict(os.environ, RANK="3", LOCAL_RANK="1")
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"done"
        sample = sample_tree(os.getpid())
        assert sample.seconds[("ranks", "sw-digest")] >= 0.2
        assert sample.total("launcher") > 0  # this test process itself is not a rank
    finally:
        child.kill()
        child.wait(10)
    a = CpuSample({("ranks", "main"): 1.0, ("ranks", "sw-buddy"): 0.5})
    b = CpuSample({("ranks", "main"): 3.0, ("ranks", "sw-buddy"): 0.5, ("launcher", "main"): 0.4})
    assert per_iteration(a, b, 4) == {("ranks", "main"): 0.5, ("launcher", "main"): 0.1}


def test_message_logging_switch_makes_no_plan() -> None:
    from ds_swift.protect.message_logging import EngineLogging

    logs = EngineLogging(SwiftConfig.from_dict({"enabled": True}), {}, lambda i, m: None, 0, "/tmp")
    logs.enabled = False
    assert logs.possible(SimpleNamespace()) is False  # the plan is never made: nothing to hook


def _warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.WARNING]


def test_a_failed_topology_analysis_says_loudly_what_stops(caplog: pytest.LogCaptureFixture) -> None:
    from ds_swift.protect.message_logging import EngineLogging

    logs = EngineLogging(SwiftConfig.from_dict({"enabled": True}), {}, lambda i, m: None, 0, "/tmp")
    engine = SimpleNamespace()  # no grid: the analyzer cannot read its topology
    assert logs.possible(engine) is False and logs.plan_error is not None
    (said,) = _warnings(caplog, "ds_swift.protect.message_logging")
    assert said.startswith("topology analysis failed (") and "message logging, update logging by stage and" in said
    assert "recovers from the global checkpoint" in said
    line = MessageLogging(logs, None).cost_line(engine, None)  # type: ignore[arg-type]  # the real reason, not "no send crosses"
    assert f"off (topology analysis failed: {logs.plan_error};" in line, line
    logs.possible(engine)
    assert len(_warnings(caplog, "ds_swift.protect.message_logging")) == 1  # said once


@pytest.mark.parametrize(
    ("raised", "why"),
    [
        (ValueError("FusedAdam has no inverse"), "unavailable for this optimizer: FusedAdam has no inverse"),
        (ModuleNotFoundError("no undo", name="ds_swift.undo.engine"), "ds_swift.undo.engine is not installed"),
        (ImportError("cannot import name 'x' from 'triton'"), "ImportError: cannot import name 'x' from 'triton'"),
    ],
)
def test_update_undo_that_cannot_attach_says_so_loudly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, raised: Exception, why: str
) -> None:
    import ds_swift.undo
    from ds_swift.runtime.hooks import attach_undo

    def attach(engine: Any) -> Any:
        raise raised

    monkeypatch.setattr(ds_swift.undo, "attach_to_engine", attach)
    assert attach_undo(SimpleNamespace()) == (None, why)
    (said,) = _warnings(caplog, "ds_swift.runtime.hooks")
    assert said == (
        f"update-undo is off ({why}); training goes on: a failure with a survivor one step ahead reloads the "
        "global checkpoint"
    )
    text = "\n".join(_runtime_lines(SwiftConfig.from_dict({"enabled": True}), frozenset(), why))
    assert f"update-undo: off ({why}): a failure with a survivor one step ahead reloads" in text, text
