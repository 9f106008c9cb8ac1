"""Worker of test_long_collective.py: a rank-0-only piece of work (a dataset index build) longer than
ds-swift's op timeout, between ``ds_swift.init_distributed`` and the engine, that the other ranks wait
for in a collective on the world and on a group created afterwards (as Megatron's are)."""

from __future__ import annotations

import sys
import time

import torch.distributed as dist

import ds_swift

OP_TIMEOUT_S = 1.0  # SWIFT_OP_TIMEOUT_S in the test; the work below takes 4 of them

ctx = ds_swift.init_distributed({"train_micro_batch_size_per_gpu": 1, "swift": {"enabled": True}})
assert ctx is not None and ctx.op_timeout_s == OP_TIMEOUT_S, ctx
group = dist.new_group([0, 1])
if dist.get_rank() == 0:
    time.sleep(4 * OP_TIMEOUT_S)  # the index build: work, not a synchronisation
dist.barrier()
dist.barrier(group=group)
print(f"rank {dist.get_rank()}: waited past the op timeout", file=sys.stderr, flush=True)
dist.destroy_process_group()
