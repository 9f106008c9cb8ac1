"""ds_swift.patches.deepspeed_engine: the engine state I/O, the replay's drive and the save override,
on stand-ins of a DeepSpeed engine (the real engine runs them in tests/dist)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_swift.patches import deepspeed_engine as de
from ds_swift.patches._base import SUPPORTED_DEEPSPEED, PatchError, check_deepspeed


class Engine:
    """What the functions under test touch of a DeepSpeed PipelineEngine."""

    def __init__(self) -> None:
        self.global_steps, self.global_samples, self.skipped_steps, self.micro_steps = 7, 56, 1, 28
        self._step_applied, self._global_grad_norm = True, 0.5
        self.micro_batches = 4
        self.module = torch.nn.Linear(2, 2)
        self.total_loss: Any = None
        self.ran: list[tuple[int, bool]] = []
        self.fail = False

    def train_batch_size(self) -> int:
        return 8

    def gradient_accumulation_steps(self) -> int:
        return 4

    def is_last_stage(self) -> bool:
        return True

    def set_dataiterator(self, data: Any) -> None:
        self.data = data

    def _train_schedule(self) -> str:
        return "schedule"

    def _exec_schedule(self, schedule: str) -> None:
        self.ran.append((self.micro_batches, self._compute_loss))
        if self.fail:
            raise RuntimeError("a receive failed")
        self.total_loss = torch.tensor([2.0, 4.0])

    def _scale_loss_by_gas(self, loss: torch.Tensor) -> torch.Tensor:
        return loss / self.gradient_accumulation_steps()

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None, **kw: Any) -> Any:
        return (save_dir, tag, client_state, kw)


def test_counters_put_an_engine_at_an_iteration() -> None:
    e = Engine()
    assert de.counters_of(e) == {"global_steps": 7, "global_samples": 56, "skipped_steps": 1, "micro_steps": 28}
    de.set_counters(e, 3)
    assert de.counters_of(e) == {"global_steps": 3, "global_samples": 24, "skipped_steps": 1, "micro_steps": 12}
    de.set_counters(e, 5, skipped_steps=2)
    assert (e.global_steps, e.skipped_steps, e.micro_steps) == (5, 2, 20)


def test_step_state_round_trips_and_refuses_other_names() -> None:
    e = Engine()
    saved = de.step_state(e)
    assert set(saved) == set(de.STEP_STATE)
    e.global_steps, e._step_applied, e._global_grad_norm = 8, False, 9.0
    de.restore_step_state(e, saved)
    assert (e.global_steps, e._step_applied, e._global_grad_norm, e.micro_steps) == (7, True, 0.5, 28)
    de.restore_step_state(e, {"global_steps": 2}, realign_micro_steps=True)
    assert (e.global_steps, e.micro_steps) == (2, 8)
    with pytest.raises(ValueError, match="module"):
        de.restore_step_state(e, {"module": None})


def test_the_replays_schedule_runs_a_share_and_puts_the_micro_batches_back() -> None:
    e = Engine()
    de.run_train_schedule(e, iter([1, 2]), 2)
    assert e.ran == [(2, True)] and e.micro_batches == 4 and list(e.data) == [1, 2]
    assert de.iteration_loss(e) == pytest.approx(0.75)  # mean of [2, 4] / gas 4
    e.fail = True
    with pytest.raises(RuntimeError, match="receive"):
        de.run_train_schedule(e, None, 1)
    assert e.micro_batches == 4 and e.total_loss is None


def test_the_save_override_fills_the_client_state_and_is_removable() -> None:
    e = Engine()
    handle = de.override_save(e, lambda: {"iteration": e.global_steps})
    assert e.save_checkpoint("d", tag="t") == ("d", "t", {"iteration": 7}, {})
    own = e.save_checkpoint("d", client_state={"mine": 1}, save_latest=False)  # the caller's own state
    assert own == ("d", None, {"mine": 1}, {"save_latest": False})
    with pytest.raises(PatchError, match="already overridden"):
        de.override_save(e, dict)
    handle.remove()
    assert "save_checkpoint" not in vars(e) and e.save_checkpoint("d") == ("d", None, None, {})
    outer = de.override_save(e, dict)
    vars(e)["save_checkpoint"] = lambda *a, **k: None  # someone else's override on top of ours
    with pytest.raises(PatchError, match="replaced again"):
        outer.remove()


def test_one_deepspeed_range_is_checked() -> None:
    low, below = SUPPORTED_DEEPSPEED
    check_deepspeed(low)
    with pytest.raises(PatchError, match=f"deepspeed >={low},<{below}"):
        check_deepspeed(below)
