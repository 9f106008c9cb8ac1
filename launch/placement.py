"""Where a job's agents run: from the flags, a hostfile, or SLURM's environment (for :mod:`.args`)."""

from __future__ import annotations

import argparse
import shlex
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from ds_swift.jobstore.auth import SECRET_ENV

from .hostfile import HostEntry, HostfileError, check_host, filter_resources, read_hostfile
from .slurm import SlurmStep

__all__ = ["DEFAULT_MASTER_PORT", "LaunchUsageError", "Placement", "place_agents", "ssh_message"]

DEFAULT_MASTER_PORT = 29500  # the deepspeed launcher's default


class LaunchUsageError(ValueError):
    """Bad command line; the message names the flag and the fix."""


def ssh_message(hosts: Sequence[HostEntry], ns: argparse.Namespace, nnodes: int, nproc: int, spares: int) -> str:
    """The commands to run by hand: ds-swift-launch never uses ssh (a node agent is a node's daemon)."""
    port = ns.master_port or DEFAULT_MASTER_PORT
    addr = ns.master_addr or hosts[0].host
    script = shlex.join([ns.user_script, *ns.user_args])
    lines = [
        f"--hostfile {ns.hostfile} lists remote hosts: give --launcher pdsh or --launcher ssh to start an agent "
        "on each, or start one agent per host yourself (the same --job-token, and the same job secret in "
        f"${SECRET_ENV}, on every host; make each with `python -c 'import secrets; print(secrets.token_hex(32))'`):",
    ]
    for rank, h in enumerate(hosts[: nnodes + spares]):
        role = "machine" if rank < nnodes else "spare"
        lines.append(
            f"  on {h.host} ({role}): ds-swift-launch --nnodes {nnodes} --nproc-per-node {nproc} --spares {spares} "
            f"--node-rank {rank} --master_addr {addr} --master_port {port} --job-token TOKEN {script}"
        )
    return "\n".join(lines)


def _sizes(ns: argparse.Namespace, hosts: Sequence[HostEntry], spares: int) -> tuple[int, int]:
    """(machines, ranks per machine) from the flags and the hostfile."""
    nnodes = ns.nnodes
    nproc = ns.nproc_per_node
    if hosts:
        if nnodes is None:
            nnodes = len(hosts) - spares
            if nnodes < 1:
                raise LaunchUsageError(
                    f"--hostfile lists {len(hosts)} hosts, not enough for --spares {spares} plus one machine"
                )
        if nnodes + spares > len(hosts):
            raise LaunchUsageError(
                f"--nnodes {nnodes} + --spares {spares} needs {nnodes + spares} hosts; --hostfile lists {len(hosts)}"
            )
        min_slots = min(h.slots for h in hosts[: nnodes + spares])
        if nproc is None:
            nproc = min_slots
        elif nproc > min_slots:
            raise LaunchUsageError(f"--nproc-per-node {nproc} exceeds the hostfile's slots ({min_slots} on some host)")
    return nnodes or 1, nproc or 1


def _slurm_sizes(ns: argparse.Namespace, env: dict[str, str]) -> tuple[SlurmStep, int, int]:
    """(the step, machines, spares) of an srun task: nodes beyond --nnodes are spares."""
    try:
        step = SlurmStep.from_env(env)
    except (ValueError, KeyError) as exc:
        raise LaunchUsageError(f"--launcher slurm: {exc}") from None
    n = step.num_nodes
    nnodes = ns.nnodes if ns.nnodes is not None else n - (ns.spares or 0)
    if nnodes < 1 or nnodes > n:
        raise LaunchUsageError(f"--nnodes {nnodes} does not fit the allocation's {n} nodes (SLURM_NNODES)")
    if ns.spares is not None and ns.spares != n - nnodes:
        raise LaunchUsageError(
            f"--spares {ns.spares}: the allocation has {n} nodes, so --nnodes {nnodes} leaves {n - nnodes} spares; "
            "give one of --nnodes/--spares, or allocate --nodes=NNODES+SPARES"
        )
    return step, nnodes, n - nnodes


@dataclass
class Placement:
    """Where the agents run: from the flags, the hostfile, SLURM's environment."""

    hosts: tuple[HostEntry, ...]
    nnodes: int
    nproc: int
    spares: int
    node_rank: int | None
    master_default: str
    agent_hosts: tuple[str, ...] = ()
    agent_slots: tuple[tuple[int, ...], ...] = ()
    step: SlurmStep | None = None


def place_agents(ns: argparse.Namespace, env: dict[str, str], launcher: str) -> Placement:
    if launcher == "slurm":
        step, nnodes, spares = _slurm_sizes(ns, env)
        return Placement((), nnodes, ns.nproc_per_node or 1, spares, step.node_rank, step.hosts[0], step=step)
    try:
        hosts = read_hostfile(ns.hostfile) if ns.hostfile else ()
    except HostfileError as exc:
        raise LaunchUsageError(str(exc)) from None
    node_rank = ns.node_rank
    remote = launcher in ("pdsh", "ssh")
    chosen: list[tuple[str, list[int]]] = []
    if remote:
        if not hosts:
            raise LaunchUsageError(f"--launcher {launcher} needs --hostfile (the hosts to start agents on)")
        if node_rank is not None:
            raise LaunchUsageError(f"--launcher {launcher} starts every agent itself: drop --node-rank")
        try:
            chosen = filter_resources(hosts, ns.include, ns.exclude)
        except HostfileError as exc:
            raise LaunchUsageError(str(exc)) from None
        hosts = tuple(HostEntry(h, len(slots)) for h, slots in chosen)
    if ns.node_host is not None:  # an agent that --launcher pdsh|ssh started: its rank is its host's index
        order = (ns.agent_hosts or "").split(",")
        try:
            for host in (*order, ns.node_host):
                check_host(host, "--agent-hosts/--node-host")
        except HostfileError as exc:
            raise LaunchUsageError(str(exc)) from None
        if ns.node_host not in order:
            raise LaunchUsageError(f"--node-host {ns.node_host} is not in --agent-hosts {ns.agent_hosts}")
        node_rank = order.index(ns.node_host)
    spares = ns.spares or 0
    nnodes, nproc = _sizes(ns, hosts, spares)
    if not remote:
        master = hosts[0].host if hosts and node_rank is not None else "127.0.0.1"
        return Placement(hosts, nnodes, nproc, spares, node_rank, master)
    n = nnodes + spares
    # The launch host serves the store: its name, as the hosts reach it.
    return Placement(
        hosts,
        nnodes,
        nproc,
        spares,
        None,
        socket.getfqdn(),
        agent_hosts=tuple(h.host for h in hosts[:n]),
        agent_slots=tuple(tuple(slots) for _, slots in chosen[:n]),
    )
