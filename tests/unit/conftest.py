"""Fixtures more than one unit test module uses."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

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


Ends = Callable[[Callable[[], Any], float, str], BaseException | None]


@pytest.fixture
def ends() -> Ends:
    """``ends(call, timeout_s, what)``: run ``call`` on a thread; the error it ended with (None: it
    returned). It must end within ``timeout_s``, else the test fails saying ``what``."""

    def run_bounded(call: Callable[[], Any], timeout_s: float, what: str) -> BaseException | None:
        box: list[BaseException | None] = [None]

        def run() -> None:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                box[0] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout_s)
        assert not t.is_alive(), what
        return box[0]

    return run_bounded
