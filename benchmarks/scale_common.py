"""What the parts of ``benchmarks/scale.py`` share: the simulated job's layout, its job store, a fake clock.

The simulated job is laid out as users run it on DGX machines: 8 ranks per machine, tensor
parallelism 8 inside a machine, pipeline parallelism 4 (fewer where the job is smaller) and data
parallelism over the rest, in Megatron-DeepSpeed's rank order (tp fastest, then dp, then pp):
1,024 ranks are tp 8 x pp 4 x dp 32, 16,384 are tp 8 x pp 4 x dp 512.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch.distributed as dist

from ds_swift.detect.wake import watched_peers
from ds_swift.jobstore.membership import JobStore
from ds_swift.testing.counting_store import CountingStore

__all__ = ["PER_MACHINE", "FakeClock", "Layout", "StoreSet", "quiet"]

PER_MACHINE = 8
TOKEN = "scale-harness-token"
SECRET = "scale-harness-secret"
LAUNCH = "scale"


@dataclass(frozen=True)
class Layout:
    """``ranks`` ranks as tp x pp x dp (see the module docstring)."""

    ranks: int

    @property
    def tp(self) -> int:
        return min(PER_MACHINE, self.ranks)

    @property
    def pp(self) -> int:
        return max(1, min(4, self.ranks // self.tp))

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def machines(self) -> int:
        return self.ranks // PER_MACHINE

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp index, tp index) of ``rank``."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, stage: int, d: int, t: int) -> int:
        return stage * self.dp * self.tp + d * self.tp + t

    def machine(self, rank: int) -> int:
        return rank // PER_MACHINE

    def engine(self, rank: int) -> Any:
        """The little of a DeepSpeed pipeline engine that ds_swift.detect.wake reads."""
        stage, d, t = self.coords(rank)
        layout = self

        class Grid:
            def stage_to_global(self, stage_id: int, data: int | None = None) -> int:
                return layout.rank_of(stage_id, d if data is None else data, t)

            def get_data_parallel_world_size(self) -> int:
                return layout.dp

            def get_data_parallel_id(self) -> int:
                return d

            def get_slice_parallel_rank(self) -> int:
                return t

        return SimpleNamespace(stage_id=stage, num_stages=self.pp, grid=Grid(), global_rank=rank)

    def watched(self, rank: int) -> list[int]:
        """The peers ``rank``'s watchdog watches, as the runtime computes them (ds_swift.detect.wake)."""
        return watched_peers(self.engine(rank))


class StoreSet:
    """One in-process store server and counting clients on it, one per part of the job measured
    (their tallies say which part asked what). ``virtual_waits``: see CountingStore."""

    def __init__(self, virtual_waits: bool = False, timeout_s: float = 120.0) -> None:
        self.server = dist.HashStore()
        self.server.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.virtual_waits = virtual_waits
        self.parts: dict[str, CountingStore] = {}
        JobStore(self.counting("setup"), TOKEN, SECRET).begin(LAUNCH)
        self.counting("setup").take()

    def counting(self, part: str) -> CountingStore:
        """The counting store of ``part`` (made on first use; kept referenced: see CountingStore)."""
        if part not in self.parts:
            self.parts[part] = CountingStore(self.server, virtual_waits=self.virtual_waits)
        return self.parts[part]

    def client(self, part: str) -> JobStore:
        """A job-store client (its own replay marks, as a process has) counted under ``part``,
        joined to the launch as JobStore.connect joins it."""
        store = JobStore(self.counting(part), TOKEN, SECRET)
        store._join("the harness's store", LAUNCH, 0.0)
        return store

    def take(self, part: str) -> Any:
        return self.counting(part).take()


class FakeClock:
    """A clock the harness moves; ``time.monotonic`` and ``time.time`` read it while :meth:`installed`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeClock]:
        with (
            mock.patch.object(time, "monotonic", self),
            mock.patch.object(time, "time", self),
            mock.patch("ds_swift.detect.beats._monotonic", self),
        ):
            yield self


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The code's own lines off while simulated ranks run (thousands of them would say the same)."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
