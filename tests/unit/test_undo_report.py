"""Error report of update-undo per optimizer (printed; the numbers go in the issue note).

For each optimizer family and dtype, over a fixed set of seeds and 2-4 steps of
stationary random gradients on 4096-element tensors, with and without refinement:
* ulp: max error in units of the last place of the tensor's largest magnitude (the larger
  of before/after the step); "pre" the same against the pre-step magnitude only;
* rel: max and median elementwise relative error |restored - original| / |original|
  (large where an element had cancelled to nearly nothing before the step);
* exact: fraction of elements restored bit for bit.
Run with ``-s`` to see the table; it is also printed when the assertion fails.
"""

from __future__ import annotations

import pytest
import test_undo_helpers as helpers
import torch
from test_undo_helpers import Case, run_case, tolerance

CONFIGS: dict[str, tuple[str, dict]] = {
    "SGD": ("sgd", {"lr": 0.1}),
    "SGD momentum+wd": ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}),
    "SGD nesterov (foreach)": ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}),
    "Adam wd": ("adam", {"lr": 1e-3, "weight_decay": 1e-2}),
    "AdamW": ("adamw", {"lr": 1e-3, "weight_decay": 1e-2}),
    "AdamW fused": ("adamw", {"lr": 1e-3, "weight_decay": 1e-2, "fused": True}),
    "Adagrad wd": ("adagrad", {"lr": 1e-2, "weight_decay": 1e-2}),
    "RMSprop": ("rmsprop", {"lr": 1e-3}),
    "RMSprop centered+momentum+wd": ("rmsprop", {"lr": 1e-3, "centered": True, "momentum": 0.9, "weight_decay": 1e-2}),
    "Lamb wd": ("lamb", {"lr": 1e-3, "weight_decay": 1e-2}),
}


def _sweep(refine: bool, dtype: torch.dtype) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for name, (family, kwargs) in CONFIGS.items():
        for seed in range(3):
            case = Case(family=family, kwargs=kwargs, dtype=dtype, steps=2 + seed, seed=seed)
            for kind, ulps, rel, _excluded, strict in run_case(case, refine=refine, check_bitwise=False).rows:
                acc = out.setdefault((name, kind), [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, tolerance(case, kind)])
                finite = rel[torch.isfinite(rel)]
                acc[0] = max(acc[0], ulps)
                acc[1] = max(acc[1], strict)
                acc[2] = max(acc[2], float(finite.max()) if finite.numel() else 0.0)
                acc[3] = max(acc[3], float(finite.median()) if finite.numel() else 0.0)
                acc[4] += float((rel == 0).double().sum())
                acc[5] += rel.numel()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_undo_error_report(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(helpers, "SHAPES", [(4096,), (64, 16), (3,)])
    refined = _sweep(True, dtype)
    plain = _sweep(False, dtype)
    lines = [
        f"update-undo error report ({str(dtype).removeprefix('torch.')}; refined | float64 formula only)",
        f"{'optimizer':<30}{'tensor':<16}{'ulp':>6}{'pre':>6}{'rel max':>10}{'rel med':>10}{'exact':>7}"
        f" |{'ulp':>6}{'rel max':>10}{'exact':>7}",
    ]
    for (name, kind), r in refined.items():
        p = plain[(name, kind)]
        lines.append(
            f"{name:<30}{kind:<16}{r[0]:>6.2f}{r[1]:>6.2f}{r[2]:>10.2e}{r[3]:>10.1e}{r[4] / r[5]:>7.1%}"
            f" |{p[0]:>6.2f}{p[2]:>10.2e}{p[4] / p[5]:>7.1%}"
        )
    table = "\n".join(lines)
    with capsys.disabled():
        print("\n" + table)
    assert all(r[0] <= r[6] for r in refined.values()), table
    # On parameters (a pure function of x0 once the post-step state is known) refinement
    # restores at least as many elements exactly as the float64 formula alone.
    assert all(refined[k][4] >= plain[k][4] for k in refined if k[1] == "param"), table
