"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import pytest

from ds_swift.testing.jobs import build_deepspeed_shm_op


@pytest.fixture(scope="session")
def warm_deepspeed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first DeepSpeed start on a fresh machine JIT-builds its shm comm op (~45 s): do it once,
    before any job whose ranks would each spend their start-up deadline on it."""
    build_deepspeed_shm_op(tmp_path_factory.mktemp("warm"), timeout_s=300)
