"""A launcher SIGKILLed leaves its agents' beat directories in /dev/shm; the next agent on the host
removes those nothing wrote in for an hour, and nothing else (launch/health.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from launch.health import BEAT_DIR_PREFIX, STALE_BEAT_DIR_S, sweep_stale_beat_dirs


def _beat_dir(root: Path, name: str, age_s: float) -> Path:
    d = root / name
    d.mkdir()
    (d / "3").write_text("17 10.0 iteration 4")
    os.mkfifo(d / "wake.3")
    t = time.time() - age_s
    for p in (d / "3", d / "wake.3", d):
        os.utime(p, (t, t))
    return d


def test_only_the_beat_directories_nothing_wrote_in_for_an_hour_go(tmp_path: Path) -> None:
    dead = _beat_dir(tmp_path, f"{BEAT_DIR_PREFIX}0-dead", STALE_BEAT_DIR_S + 60)
    live = _beat_dir(tmp_path, f"{BEAT_DIR_PREFIX}1-live", 5)
    other = _beat_dir(tmp_path, "someone-elses-dir", STALE_BEAT_DIR_S + 60)
    beating = _beat_dir(tmp_path, f"{BEAT_DIR_PREFIX}2-beating", STALE_BEAT_DIR_S + 60)
    (beating / "5").write_text("1 10.0")  # a rank beat just now in an old directory: a live job
    assert sweep_stale_beat_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists() and beating.exists()


def test_a_root_that_cannot_be_read_removes_nothing(tmp_path: Path) -> None:
    assert sweep_stale_beat_dirs(str(tmp_path / "absent")) == []
