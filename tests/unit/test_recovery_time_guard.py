"""The recovery-time regression guard (issue 50 item 5): ``benchmarks/recovery_time.py`` prints each
run's phases and their medians, and with ``--budget-s`` exits 1 naming the variant whose median kill
-> back is over. A benchmark-side check, not a test: tests hold no timed assertion (the brief), so
the budget is checked where the machine is measured; here only the arithmetic on given timelines."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def bench() -> Any:
    spec = importlib.util.spec_from_file_location("recovery_time", ROOT / "benchmarks" / "recovery_time.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(total: float, teardown: float) -> dict[str, Any]:
    return {
        "strategy": "buddy",
        "expected_strategy": "buddy",
        "reason": "",
        "initialization_s": total - 0.2,
        "recovery_s": 0.2,
        "total_s": total,
        "phases": {"detect": 0.2, "teardown": teardown, "rebuild": total - 0.4 - teardown, "catch_up": 0.2},
    }


def test_medians_per_phase_and_the_budget() -> None:
    rt = bench()
    result = rt.summarize({"buddy": [run(1.0, 0.1), run(3.0, 0.5), run(1.2, 0.2)]}, interval=8)
    assert result["buddy"]["total_s"] == 1.2
    assert result["buddy"]["phases"]["teardown"] == 0.2
    assert list(result["buddy"]["phases"]) == ["detect", "teardown", "rebuild", "catch_up"]
    assert rt.over_budget(result, ["buddy"], None) == []
    assert rt.over_budget(result, ["buddy"], 1.5) == []
    (line,) = rt.over_budget(result, ["buddy"], 1.0)
    assert line.startswith("buddy: median kill -> back 1.20 s > 1 s") and "teardown 0.20" in line
