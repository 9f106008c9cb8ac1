"""examples/pretrain_gpt.py with one GPU per rank when ds-swift-launch simulates several machines
on one host (each machine's local ranks count from 0): rank r trains on GPU r mod the GPU count.

``SWIFT_TEST_GPU_DIE_CREATING=1``: a replacement joining generation 1 SIGKILLs itself right after
its world's communicator starts being created (eager, non-blocking): a peer lost while a generation
creates its communicators.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"


def _die_after_init() -> None:
    real = dist.init_process_group

    def init_then_die(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        print("[test] this replacement dies while its world's communicator is created", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    dist.init_process_group = init_then_die


if __name__ == "__main__":
    local = str(int(os.environ.get("RANK", "0")) % torch.cuda.device_count())
    os.environ["LOCAL_RANK"] = local
    sys.argv = [f"--local_rank={local}" if a.startswith("--local_rank") else a for a in sys.argv]
    if (
        os.environ.get("SWIFT_TEST_GPU_DIE_CREATING") == "1"
        and os.environ.get("SWIFT_REPLACEMENT") == "1"
        and os.environ.get("SWIFT_GENERATION") == "1"
    ):
        _die_after_init()
    runpy.run_path(str(EXAMPLE), run_name="__main__")
