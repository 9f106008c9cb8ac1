"""One torchft replica group (one process, CPU, gloo) of the side-by-side in ``compare.py``.

torchft 0.2.0 as shipped, with one workaround: its ``DistributedDataParallel`` comm hook asserts that
the manager's allreduce returned a managed future (``assert fut._fut``); after a peer's SIGKILL the
manager has recorded the error and returns a completed dummy work instead, and the unmodified hook's
assert ends the survivor. :class:`SurvivingDDP` returns that dummy's (completed) future instead: the
manager then refuses to commit the step (``should_commit`` false), and the next quorum goes on
without the dead replica, as torchft intends.

Each step writes one JSON line to ``--out``: time, step, participants, committed; what ``compare.py``
reads to find the first step the restarted replica contributes to.
"""

# No ``from __future__ import annotations``: DDP checks that the comm hook's ``bucket`` annotation *is*
# dist.GradBucket, and a postponed annotation is a string.
import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="the lighthouse's address (http://host:port)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True, help="append one JSON line per step here")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    return p.parse_args(argv)


def surviving_ddp() -> Any:
    from torchft.ddp import DistributedDataParallel

    class SurvivingDDP(DistributedDataParallel):  # type: ignore[misc]
        """torchft's DDP whose comm hook survives an allreduce that failed (see the module's docstring)."""

        @staticmethod
        def _comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", None)
            if inner is None:  # the manager's dummy after an error: not committed, the quorum moves on
                done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done
            return inner

    return SurvivingDDP


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from torchft import Manager, ProcessGroupGloo

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=10),
    )
    ddp = surviving_ddp()(manager, model)
    g = torch.Generator().manual_seed(args.replica)
    with open(args.out, "a") as out:
        while manager.current_step() < args.steps:
            x = torch.randn(args.batch, args.hidden, generator=g)
            # torchft's OptimizerWrapper, written out to see whether the step was committed
            manager.start_quorum()
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            committed = manager.should_commit()
            if committed:
                opt.step()
            out.write(
                json.dumps(
                    {
                        "t": time.time(),
                        "replica": args.replica,
                        "pid": os.getpid(),
                        "step": manager.current_step(),
                        "participants": manager.num_participants(),
                        "committed": bool(committed),
                    }
                )
                + "\n"
            )
            out.flush()
    manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
