"""ds_swift.logs: the one logging channel (stdlib logging, ``[ds-swift]`` lines on stderr)."""

from __future__ import annotations

import logging

import pytest

from ds_swift.logs import logger, say
from ds_swift.recovery.base import loud


def test_a_line_keeps_the_form_operators_and_job_checks_read(capsys: pytest.CaptureFixture[str]) -> None:
    say("buddy copies: rank(s) [2] hold mine", 3)
    say("recovery plan per pipeline stage: {0: 'replication'}")
    say("job finished", prefix="ds-swift-launch")
    loud(1, "CHECKPOINT FALLBACK")
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "[ds-swift] rank 3: buddy copies: rank(s) [2] hold mine",
        "[ds-swift] recovery plan per pipeline stage: {0: 'replication'}",
        "[ds-swift-launch] job finished",
        "[ds-swift] rank 1: CHECKPOINT FALLBACK",
    ]


def test_module_loggers_share_the_channel_and_propagate(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ds_swift"):
        logger("ds_swift.msglog.writer").warning("log chunk %s: dropping a torn tail", "c0")
        logger("launch.gpu_health").warning("critical Xid 79")
    assert capsys.readouterr().err.splitlines() == [
        "[ds-swift] log chunk c0: dropping a torn tail",
        "[ds-swift] critical Xid 79",
    ]
    # An application's own handlers (here pytest's) see them too, by their module's name.
    assert [r.name for r in caplog.records] == ["ds_swift.msglog.writer", "ds_swift.launch.gpu_health"]


def test_loud_is_a_warning_said_by_its_module(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ds_swift"):
        loud(0, "BUDDY COPIES OFF")
    (record,) = caplog.records
    assert (record.levelno, record.name, record.rank) == (logging.WARNING, "ds_swift.recovery.base", 0)  # type: ignore[attr-defined]


def test_say_here_tags_the_line_with_this_process_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys
    from types import SimpleNamespace

    from ds_swift.logs import rank_here, say_here

    up = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 5)
    monkeypatch.setitem(sys.modules, "torch.distributed", up)
    assert rank_here() == 5
    say_here("undo: last stepped iteration 4 -> consensus 3")
    monkeypatch.setitem(
        sys.modules, "torch.distributed", SimpleNamespace(is_available=lambda: True, is_initialized=lambda: False)
    )
    assert rank_here() is None
    say_here("no group yet")
    assert capsys.readouterr().err.splitlines() == [
        "[ds-swift] rank 5: undo: last stepped iteration 4 -> consensus 3",
        "[ds-swift] no group yet",
    ]


def test_no_function_takes_a_log_callable() -> None:
    """One channel: ds-swift's code logs through ds_swift.logs, never through a ``log`` argument
    handed down the calls (issue 31, item 4)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("ds_swift", "launch", "patches"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    found += [
                        f"{path.relative_to(root)}:{node.lineno} {node.name}"
                        for a in args
                        if a.arg == "log" and "Callable" in ast.unparse(a.annotation or ast.Constant(""))
                    ]
    assert found == []
