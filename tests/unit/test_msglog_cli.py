"""`ds-swift logs DIR`: listing, per-edge bytes, checksum errors naming file and record, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_swift.cli import main
from ds_swift.msglog.chunk_index import load_chunk
from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.writer import LogWriter, MessageMeta, PythonAppender


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    w = LogWriter(tmp_path / "logs", 2, PythonAppender())
    for it in range(3):
        for mb in range(2):
            w.write(MessageMeta(it, mb, LogEdge("act", 1, 2), 1, 2), [torch.zeros(100)])
            w.write(MessageMeta(it, mb, LogEdge("grad", 2, 1), 2, 1), [torch.zeros(50)])
    w.close()
    return tmp_path / "logs"


def test_lists_chunks_and_bytes_per_edge(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "4 chunks, 12 valid records" in out
    record = 56 + 8 + 4 + 400  # header (1-D shape) + payload
    assert f"act s1->s2 dp0 tp0: it0={2 * record}  it1={2 * record}  it2={2 * record}" in out
    assert out.rstrip().endswith("OK")


def test_json_output(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", str(logs), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["records"] == 12 and len(report["chunks"]) == 4
    assert set(report["bytes_per_edge_iteration"]) == {"act s1->s2 dp0 tp0", "grad s2->s1 dp0 tp0"}


def test_flipped_byte_is_a_checksum_error_naming_file_and_record(
    logs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chunk = sorted(logs.glob("grad_*.swlog"))[0]
    e = load_chunk(chunk).order[3]
    data = bytearray(chunk.read_bytes())
    data[e.offset + e.length - 7] ^= 0x80
    chunk.write_bytes(bytes(data))
    assert main(["logs", str(logs)]) == 1
    captured = capsys.readouterr()
    assert (
        f"checksum error: {chunk}: record #3 at offset {e.offset} (iteration 1, micro-batch 1, grad, part 0)"
        in captured.err
    )
    assert "FAILED: 1 error(s)" in captured.out


def test_unreadable_location_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_location_without_chunks_or_a_file_is_an_error_not_ok(
    logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The parent of a log directory (or an empty one) verified as "0 chunks ... OK", exit 0.
    assert main(["logs", str(tmp_path)]) == 2
    assert f"no message-log chunk in {tmp_path}" in capsys.readouterr().err
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    assert main(["logs", str(afile)]) == 2
    assert f"message log directory {afile} is a file, not a directory" in capsys.readouterr().err
