"""The update logger's deletion of records a complete checkpoint made unneeded
(UpdateLogger._collect): its own records by name, and the store listed only until a deletion's bound
passes the first record the process stored (what an earlier, lost process of the same rank left
lies below it): a listing is of every rank's records, up to ranks x checkpoint interval names, too
many to read at every checkpoint on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ds_swift.protect import update_logger as update_logging
from ds_swift.protect.update_logger import UpdateLogger
from ds_swift.recovery.state.update_log import UpdateRecord, parse_name, record_name, save_record
from ds_swift.storage import open_store


def record(iteration: int) -> UpdateRecord:
    return UpdateRecord(iteration=iteration, skipped=False, groups=[], counters={}, scheduler=None, scalars=None)


def drive(url: str, *items: tuple[str, Any]) -> None:
    """A new process's update logger of rank 1, handed ``items`` (its writer thread's work) in order."""
    logger = UpdateLogger(1, url, undo=lambda: None)
    logger._make_tmp()
    try:
        for item in items:
            logger._do(item)
    finally:
        logger._remove_tmp()


def test_records_before_a_checkpoint_go_by_name_after_one_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'log'}"
    store = open_store(url)
    for rank in (0, 1):  # a lost process of rank 1, and rank 0, left these
        save_record(record(2), tmp_path / "r.pt")
        store.put_file(tmp_path / "r.pt", record_name(rank, 2))
    listings = [0]

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def names(self) -> list[str]:
            listings[0] += 1
            return list(self.inner.names())

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    monkeypatch.setattr(update_logging, "open_store", lambda u: Counting(open_store(u)))
    drive(url, *(("record", record(it)) for it in (3, 4, 5, 6)), ("gc", 5), ("record", record(7)), ("gc", 7))
    left = sorted(p for n in store.names() if (p := parse_name(n)) is not None)
    assert left == [(0, 2), (1, 7)], left
    assert listings[0] == 1
    # This process lost; its replacement loads the checkpoint after 7 iterations (a deletion before
    # it stored anything), resumes at 8 and stores 8 and 9: the predecessor's record of 7 goes at
    # the next checkpoint, found by a second listing (the first could not: it was not below 7 yet).
    listings[0] = 0
    drive(url, ("gc", 7), ("record", record(8)), ("record", record(9)), ("gc", 9), ("record", record(10)), ("gc", 10))
    left = sorted(p for n in store.names() if (p := parse_name(n)) is not None)
    assert left == [(0, 2), (1, 10)], left
    assert listings[0] == 2
