"""Bit-for-bit comparison of model and optimizer states (DeepSpeed checkpoint tags, state dicts).

"Recovered without loss" means bitwise equal to a run without failure, so the comparison is on
bytes, not values: ``-0.0 == 0.0`` and ``NaN != NaN`` would hide or invent differences.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LAYER_FILES",
    "Baseline",
    "CheckpointDiff",
    "CheckpointError",
    "checkpoint_tensors",
    "compare_checkpoints",
    "compare_tensors",
    "relative_distance",
    "tensors_of",
    "ulp_distance",
    "undo_ulp",
]


class CheckpointError(RuntimeError):
    """A checkpoint tag cannot be read (no files in it)."""


@dataclass
class CheckpointDiff:
    """Tensor-by-tensor comparison of two states."""

    tensors: int
    """Tensors present in both."""
    differing: list[tuple[str, float]] = field(default_factory=list)
    """(name, largest absolute difference) of tensors whose bits differ."""
    only_in_one: list[str] = field(default_factory=list)
    max_ulp: float = 0.0
    """The largest distance in units in the last place between two floating-point elements (0 when
    bitwise equal; ``inf`` where dtypes or shapes differ)."""

    @property
    def bitwise_equal(self) -> bool:
        return self.tensors > 0 and not self.differing and not self.only_in_one

    @property
    def max_gap(self) -> float:
        """The largest absolute difference of any element (0.0 when bitwise equal)."""
        return max((gap for _, gap in self.differing), default=0.0)

    def describe(self) -> str:
        """One line for an assertion message."""
        if self.bitwise_equal:
            return f"bitwise equal ({self.tensors} tensors)"
        if self.tensors == 0:
            return "no tensor in common"
        return (
            f"{len(self.differing)} of {self.tensors} tensors differ (largest difference {self.max_gap:.3g}), "
            f"e.g. {[name for name, _ in self.differing[:3]]}; only in one: {self.only_in_one[:5]}"
        )


#: the step counters a checkpoint holds as numbers: compared as tensors, like the state
_COUNTERS = ("global_steps", "skipped_steps")


def tensors_of(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in a nest of dicts, lists and tuples, by its path (``file.pt/module/lin.weight``);
    also the step counters (``global_steps``, ``skipped_steps``) and a loss scaler's state (fp16:
    ``.../loss_scaler``), which DeepSpeed keeps as numbers and objects, as tensors, so that a run
    that ends on another loss scale or step count is not called bitwise equal."""
    import torch

    from ds_swift.recovery.state.digest import loss_scale_tensor

    out: dict[str, Any] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif hasattr(x, "cur_scale") and hasattr(x, "cur_iter"):  # DeepSpeed's (Dynamic)LossScaler
            out[path] = loss_scale_tensor(vars(x))  # what a state digest checks of it
        elif isinstance(x, dict):
            for k, v in x.items():
                if k in _COUNTERS and isinstance(v, int) and not isinstance(v, bool):
                    out[f"{path}/{k}"] = torch.tensor(v, dtype=torch.int64)
                    continue
                walk(v, f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(obj, prefix)
    return out


def checkpoint_tensors(tag_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of one checkpoint tag directory (layer files, model and optimizer states)."""
    import torch

    files = sorted(Path(tag_dir).glob("*.pt"))
    if not files:
        raise CheckpointError(f"no checkpoint files (*.pt) in {tag_dir}")
    out: dict[str, Any] = {}
    for f in files:
        # A test's own job wrote these DeepSpeed files (with pickled enums and namespaces that
        # weights_only=True refuses); DeepSpeed's own load reads them the same way.
        out.update(tensors_of(torch.load(f, map_location="cpu", weights_only=False), f.name))
    return out


def compare_tensors(a: Mapping[str, Any], b: Mapping[str, Any]) -> CheckpointDiff:
    """Compare two name -> tensor maps bit for bit (dtype, shape and every element)."""
    import torch

    diff = CheckpointDiff(tensors=len(a.keys() & b.keys()), only_in_one=sorted(a.keys() ^ b.keys()))

    def bits(t: Any) -> Any:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)):
            continue
        gap = (
            float((x.detach().double() - y.detach().double()).abs().max())
            if x.shape == y.shape and x.numel()
            else float("inf")
        )
        diff.differing.append((name, gap))
        diff.max_ulp = max(diff.max_ulp, ulp_distance(x, y))
    return diff


#: floating dtype -> the integer dtype of its bits
_BITS = {"torch.float64": "int64", "torch.float32": "int32", "torch.bfloat16": "int16", "torch.float16": "int16"}


def ulp_distance(x: Any, y: Any) -> float:
    """Largest number of representable values between elements of ``x`` and ``y`` (same dtype and
    shape; ``inf`` otherwise, or for non-float tensors that differ)."""
    import torch

    if x.dtype != y.dtype or x.shape != y.shape or str(x.dtype) not in _BITS:
        return float("inf")
    if not x.numel():
        return 0.0
    int_t = getattr(torch, _BITS[str(x.dtype)])
    sign = torch.iinfo(int_t).bits - 1

    def ordered(t: Any) -> Any:
        # Floats' bit patterns as integers in the floats' own order (negatives mirrored below 0).
        b = t.detach().contiguous().view(int_t).to(torch.int64)
        return torch.where(b < 0, -(b & ((1 << sign) - 1)), b)

    return float((ordered(x) - ordered(y)).abs().max())


#: DeepSpeed pipeline checkpoints' layer files: the module parameters (``layer_03-model_00-model_states.pt/...``)
LAYER_FILES = r"layer_\d+-model_\d+-model_states\.pt/"


def relative_distance(a: Mapping[str, Any], b: Mapping[str, Any], pattern: str = LAYER_FILES) -> float | None:
    """``||b - a|| / ||a||`` (L2, in float64) over the floating tensors both hold whose names match
    ``pattern`` (by default the module parameters); None where none matches. How far an
    approximate recovery left the model from the failure-free run's."""
    import re

    names = [n for n in sorted(a.keys() & b.keys()) if re.search(pattern, n) and a[n].is_floating_point()]
    if not names:
        return None
    num = sum(float((b[n].double() - a[n].double()).pow(2).sum()) for n in names)
    den = sum(float(a[n].double().pow(2).sum()) for n in names)
    return (num / den) ** 0.5 if den else None


def compare_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> CheckpointDiff:
    """Compare two checkpoint tag directories bit for bit."""
    return compare_tensors(checkpoint_tensors(a), checkpoint_tensors(b))


@dataclass
class Baseline:
    """A failure-free run's final state and its checkpoint directory (a checkpoint every iteration)."""

    final: dict[str, Any]
    ckpt_dir: Path

    def at(self, iterations_done: int) -> dict[str, Any]:
        """The failure-free state after ``iterations_done`` iterations."""
        return checkpoint_tensors(self.ckpt_dir / f"global_step{iterations_done}")


def undo_ulp(baseline: Baseline, recovered: str | os.PathLike[str], consensus: int) -> float:
    """Worst restoration error of a recovered state (a tag directory) against the failure-free one at
    the consensus, in the update-undo measure (ulp of each tensor's largest magnitude before/after the
    undone step). Raises AssertionError where the tensors differ in name or in an integer value."""
    import torch

    from ds_swift.undo.numerics import ulp_error

    got, before, after = checkpoint_tensors(recovered), baseline.at(consensus + 1), baseline.at(consensus + 2)
    if set(got) != set(before):
        raise AssertionError(f"tensors differ: {sorted(set(got) ^ set(before))[:5]}")
    worst = 0.0
    for k, ref in before.items():
        if ref.is_floating_point():
            worst = max(worst, ulp_error(got[k], ref, after[k]))
        elif not torch.equal(got[k], ref):
            raise AssertionError(f"{k}: integer tensor differs")
    return worst
