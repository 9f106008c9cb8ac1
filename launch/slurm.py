"""SLURM: ``srun ds-swift-launch ...`` makes each task one node agent.

The allocation says everything the agents must agree on: the node rank (``SLURM_NODEID``), the
node count (``SLURM_NNODES``), the hosts (``SLURM_JOB_NODELIST``, compressed as
``node[01-03,07],gpu5``), the job (``SLURM_JOB_ID``, ``SLURM_STEP_ID``). The first host is the
master address; nodes beyond ``--nnodes`` are the spares.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .hostfile import HostfileError, check_host

__all__ = ["SlurmStep", "expand_nodelist", "in_slurm_step"]


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in node list {whole!r}")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in node list {whole!r}")
        width = len(lo)  # node[01-10] keeps the zero padding of its first bound
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(text: str) -> list[str]:
    """``node[01-03,07],gpu5`` -> ``[node01, node02, node03, node07, gpu5]``, in SLURM's order.

    Several bracket groups in one name expand as their product (``r[1-2]n[1-2]`` -> r1n1, r1n2,
    r2n1, r2n2), as ``scontrol show hostnames`` does.
    """
    hosts: list[str] = []
    for term in _split_top(text):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", term):
            if not literal and not body:
                continue
            suffixes = _expand_range(body, text) if body else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    return hosts


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True in a task that ``srun`` started, not in the batch script itself: only srun sets the
    step's node list, and a launcher in the batch script is one process, not one per node."""
    return all(k in environ for k in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_STEP_NODELIST")) and (
        "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    )


@dataclass(frozen=True)
class SlurmStep:
    """What an ``srun`` task learns from SLURM's environment."""

    node_rank: int
    hosts: tuple[str, ...]
    job_id: str
    step_id: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SlurmStep:
        """Raises ValueError (with the fix) when the step is not one task per node."""
        nodelist = (
            environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        )
        if not nodelist:
            raise ValueError("SLURM_JOB_NODELIST is not set")
        hosts = tuple(expand_nodelist(nodelist))
        for host in hosts:
            try:
                check_host(host, f"the SLURM node list {nodelist!r}")
            except HostfileError as exc:
                raise ValueError(str(exc)) from None
        nnodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or len(hosts))
        if nnodes != len(hosts):
            raise ValueError(f"SLURM_NNODES={nnodes} but the node list {nodelist!r} names {len(hosts)} hosts")
        ntasks = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or nnodes)
        if ntasks != nnodes:
            raise ValueError(
                f"the step has {ntasks} tasks on {nnodes} nodes: ds-swift-launch is one agent per node, which "
                "starts the node's ranks itself; run it as `srun --ntasks-per-node=1 ds-swift-launch ...`"
            )
        node_rank = int(environ["SLURM_NODEID"])
        return cls(
            node_rank=node_rank,
            hosts=hosts,
            job_id=environ["SLURM_JOB_ID"],
            step_id=environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "0",
        )

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)
