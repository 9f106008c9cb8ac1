"""A load that fails on a damaged checkpoint names the file and the complete checkpoints beside it
(it was torch's "PytorchStreamReader failed reading zip archive", no file, no tag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_swift.checkpoint.damage import damaged_file, load_failure_note, named_on_failure
from ds_swift.checkpoint.durable import COMPLETE_MARKER


def save_tag(root: Path, iterations: int) -> Path:
    tag = root / f"global_step{iterations}"
    tag.mkdir(parents=True)
    for name in ("layer_00-model_00-model_states.pt", "mp_rank_00_model_states.pt"):
        torch.save({"w": torch.arange(1000.0)}, tag / name)
    (tag / COMPLETE_MARKER).write_text(json.dumps({"iterations": iterations}))
    (root / "latest").write_text(tag.name)
    return tag


def test_a_truncated_file_is_named_with_the_complete_checkpoints_beside_it(tmp_path: Path) -> None:
    save_tag(tmp_path, 4)
    tag = save_tag(tmp_path, 8)
    assert damaged_file(tag) is None
    hit = tag / "mp_rank_00_model_states.pt"
    hit.write_bytes(hit.read_bytes()[:100])
    with pytest.raises(RuntimeError, match="failed reading zip archive"):
        torch.load(hit)  # what DeepSpeed's load raises, naming nothing
    with pytest.raises(RuntimeError, match="failed reading zip archive") as raised, named_on_failure(tmp_path):
        torch.load(hit)
    (note,) = raised.value.__notes__  # what a failed load carries
    assert note == load_failure_note(tmp_path)
    assert note.startswith(f"ds-swift: loading checkpoint global_step8 from {tmp_path} failed: {hit} is truncated")
    assert "complete checkpoints beside it: global_step4" in note


def test_a_flipped_byte_fails_its_crc_and_no_fallback_is_said(tmp_path: Path) -> None:
    tag = save_tag(tmp_path, 4)
    hit = tag / "layer_00-model_00-model_states.pt"
    data = bytearray(hit.read_bytes())
    data[data.index(b"data/0") + 200] ^= 0x40  # in the tensor's bytes, stored uncompressed
    hit.write_bytes(bytes(data))
    found = damaged_file(tag)
    assert found is not None and found[0] == hit and "fails its CRC" in found[1]
    assert load_failure_note(tmp_path, "global_step4").endswith(
        "no other complete checkpoint is there: start without loading, or restore the file"
    )
    (tmp_path / "latest").unlink()
    assert "its 'latest' file cannot be read" in load_failure_note(tmp_path)
