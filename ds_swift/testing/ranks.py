"""N ranks of one gloo job as real processes, for tests and benchmarks.

The parent side, :func:`run_ranks`, starts every rank of a script with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and a free MASTER_PORT set, waits with one deadline, and stops at the
first rank that fails, killing the others (they would sit in a collective with the dead one until
the deadline). The worker side, :func:`gloo_rank`, joins the group and always leaves it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from ds_swift.testing.procs import ProcessSet, free_port, worker_env

__all__ = ["RanksFailed", "gloo_rank", "rank_env", "run_ranks"]


class RanksFailed(RuntimeError):
    """A rank exited with a non-zero code; the message holds every rank's code and last output."""


def rank_env(rank: int, world: int, port: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank of a single-machine job (``torch.distributed``'s env:// init)."""
    return worker_env(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **(extra or {}),
        }
    )


def run_ranks(
    world: int,
    args: Sequence[str],
    log_dir: str | os.PathLike[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run ``python *args`` as ranks 0..world-1 and wait for all of them to exit 0.

    Args:
        world: number of ranks.
        args: the script and its arguments, the same for every rank.
        log_dir: one ``rank<N>.log`` per rank (stdout and stderr) goes here.
        timeout_s: deadline for the whole job; past it every rank is killed and TimeoutError raised.
        env: extra environment for every rank.

    Raises:
        RanksFailed: a rank exited non-zero (every other rank is killed at once).
    """
    port = free_port()
    with ProcessSet(log_dir) as procs:
        for rank in range(world):
            procs.spawn_python(f"rank{rank}", args, env=rank_env(rank, world, port, env))
        codes = procs.wait_all(timeout_s, fail_fast=True)
        if any(codes.values()):
            raise RanksFailed(f"ranks exited with {codes}\n{procs.logs_tail()}")


@contextmanager
def gloo_rank(timeout_s: float | None = None) -> Iterator[int]:
    """Join the job's gloo group through DeepSpeed (so ``deepspeed.initialize`` works) and open
    ds-swift's transport on it; yields the rank.

    On success every rank meets in a barrier before leaving, so none tears its side of the group
    down while a peer still talks to it; on failure it leaves at once (its peers are killed by
    :func:`run_ranks`). The process group is destroyed either way.
    """
    import datetime

    import deepspeed
    import torch.distributed as dist

    from ds_swift import transport
    from ds_swift.patches.megatron_import import import_deepspeed_muon

    import_deepspeed_muon()  # on CPU without torch._inductor: ~1.3 CPU-s less per rank (a ZeRO engine imports it)
    if timeout_s is None:
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        transport.open_generation(timeout_s)  # as ds_swift.init_distributed: before the engine's groups
        yield dist.get_rank()
        transport.barrier()
    finally:
        transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()
