"""Asynchronous global checkpoints and CheckFreq's interval, without DeepSpeed: the writer thread,
the completion protocol, failed persists, and the config."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from ds_swift.checkpoint.background import AsyncWriter, persisted_marker, snapshot
from ds_swift.checkpoint.checkfreq import CheckFreqTuner, checkfreq_interval
from ds_swift.checkpoint.periodic import COMPLETE_MARKER, CheckpointManager, complete_checkpoints
from ds_swift.checkpoint.setup import asynchronous
from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.recovery.registry import services_of
from ds_swift.testing.configs import swift_config


def test_checkfreq_rule() -> None:
    # The snapshot's share bounds k: 10 ms snapshots at 5 % of 100 ms iterations -> every 2.
    assert checkfreq_interval(0.010, 0.0, 0.100, 0.05) == 2
    # The persist must end before the next snapshot: 1 s of writes at 100 ms iterations -> every 11.
    assert checkfreq_interval(0.010, 1.0, 0.100, 0.05) == 11
    assert checkfreq_interval(0.0, 0.0, 0.100, 0.05) == 1


def test_a_snapshot_does_not_change_with_training() -> None:
    w = torch.arange(6, dtype=torch.float32)
    state = OrderedDict(module=OrderedDict(w=w, view=w[2:4]), step=3, args={"lr": [1.0]})
    snap = snapshot(state)
    w.add_(100.0)
    state["args"]["lr"].append(2.0)
    assert isinstance(snap, OrderedDict) and isinstance(snap["module"], OrderedDict)
    assert torch.equal(snap["module"]["w"], torch.arange(6, dtype=torch.float32))
    assert snap["module"]["view"].tolist() == [2.0, 3.0] and snap["module"]["view"].numel() == 2
    assert snap["args"] == {"lr": [1.0]} and snap["step"] == 3


def _save(writer: AsyncWriter, root: Path, tag: str, save_id: str = "job.g0") -> None:
    writer.begin(tag, str(root), save_id, json.dumps({"iterations": 4, "job": "job"}) + "\n")
    (root / tag).mkdir(parents=True, exist_ok=True)
    writer.add_file({"w": torch.ones(3)}, str(root / tag / "model_states.pt"))
    writer.end()


def test_a_checkpoint_completes_only_once_every_rank_persisted(tmp_path: Path) -> None:
    writer = AsyncWriter(rank=0, world_size=2, complete_timeout_s=30.0)
    _save(writer, tmp_path, "global_step4")
    tag = tmp_path / "global_step4"
    # Rank 0's own files and marker land; rank 1's marker is missing: not complete.
    assert writer.wait_idle(10.0) and not writer.wait_complete(0.5)
    assert torch.equal(torch.load(tag / "model_states.pt")["w"], torch.ones(3))
    assert (tag / persisted_marker("job.g0", 0)).exists() and not (tag / COMPLETE_MARKER).exists()
    assert complete_checkpoints(tmp_path) == []
    # A marker of an earlier save of the same tag (another generation) does not count.
    (tag / persisted_marker("job.g7", 1)).write_text("ok\n")
    assert not writer.wait_complete(0.3)
    (tag / persisted_marker("job.g0", 1)).write_text("ok\n")
    assert writer.wait_complete(10.0)
    assert complete_checkpoints(tmp_path) == [(4, "global_step4")]
    assert json.loads((tag / COMPLETE_MARKER).read_text())["job"] == "job"
    assert (tmp_path / "latest").read_text() == "global_step4"
    assert writer.history[0].complete and writer.history[0].bytes > 0
    assert writer.close(5.0)


def test_a_failed_persist_is_said_and_never_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = AsyncWriter(rank=0, world_size=1, complete_timeout_s=5.0)
    writer.begin("global_step2", str(tmp_path), "job.g0", "{}\n")
    writer.add_file({"w": torch.ones(2)}, str(tmp_path / "no-such-dir" / "x.pt"))
    writer.end()
    assert writer.wait_idle(10.0)
    writer.report_errors()
    err = capsys.readouterr().err
    assert "checkpoint global_step2 could not be written" in err and complete_checkpoints(tmp_path) == []
    writer.report_errors()  # said once
    assert "global_step2" not in capsys.readouterr().err
    writer.close(1.0)


def test_a_failure_abandons_the_wait_for_a_dead_rank(tmp_path: Path) -> None:
    writer = AsyncWriter(rank=0, world_size=2, complete_timeout_s=600.0)
    _save(writer, tmp_path, "global_step4")
    assert writer.wait_idle(10.0) and not writer.wait_complete(0.3)
    writer.abandon()
    assert writer.wait_complete(10.0)
    assert not (tmp_path / "global_step4" / COMPLETE_MARKER).exists()
    writer.close(1.0)


def test_a_rank_that_could_not_persist_gives_the_checkpoint_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = AsyncWriter(rank=0, world_size=2, complete_timeout_s=600.0)
    _save(writer, tmp_path, "global_step4")
    assert writer.wait_idle(10.0) and not writer.wait_complete(0.3)
    (tmp_path / "global_step4" / "swift_failed.job.g0.rank1").write_text("ok\n")  # rank 1's full disk
    assert writer.wait_complete(10.0)
    writer.report_errors()
    assert "checkpoint global_step4 does not count: rank1 could not write it" in capsys.readouterr().err
    assert complete_checkpoints(tmp_path) == []
    writer.close(1.0)


class _Store:
    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self.kv.get(key)

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value


def test_checkfreq_saves_at_the_profiling_point_then_at_the_chosen_interval() -> None:
    store = _Store()
    manager = CheckpointManager("ckpt", 1000, 0, tuner=CheckFreqTuner(0.05, 5, 0, store=store))
    assert [i for i in range(1, 12) if manager.due(i)] == [5]
    # A warm spare built before the choice learns it when it joins a generation.
    store.set("checkfreq/interval", "4")
    manager.new_generation(1)
    assert manager.tuner is not None and manager.tuner.chosen == 4
    assert [i for i in range(1, 13) if manager.due(i)] == [4, 8, 12]
    assert manager.save_id == "job.g1"


def _async(cfg: SwiftConfig, gpu: bool) -> bool:
    return asynchronous(cfg, services_of(cfg), gpu)


def test_config_fields() -> None:
    assert _async(swift_config({"strategy": "global_checkpoint"}), False)
    assert services_of(swift_config({"strategy": "checkfreq"})).checkpoint_tuner
    assert not _async(swift_config({"strategy": "auto"}), False)
    # On GPUs every strategy's saves are asynchronous by default (a pinned copy at PCIe speed)...
    assert _async(swift_config({"strategy": "auto"}), True)
    # ...unless the config says otherwise.
    assert not _async(swift_config({"checkpoint": {"async_save": False}}), True)
    assert _async(swift_config({"checkpoint": {"async_save": True}}), False)
    assert not _async(swift_config({"strategy": "checkfreq", "checkpoint": {"async_save": False}}), False)
    with pytest.raises(ConfigError, match=r"checkfreq.max_overhead=1.5 is invalid: a fraction in \(0, 1\)"):
        swift_config({"checkfreq": {"max_overhead": 1.5}})
    with pytest.raises(ConfigError, match="checkfreq.profile_at=1"):
        swift_config({"checkfreq": {"profile_at": 1}})
    with pytest.raises(ConfigError, match="checkpoint.async_save"):
        swift_config({"checkpoint": {"async_save": "yes"}})
    with pytest.raises(ConfigError, match="global_checkpoint, checkfreq"):
        swift_config({"strategy": "checkfreqq"})


def test_a_persist_that_does_not_end_makes_every_rank_skip_the_next_checkpoint_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The next save waited for this rank's previous persist with no deadline: a hung file system
    blocked the training thread for good, where no watchdog looks (after the iteration). Now it
    waits half of save_timeout_s, the ranks agree, and every rank skips the tag together."""
    from types import SimpleNamespace

    from ds_swift import transport

    class StuckWriter:
        waited: list[float | None] = []

        def wait_idle(self, timeout_s: float | None = None) -> bool:
            self.waited.append(timeout_s)
            return False

        def begin(self, *args: object) -> None:
            raise AssertionError("a skipped checkpoint starts no snapshot")

    gathered: list[object] = []
    monkeypatch.setattr(transport, "all_gather_json", lambda v: gathered.append(v) or [True, v, True, True])
    writer = StuckWriter()
    manager = CheckpointManager("ckpt", 4, 0, save_timeout_s=1800.0, writer=writer, pending="global_step4")  # type: ignore[arg-type]
    assert manager.save(SimpleNamespace(global_steps=8)) == "global_step8"
    assert writer.waited == [900.0] and gathered == [False]
    assert manager.last_saved == 8 and not manager.due(8) and manager.pending == "global_step4"
    err = capsys.readouterr().err
    assert "checkpoint global_step8 skipped on every rank: ranks [1] were still writing their previous" in err
