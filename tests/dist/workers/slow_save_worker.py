"""examples/pretrain_gpt.py where rank 1's checkpoint writes are slow (a loaded shared filesystem):
its first DeepSpeed save takes ``SLOW_SAVE_S`` seconds longer, longer than the op timeout."""

from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

from deepspeed.runtime.engine import DeepSpeedEngine

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        save = DeepSpeedEngine.save_checkpoint
        slowed: list[bool] = []

        def slow_save(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not slowed:
                slowed.append(True)
                time.sleep(float(os.environ["SLOW_SAVE_S"]))  # the slow filesystem this test stands for
            return save(self, *args, **kwargs)

        DeepSpeedEngine.save_checkpoint = slow_save  # type: ignore[method-assign]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
