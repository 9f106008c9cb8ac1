"""Issue 30 item 5: ds-swift's op timeout applies only around its own calls. A long rank-0 collective
before the engine exists (a dataset index build) is the job's business, under the job's timeout."""

from __future__ import annotations

from pathlib import Path

from ds_swift.testing.procs import ProcessSet, free_port, worker_env

WORKER = Path(__file__).parent / "workers" / "long_rank0_collective.py"


def test_a_long_rank0_collective_before_the_engine_is_no_failure(tmp_path: Path, warm_deepspeed: None) -> None:
    port = str(free_port())
    with ProcessSet(tmp_path) as procs:
        for rank in range(2):
            env = worker_env(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "SWIFT_OP_TIMEOUT_S": "1",
                }
            )
            procs.spawn_python(f"rank{rank}", [str(WORKER)], env=env)
        codes = procs.wait_all(180.0, fail_fast=True)
        assert codes == {"rank0": 0, "rank1": 0}, procs.logs_tail()
        assert "rank 1: waited past the op timeout" in procs.log("rank1")
