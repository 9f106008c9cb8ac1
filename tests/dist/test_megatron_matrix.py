"""The Megatron-DeepSpeed fault matrix's CI subset (benchmarks/megatron_matrix.py CI_CASES): the real
pretrain_gpt.py of the pinned commit, patched, under ds-swift-launch, one machine killed, bitwise
against the failure-free run. Issue 52's case is the first: a reload of the initial state (a kill
before the first global checkpoint) that used to retrain on another initial state.

Needs a checkout of deepspeedai/Megatron-DeepSpeed at the series' commit in ``$MEGATRON_DEEPSPEED``
and its deps (``pip install regex nltk pybind11``); skipped without. About 6 minutes on 2 cores.
The rest of the matrix: ``python benchmarks/megatron_matrix.py CHECKOUT``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = os.environ.get("MEGATRON_DEEPSPEED", "")

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(3000),
    pytest.mark.skipif(
        not (CHECKOUT and (Path(CHECKOUT) / "pretrain_gpt.py").is_file()),
        reason="set MEGATRON_DEEPSPEED to a deepspeedai/Megatron-DeepSpeed checkout at the series' commit",
    ),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("regex", "nltk", "pybind11")),
        reason="Megatron-DeepSpeed's deps: pip install regex nltk pybind11",
    ),
]


def test_the_ci_cases_end_bitwise(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from megatron_matrix import CI_CASES, main
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    with redirect_stdout(out):
        code = main([CHECKOUT, "--cases", ",".join(CI_CASES), "--work", str(tmp_path), "--json", "--timeout", "1200"])
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    rows = {r["case"]: r for r in result["cases"]}
    assert set(rows) == set(CI_CASES), out.getvalue()[-3000:]
    assert code == 0 and result["failed"] == 0, out.getvalue()[-3000:]
    (first,) = tmp_path.glob("*-pp2dp2-bf16-checkpoint-first")
    assert "reload of the initial state" in (first / "kill" / "log").read_text()
