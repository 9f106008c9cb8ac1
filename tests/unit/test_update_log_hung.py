"""The update logger on a store that takes nothing (a hung mount or a store that stopped answering):
the step that would wait for the previous record stops update logging instead, loudly, and goes on.
It used to say so and wait again at every later step until its queue was full, and then block the
training thread until the hang detector took this healthy machine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from ds_swift.patches.instructions import schedule
from ds_swift.protect import update_logger as update_logging
from ds_swift.protect.update_logger import UpdateLogger
from ds_swift.recovery.state.update_log import UpdateRecord


def test_a_record_never_stored_stops_update_logging_and_the_step_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hung = threading.Event()
    monkeypatch.setattr(UpdateLogger, "_do", lambda self, item: hung.wait(60.0))
    said: list[str] = []
    monkeypatch.setattr(update_logging, "say", lambda msg, *a, **k: said.append(msg))
    # The wait is inside the step, which the hang detector times: under half of its timeout.
    logger = UpdateLogger(1, f"file://{tmp_path / 'log'}", undo=lambda: None, hang_timeout_s=0.6)
    assert logger.wait_s == 0.3
    try:
        rec = UpdateRecord(iteration=3, skipped=False, groups=[], counters={}, scheduler=None, scalars=None)
        assert logger._worker.submit(("record", rec))  # the previous step's record, never stored
        stepped: list[Any] = []

        def call_next(**kw: Any) -> str:
            stepped.append(kw)
            return "out"

        step = logger.hooks()[schedule.OptimizerStep]
        assert step(object(), call_next) == "out"
        assert stepped == [{}]  # the step ran
        assert logger.lost is not None and "not stored within 0.3 s" in logger.lost
        assert len(said) == 1 and "update logging stops on this rank, training goes on" in said[0]
        assert step(object(), lambda **kw: "again") == "again"  # later steps wait for nothing
        assert len(said) == 1
        assert UpdateLogger(1, "memory://x", undo=lambda: None).wait_s == update_logging.STORED_BEFORE_STEP_S
    finally:
        hung.set()
        logger.stop(10.0)
