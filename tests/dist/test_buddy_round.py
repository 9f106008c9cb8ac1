"""A buddy copier's round ends only once every rank's copy of the step is held.

4 real gloo ranks in a ring (rank r's copy goes to rank r+1). Rank 3 hands its copy over late:
until then rank 1, whose own copy went out at once, must still be waiting (its next backward pass
would otherwise lose the undo that a failure of rank 3 needs, ds_swift.runtime.buddy). When rank 3's
copy leaves, every round completes and every rank holds its owner's copy, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4


def test_a_round_waits_for_every_ranks_copy(tmp_path: Path, warm_deepspeed: None) -> None:
    from ds_swift.testing.ranks import run_ranks

    run_ranks(WORLD, [__file__, str(tmp_path)], tmp_path / "logs", timeout_s=120)
    assert sorted(p.name for p in tmp_path.glob("held-*")) == [f"held-{r}" for r in range(WORLD)]


def _rank_main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from ds_swift.recovery.replication import encode
    from ds_swift.runtime.buddy import BuddyHoldings, _Worker
    from ds_swift.testing.ranks import gloo_rank

    with gloo_rank(60) as rank:
        owner = (rank - 1) % WORLD
        worker = _Worker(dist.new_group(backend="gloo"), ((rank + 1) % WORLD,), (owner,), BuddyHoldings(), print)

        def hand_over() -> None:
            manifest, tensors = encode({"x": torch.arange(1000, dtype=torch.float32) + rank})
            worker.sent.clear()
            worker.queue.put((0, manifest, [t.reshape(-1) for t in tensors]))

        if rank != 3:
            hand_over()
        if rank == 1:
            # Its own copy goes to rank 2, which receives at once; rank 3's copy to rank 0 is not sent.
            assert not worker.sent.wait(2.0), "the round counted as complete before rank 3's copy was held"
        dist.broadcast(torch.zeros(1), src=1)  # rank 3 hands over only after rank 1's check
        if rank == 3:
            hand_over()
        assert worker.sent.wait(60.0) and worker.error is None, worker.error
        held = worker.holdings.state_of(owner, 0)["x"]
        assert torch.equal(held, torch.arange(1000, dtype=torch.float32) + owner)
        (out / f"held-{rank}").write_text("ok")
        worker.queue.put(None)
        worker.thread.join(30.0)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
