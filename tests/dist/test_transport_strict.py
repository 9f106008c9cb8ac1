"""ds-swift's transport between two real processes on gloo, strict mode on: a host tensor goes on
the transport's own gloo group and arrives; the same tensor sent over the world group (NCCL on a
GPU cluster) is refused before it leaves, also from inside a recovery's state transfer."""

from __future__ import annotations

import json
from pathlib import Path

from ds_swift.testing.ranks import run_ranks

WORKER = Path(__file__).resolve().parent / "workers" / "transport_worker.py"


def test_strict_mode_catches_a_host_tensor_sent_over_the_world_group(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(2, [str(WORKER), str(out)], tmp_path / "logs", timeout_s=180, env={"SWIFT_STRICT_TRANSPORT": "1"})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["strict"] for r in ranks] == [True, True]
    assert ranks[1]["received"] == [0.0, 1.0, 2.0, 3.0]
    for r in ranks:
        # the state transfer posts every tensor at once (isend), also refused before it leaves
        assert "isend of a host tensor on a group the transport did not create as gloo" in r["state_on_world"]
        assert "isend of a host tensor on a group the transport did not create as gloo" in r["world"]
        assert r["agreed"] == [{"ok": True, "rank": 0}, {"ok": False, "rank": 1}]
    assert "recv:host:cpu" in ranks[1]["routes"] and "send:host:cpu" in ranks[0]["routes"]
    assert "isend:foreign:cpu" in ranks[0]["routes"]
