"""Ranks waiting on a replay wait while it moves (replay_progress), not for the 7-day cap: a
replayer that stopped without dying (a hung file system, a stopped process) ends the generation
after a window without progress. No processes: the store is a script of what each window sees."""

from __future__ import annotations

import pytest

from ds_swift.jobstore.membership import GenerationFailed
from ds_swift.recovery.replay.log import await_progressing


class ScriptedStore:
    """Each gather is one window: it returns the summaries once ``done`` says so, else times out
    after advancing the replayers' progress by the script's next step."""

    def __init__(self, steps: list[dict[int, str | None]], done_after: int | None) -> None:
        self.steps, self.done_after = steps, done_after
        self.windows: list[float] = []
        self.progress: dict[int, str | None] = {}
        self.declared: list[str] = []

    def gather(self, generation: int, topic: str, ranks: list[int], timeout_s: float) -> dict[int, str]:
        assert topic == "replayed"
        self.windows.append(timeout_s)
        if self.done_after is not None and len(self.windows) > self.done_after:
            return {r: "{}" for r in ranks}
        if self.steps:
            self.progress = self.steps.pop(0)
        raise TimeoutError("window")

    def get(self, key: str) -> str | None:
        return self.progress.get(int(key.rsplit("/", 1)[1]))

    def declare_failure(self, generation: int, reason: str) -> bool:
        self.declared.append(reason)
        return True


def test_a_replay_that_keeps_moving_is_waited_for_however_long() -> None:
    steps = [{2: None}, {2: "1"}, {2: "2"}, {2: "3"}]  # the checkpoint load, then an iteration a window
    store = ScriptedStore(steps, done_after=4)
    assert await_progressing(store, 3, [2], stall_timeout_s=600.0, timeout_s=1e9) == {2: "{}"}
    assert store.windows == [600.0] * 5 and not store.declared


def test_a_replayer_that_stops_ends_the_generation_after_one_still_window() -> None:
    store = ScriptedStore([{2: "0", 3: "0"}, {2: "1", 3: "0"}, {2: "1", 3: "0"}], done_after=None)
    with pytest.raises(GenerationFailed, match="the replay made no progress for 600 s"):
        await_progressing(store, 3, [2, 3], stall_timeout_s=600.0, timeout_s=1e9)
    assert len(store.windows) == 3 and len(store.declared) == 1  # moved in window 2, still in window 3
    assert "{2: '1', 3: '0'}" in store.declared[0] and "a replayer stopped without dying" in store.declared[0]


def test_the_first_window_is_the_checkpoint_loads() -> None:
    # Nothing published in the first window (the replayers load the checkpoint): not a stall yet.
    store = ScriptedStore([{}, {}], done_after=None)
    with pytest.raises(GenerationFailed):
        await_progressing(store, 0, [1], stall_timeout_s=5.0, timeout_s=1e9)
    assert store.windows == [5.0, 5.0]
