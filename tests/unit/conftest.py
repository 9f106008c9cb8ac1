"""Fixtures more than one unit test module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def gloo_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real one-process gloo world (rank 0 of 1): barriers and gathers run as they do in a job."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
