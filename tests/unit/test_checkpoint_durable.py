"""A synchronous save's files are on disk before ds-swift marks the tag complete
(ds_swift.checkpoint.background.durable_saves), also through a decoupled checkpoint engine, which
writes in another process: its save used to be synced (and then marked complete, and the logs older
than it collected) while that process was still writing; DeepSpeed waits for it only at the next step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_swift.checkpoint import background
from ds_swift.checkpoint.background import durable_saves


@pytest.mark.parametrize("decoupled", [True, False])
def test_a_decoupled_writer_has_written_before_the_tag_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoupled: bool
) -> None:
    events: list[str] = []
    tag = tmp_path / "global_step8"
    tag.mkdir()

    class Writer:
        def is_decoupled(self) -> bool:
            return decoupled

        def save(self, state: object, path: str) -> None:
            events.append("save")

    engine = SimpleNamespace(checkpoint_engine=Writer())
    engine._commit_decoupled_checkpoint = lambda: events.append("written")  # type: ignore[attr-defined]
    monkeypatch.setattr(background, "fsync_tree", lambda d: events.append(f"sync tree {Path(d).name}"))
    monkeypatch.setattr(background, "fsync_file", lambda p: events.append(f"sync {Path(p).name}"))
    with durable_saves(engine, tag):
        engine.checkpoint_engine.save({}, str(tag / "model.pt"))
    if decoupled:
        assert events == ["save", "written", "sync tree global_step8"]
    else:  # each file synced as its rank wrote it; nothing to wait for
        assert events == ["save", "sync model.pt"]
