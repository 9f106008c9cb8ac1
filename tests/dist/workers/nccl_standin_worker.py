"""examples/pretrain_gpt.py on a gloo world given NCCL's semantics (ds_swift.testing.nccl_standin).

A collective whose peer is lost returns as if it completed, leaving a partial buffer; the device is
stuck until ds-swift's abort; later calls then raise, as on an NCCL world. ``SWIFT_TEST_CPU_FP16=1``:
fp16 allowed on DeepSpeed's CPU accelerator too (ds_swift.patches.cpu_fp16).
"""

from __future__ import annotations

import contextlib
import os
import runpy
from pathlib import Path

from ds_swift.patches.cpu_fp16 import allow_cpu_fp16
from ds_swift.testing.nccl_standin import install

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"

if __name__ == "__main__":
    install()  # before DeepSpeed makes its comm backend: it keeps some torch.distributed functions
    fp16 = allow_cpu_fp16() if os.environ.get("SWIFT_TEST_CPU_FP16") == "1" else contextlib.nullcontext()
    with fp16:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
