"""examples/pretrain_gpt.py with one update record never stored (test helper, strategy tranlogs).

``SWIFT_TEST_HOLD_RECORD="ranks=R[+R...],iteration=I"``: in generation 0, the update-log writer of
each rank R blocks on its record of iteration I until the rank is killed, so the record is never
stored. A rank lost in iteration I + 1's forward or backward passes (its step, which waits for the
record, never comes) then lacks the record of I that every survivor stepped: the race
ds_swift/runtime/update_logging.py describes, made certain.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from pathlib import Path
from typing import Any

from ds_swift.runtime.update_logging import UpdateLogger

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"


def hold(ranks: set[int], iteration: int) -> None:
    """Make the writer of ``ranks`` block forever on the record of ``iteration``."""
    write, never = UpdateLogger._do, threading.Event()

    def held(self: UpdateLogger, item: tuple[str, Any]) -> None:
        kind, arg = item
        if kind == "record" and self.rank in ranks and arg.iteration == iteration:
            print(
                f"[test] rank {self.rank}: holding the update record of iteration {iteration}",
                file=sys.stderr,
                flush=True,
            )
            never.wait()
        write(self, item)

    UpdateLogger._do = held  # type: ignore[method-assign]


def main() -> None:
    spec = dict(kv.split("=", 1) for kv in os.environ.get("SWIFT_TEST_HOLD_RECORD", "").split(",") if kv)
    if spec and os.environ.get("SWIFT_REPLACEMENT") != "1":
        hold({int(r) for r in spec["ranks"].split("+")}, int(spec["iteration"]))
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
