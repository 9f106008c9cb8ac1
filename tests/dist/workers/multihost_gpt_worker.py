"""gpt_fault_worker.py with a stall on several ranks (tests/dist/test_multihost_gpt.py).

``SWIFT_TEST_STALL_RANKS="R1,R2:I"``: each listed rank stalls at the start of iteration I's
ReduceGrads (gpt_fault_worker's ``SWIFT_TEST_STALL`` for that rank), so a whole machine stops
before any of its ranks steps I, and the test kills it there: nobody has stepped I, and the
recovery needs no undo (the result must be bitwise equal to the failure-free run).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

FAULT_WORKER = Path(__file__).with_name("gpt_fault_worker.py")

spec = os.environ.get("SWIFT_TEST_STALL_RANKS", "")
if spec:
    ranks, _, iteration = spec.partition(":")
    if os.environ.get("RANK") in ranks.split(","):
        os.environ["SWIFT_TEST_STALL"] = f"rank={os.environ['RANK']},iteration={iteration}"
sys.argv[0] = str(FAULT_WORKER)
runpy.run_path(str(FAULT_WORKER), run_name="__main__")
