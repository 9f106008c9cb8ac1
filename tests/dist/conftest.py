"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_swift.testing.jobs import build_deepspeed_shm_op


@pytest.fixture(scope="session")
def warm_deepspeed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first DeepSpeed start on a fresh machine JIT-builds its shm comm op (~45 s): do it once,
    before any job whose ranks would each spend their start-up deadline on it."""
    build_deepspeed_shm_op(tmp_path_factory.mktemp("warm"), timeout_s=300)


@pytest.fixture
def small_log_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MB tmpfs for a log store: full after a few iterations (created here, removed after)."""
    mount = tmp_path / "logfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
