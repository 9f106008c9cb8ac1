"""CPU time of a job's process tree, per role and per thread, read from ``/proc`` (Linux).

On a CPU job the protections' background threads compete with the training ranks for the same
cores, so what a protection costs shows first as CPU time: per iteration, per thread name, summed
over the ranks. ds-swift's threads carry OS names (ds_swift.threadname: ``sw-buddy``,
``sw-log-writer``, ...); a worker's main thread is ``main``; its other unnamed threads (gloo's,
torch's) are ``other``. Processes are grouped by role: ``ranks`` (workers, by their ``RANK``), and
``launcher`` for everything else in the tree (the launcher, its agents, the job store they serve).

A :class:`CpuSample` is taken while the job runs (benchmarks: when its loss log reaches an
iteration); the difference of two, divided by the iterations between them, is the cost per
iteration (:func:`per_iteration`). The clock is the kernel's (10 ms ticks per thread): read it over
tens of iterations.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CpuSample", "per_iteration", "sample_tree"]

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass
class CpuSample:
    """CPU seconds so far of each (role, thread name) of a process tree."""

    seconds: dict[tuple[str, str], float] = field(default_factory=dict)

    def total(self, role: str | None = None) -> float:
        return sum(v for (r, _), v in self.seconds.items() if role is None or r == role)


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a ``stat`` file; None if it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    open_, close = text.find("("), text.rfind(")")
    return text[open_ + 1 : close], text[close + 2 :].split()


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for p in _PROC.iterdir():
        if not p.name.isdigit():
            continue
        got = _stat_fields(p / "stat")
        if got is not None:
            out[int(got[1][1])].append(int(p.name))  # field 4: the parent's pid
    return out


def _tree(root: int) -> list[int]:
    children, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _role(pid: int) -> str:
    try:
        env = (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return "launcher"
    # A worker has RANK and its training script; an agent may carry RANK-like variables too.
    ranked = any(e.startswith(b"RANK=") for e in env) and any(e.startswith(b"LOCAL_RANK=") for e in env)
    return "ranks" if ranked else "launcher"


def sample_tree(root: int) -> CpuSample:
    """CPU seconds of every thread of ``root`` and its descendants, by (role, thread name)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for pid in _tree(root):
        role = _role(pid)
        try:
            tids = [int(t.name) for t in (_PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            got = _stat_fields(_PROC / str(pid) / "task" / str(tid) / "stat")
            if got is None:
                continue
            comm, rest = got
            name = "main" if tid == pid else (comm if comm.startswith("sw-") else "other")
            # utime and stime: fields 14 and 15 of stat, 12th and 13th after the comm
            out[(role, _generic(name))] += (int(rest[11]) + int(rest[12])) * _TICK_S
    return CpuSample(dict(out))


def _generic(name: str) -> str:
    """A thread name without its rank suffix (``sw-digest-3`` -> ``sw-digest``): summed over ranks."""
    head, _, tail = name.rpartition("-")
    return head if head and tail.isdigit() else name


def per_iteration(a: CpuSample, b: CpuSample, iterations: int) -> dict[tuple[str, str], float]:
    """CPU seconds per iteration of each (role, thread name) between samples ``a`` and ``b``."""
    n = max(1, iterations)
    return {k: (v - a.seconds.get(k, 0.0)) / n for k, v in b.seconds.items() if v - a.seconds.get(k, 0.0) > 0}
