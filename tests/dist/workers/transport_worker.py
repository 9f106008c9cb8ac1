"""One rank of tests/dist/test_transport_strict.py: ds-swift's transport between real processes on gloo.

Writes ``rank<N>.json`` into the folder given as its argument: what it received on the
transport's group, what strict mode said about the same host tensors sent over the world group
(once through the transport, once through the state transfer of a recovery), and an agreement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.recovery.state.transfer import send_state
from ds_swift.testing.ranks import gloo_rank


def main(out_dir: str) -> None:
    result: dict[str, Any] = {}
    with gloo_rank(timeout_s=60) as rank:
        t = transport.current()
        result["strict"] = transport.strict_enabled()
        peer = 1 - rank
        if rank == 0:  # a host tensor on the transport's own gloo group: delivered
            t.send(torch.arange(4, dtype=torch.float32), peer)
        else:
            got = torch.zeros(4)
            t.recv(got, peer)
            result["received"] = got.tolist()
        for what, call in (
            ("world", lambda: t.isend(torch.ones(1), peer, group=dist.group.WORLD)),
            ("state_on_world", lambda: send_state({"w": torch.ones(3)}, peer, group=dist.group.WORLD)),
        ):
            try:
                call()  # isend: never waited for, so a mode that let it through fails the test, not hangs it
                result[what] = "sent"
            except transport.StrictTransportError as exc:
                result[what] = str(exc)
        result["agreed"] = t.all_gather_json({"rank": rank, "ok": rank == 0})
        result["routes"] = sorted({f"{c.op}:{c.channel}:{c.device}" for c in t.calls})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
