"""A round of SCAR's running checkpoint waits for the previous round's write at most ``wait_s``:
a hung file system never holds the training thread (ds_swift.checkpoint.running)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import ds_swift.checkpoint.running as rc_mod
from ds_swift.checkpoint.running import RunningCheckpoint, RunningCheckpointError, load_running_checkpoint

ADAM = {"masters": ["exp_avg", "exp_avg_sq"]}


def test_a_write_that_does_not_end_skips_the_round_instead_of_holding_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung file system held the next round (the training thread) for good; now the round is
    skipped after wait_s, its blocks stay due, and the write that ends later counts."""
    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(32, generator=g) for name in ("masters", "exp_avg", "exp_avg_sq")}  # 4 blocks of 8
    rc = RunningCheckpoint(tmp_path, fraction=0.25, interval=4, groups=ADAM, block_elements=8, wait_s=0.05)
    release = threading.Event()
    write = rc_mod.write_atomic

    def hung(path: Path, buffers: object) -> None:
        release.wait(30.0)  # the test's own bound: released below
        write(path, buffers)  # type: ignore[arg-type]

    monkeypatch.setattr(rc_mod, "write_atomic", hung)
    rc.save(0, state, full=True)
    with pytest.raises(RunningCheckpointError, match="round of iteration 0 is still being written after 0 s"):
        rc.save(1, state)
    release.set()
    state["masters"][8:16] += 1.0
    assert rc.save(2, state) == {"masters": (1,)}  # the write of iteration 0 ended: this round goes on
    rc.close()
    loaded, ages = load_running_checkpoint(tmp_path, state)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
