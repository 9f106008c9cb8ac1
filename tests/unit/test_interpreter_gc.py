"""ds_swift.interpreter: the collector is off inside, and back as it was after (an error included)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from ds_swift.interpreter import collector_paused


@pytest.fixture(autouse=True)
def collector_on_after() -> Iterator[None]:
    yield
    gc.enable()


def test_off_inside_and_on_again_after() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_inside_turns_it_on_again() -> None:
    gc.enable()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off() -> None:
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
