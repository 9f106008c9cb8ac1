"""examples/pretrain_gpt.py with faults placed more precisely than ``--inject`` can (test helper).

In generation 0 only (replacements never fault):

- ``SWIFT_TEST_STALL="rank=R,iteration=I"``: rank R stops at the start of iteration I's
  ReduceGrads (before its gradient all-reduce) until its agent kills it;
- ``SWIFT_TEST_KILL_AFTER_STEP="rank=R,iteration=I"``: rank R SIGKILLs itself right after its
  optimizer step of iteration I.

And after every recovery, with ``SWIFT_TEST_DUMP_DIR=DIR``, every rank saves the state it resumes
from as a DeepSpeed checkpoint ``DIR/recovered_gen<g>`` (what an undo left, before any further
training amplifies its rounding).

Together (R=2 stalls, R=3 dies after its step, both on machine 1) they make the update-undo case
deterministic: rank 3's replica (rank 1) completed the step's collectives with rank 3 and stepped
iteration I, rank 2's replica (rank 0) never got rank 2's gradients and did not. ``--inject``
kills the first rank of a machine to reach a phase, and its agent kills the rest some 50-100 ms
later: whether the second rank finished its all-reduce by then is a race.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

import ds_swift.engine as swift_engine
from ds_swift.patches.instructions import hook_instructions, schedule

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"


def _spec(name: str) -> dict[str, int]:
    text = os.environ.get(name, "")
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main() -> None:
    stall, kill = _spec("SWIFT_TEST_STALL"), _spec("SWIFT_TEST_KILL_AFTER_STEP")
    rank = int(os.environ["RANK"])
    original = swift_engine.SwiftPipelineEngine._install

    def install(self: Any, engine: Any) -> None:
        original(self, engine)
        if os.environ.get("SWIFT_REPLACEMENT") == "1" or self.generation != 0:
            return
        hooks = {}
        if stall and stall["rank"] == rank:

            def stall_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
                if int(eng.global_steps) == stall["iteration"]:
                    print(f"[test] rank {rank}: stalling before ReduceGrads of iteration {stall['iteration']}",
                          file=sys.stderr, flush=True)
                    time.sleep(300)
                return call_next(**kw)

            hooks[schedule.ReduceGrads] = stall_hook
        if kill and kill["rank"] == rank:

            def kill_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
                iteration = int(eng.global_steps)
                result = call_next(**kw)
                if iteration == kill["iteration"]:
                    print(f"[test] rank {rank}: SIGKILL after the step of iteration {iteration}",
                          file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return result

            hooks[schedule.OptimizerStep] = kill_hook
        if hooks:
            self._handles.append(hook_instructions(engine, "test.faults", hooks))

    swift_engine.SwiftPipelineEngine._install = install  # type: ignore[method-assign]
    dump_dir = os.environ.get("SWIFT_TEST_DUMP_DIR")
    if dump_dir:
        rejoin = swift_engine.SwiftPipelineEngine._rejoin

        def rejoin_and_dump(self: Any, *args: Any, **kwargs: Any) -> None:
            rejoin(self, *args, **kwargs)
            self.engine.save_checkpoint(dump_dir, tag=f"recovered_gen{self.generation}")

        swift_engine.SwiftPipelineEngine._rejoin = rejoin_and_dump  # type: ignore[method-assign]
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
