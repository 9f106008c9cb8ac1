"""A hung shared file system does not hold the training thread at the checkpoint's small calls
(ds_swift.checkpoint.fs_calls), and the logs are collected against this job's own newest complete
checkpoint, never a newer tag another launch of the job left in the directory (issue 52)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_swift.checkpoint import periodic
from ds_swift.checkpoint.periodic import COMPLETE_MARKER, CheckpointManager
from ds_swift.runtime.engine_checkpoint import CheckpointCalls


class FakeEngine:
    def __init__(self, global_steps: int) -> None:
        self.global_steps = global_steps
        self.checkpoint_engine = TorchCheckpointEngine()
        self.saved: list[str] = []

    def save_checkpoint(self, save_dir: str, tag: str, **_: Any) -> None:
        self.saved.append(tag)
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save({"w": torch.ones(2)}, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt"))


@pytest.fixture
def hung(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], threading.Event]]:
    """``hang(name)``: periodic's ``name`` (a file-system call) blocks until the event is set."""
    events: list[threading.Event] = []

    def hang(name: str) -> threading.Event:
        real, gate = getattr(periodic, name), threading.Event()
        events.append(gate)

        def blocked(*args: Any, **kwargs: Any) -> Any:
            gate.wait(120.0)
            return real(*args, **kwargs)

        monkeypatch.setattr(periodic, name, blocked)
        return gate

    yield hang
    for gate in events:
        gate.set()


def _returns(call: Callable[[], Any], within_s: float = 30.0) -> Any:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(call()), daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), "the training thread is held by the file system"
    return box[0]


def _manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(str(tmp_path), interval=4, rank=0, job_id="job-mine", fs_deadline_s=0.5)


def test_the_per_iteration_marker_check_never_waits_on_the_file_system(
    tmp_path: Path, hung: Callable[[str], threading.Event], capsys: pytest.CaptureFixture[str]
) -> None:
    m = _manager(tmp_path)
    m.writer = SimpleNamespace(report_errors=lambda: None)  # type: ignore[assignment]
    m.pending = "global_step4"  # an asynchronous save in flight
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / COMPLETE_MARKER).write_text(json.dumps({"iterations": 4, "job": "job-mine"}))
    gate = hung("is_complete")
    for _ in range(3):
        assert _returns(m.poll) is False  # an iteration each: none of them waits for the read
    threading.Event().wait(0.6)
    assert _returns(m.poll) is False
    assert "reading the completion marker of global_step4 has not returned" in capsys.readouterr().err
    gate.set()
    for _ in range(100):
        if _returns(m.poll):
            break
        threading.Event().wait(0.05)
    assert m.complete == 4 and m.pending is None
    assert "answered again" in capsys.readouterr().err


def test_rank_0s_marker_write_on_a_hung_file_system_does_not_hold_training(
    tmp_path: Path, gloo_world: None, hung: Callable[[str], threading.Event], capsys: pytest.CaptureFixture[str]
) -> None:
    m = _manager(tmp_path)
    gate = hung("write_atomic")
    assert _returns(lambda: m.save(FakeEngine(4))) == "global_step4"
    assert "writing the completion marker of global_step4 has not returned" in capsys.readouterr().err
    assert not (tmp_path / "global_step4" / COMPLETE_MARKER).exists() and m.complete == -1
    assert _returns(m.poll) is False  # the thread is still in the write: nothing queues behind it
    gate.set()  # the file system answers: the marker lands, and the checkpoint counts from then on
    for _ in range(100):
        if _returns(m.poll):
            break
        threading.Event().wait(0.05)
    assert m.complete == 4 and (tmp_path / "global_step4" / COMPLETE_MARKER).exists()


def test_a_marker_that_cannot_be_removed_skips_the_checkpoint_on_every_rank(
    tmp_path: Path, gloo_world: None, hung: Callable[[str], threading.Event], capsys: pytest.CaptureFixture[str]
) -> None:
    m = _manager(tmp_path)
    hung("remove_durable")
    engine = FakeEngine(8)
    assert _returns(lambda: m.save(engine)) == "global_step8"
    assert engine.saved == [] and m.last_saved == 8  # no rank wrote a file of it; tried at the next interval
    assert "checkpoint global_step8 skipped on every rank" in capsys.readouterr().err


def test_logs_go_only_up_to_this_jobs_own_newest_complete_checkpoint(tmp_path: Path, gloo_world: None) -> None:
    """An earlier launch of the job reached global_step20; this one restarted from global_step8 and
    saves global_step12. Its logs since 12 are what its recoveries replay: measured against 20 (the
    newest complete tag of the job id in the directory), they went."""
    earlier = tmp_path / "global_step20"
    earlier.mkdir()
    (earlier / COMPLETE_MARKER).write_text(json.dumps({"iterations": 20, "job": "job-mine"}))
    collected: list[int] = []
    calls = CheckpointCalls()
    calls._engine = FakeEngine(12)
    calls._ckpt = _manager(tmp_path)
    calls._rebuild = SimpleNamespace(protect=SimpleNamespace(after_checkpoint=collected.append))  # type: ignore[assignment]
    calls._save_checkpoint()
    for _ in range(100):  # the iterations after the save: its marker is seen complete
        if calls._ckpt.after_iteration():
            calls._checkpointed()
            break
        threading.Event().wait(0.05)
    assert collected == [12], collected
