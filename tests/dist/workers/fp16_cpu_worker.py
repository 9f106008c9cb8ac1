"""examples/pretrain_gpt.py with fp16 allowed on DeepSpeed's CPU accelerator (ds_swift.patches.cpu_fp16)."""

from __future__ import annotations

import runpy
from pathlib import Path

from ds_swift.patches.cpu_fp16 import allow_cpu_fp16

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"

if __name__ == "__main__":
    with allow_cpu_fp16():
        runpy.run_path(str(EXAMPLE), run_name="__main__")
