"""The warm-up allowance's arithmetic (ds_swift.runtime.warmup); the job-level test is
tests/dist/test_stall.py::test_a_slow_first_iteration_is_neither_a_stall_nor_a_failure."""

from __future__ import annotations

import time

import pytest

from ds_swift.runtime.warmup import ITERATIONS, WarmUp


def test_the_first_iterations_of_a_generation_get_twice_the_start_up_within_the_caps() -> None:
    said: list[str] = []
    w = WarmUp(hang_timeout_s=120.0, rank=0)
    assert w.start(0, time.time() - 20.0, 15.0, said.append) == pytest.approx(40.0, abs=0.5)
    assert len(said) == 1 and "run with a 40 s op timeout" in said[0] and "then 15 s" in said[0]
    for _ in range(ITERATIONS):
        assert w.left > 0
        w.stepped()
    assert w.left == 0  # then the op timeout again
    assert w.start(1, time.time() - 500.0, 15.0) == pytest.approx(108.0)  # under the hang timeout
    assert WarmUp(None, 1).start(0, time.time() - 500.0, 15.0) == pytest.approx(150.0)  # 10 op timeouts
    assert WarmUp(None, 0).start(0, time.time() - 1.0, 15.0, said.append) == 15.0 and len(said) == 1
