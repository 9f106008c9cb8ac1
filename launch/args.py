"""``ds-swift-launch`` arguments: parsed and validated before anything is started.

Flags mirror the ``deepspeed`` launcher where they overlap (``--num_nodes``, ``--num_gpus``,
``--hostfile``, ``--master_addr``, ``--master_port``, ``--no_local_rank``, ``--module``,
``--no_python``), with torchrun spellings as aliases (``--nnodes``, ``--nproc-per-node``,
``--node-rank``). Nothing here imports torch, so ``--help`` and usage errors are instant.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from ds_swift.testing.faults import FaultSpec, FaultSpecError

__all__ = ["Command", "HostEntry", "LaunchArgs", "LaunchUsageError", "build_parser", "parse_args", "read_hostfile"]

DEFAULT_MASTER_PORT = 29500  # the deepspeed launcher's default
DEFAULT_MAX_FAILURES = 3


class LaunchUsageError(ValueError):
    """Bad command line; the message names the flag and the fix."""


@dataclass(frozen=True)
class Command:
    """How each worker runs the user's script."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    """Run ``script`` as a module (``python -m``)."""
    no_python: bool = False
    """``script`` is an executable, started without the Python interpreter."""
    local_rank_arg: bool = True
    """Pass ``--local_rank=N`` as the ``deepspeed`` launcher does (DeepSpeed scripts expect it)."""


@dataclass(frozen=True)
class HostEntry:
    """One line of a DeepSpeed hostfile: ``hostname slots=N``."""

    host: str
    slots: int


@dataclass(frozen=True)
class LaunchArgs:
    """A validated ``ds-swift-launch`` command line."""

    command: Command
    nnodes: int = 1
    """Machines the job trains on (spares come on top)."""
    nproc_per_node: int = 1
    spares: int = 0
    restart_delay_s: float | None = None
    """Restart a failed machine's ranks on the same agent after this delay (None: never)."""
    max_failures: int = DEFAULT_MAX_FAILURES
    node_rank: int | None = None
    """Multi-host: this invocation's agent (``0..nnodes-1`` machines, then spares). None: simulate all on one host."""
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    """Job store port; None on one host picks a free one."""
    job_token: str | None = None
    run_dir: str = "./swift-run"
    inject: tuple[FaultSpec, ...] = ()
    op_timeout_s: float | None = None
    hosts: tuple[HostEntry, ...] = field(default=())

    @property
    def multi_host(self) -> bool:
        return self.node_rank is not None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def num_agents(self) -> int:
        return self.nnodes + self.spares


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-swift-launch",
        description=(
            "Start a ds-swift job: one node agent per machine hosts or joins the job store, starts the "
            "machine's ranks, treats any rank's death as the machine's failure and brings in a replacement "
            "(a spare, or a restart after --restart-delay). Without --node-rank all machines are simulated "
            "on this host."
        ),
        # An abbreviation must never swallow a flag meant for the user's script.
        allow_abbrev=False,
    )
    p.add_argument("--nnodes", "--num_nodes", "--num-nodes", dest="nnodes", type=_positive_int, default=None, metavar="N",
                   help="machines the job trains on (default 1, or the hostfile's hosts minus spares)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus", dest="nproc_per_node",
                   type=_positive_int, default=None, metavar="P", help="ranks per machine (default 1, or the hostfile's slots)")
    p.add_argument("--spares", type=_non_negative_int, default=0, metavar="S",
                   help="spare machines that replace failed ones (default 0)")
    p.add_argument("--restart-delay", "--restart_delay", dest="restart_delay", type=_seconds, default=None, metavar="SEC",
                   help="with no spare left, restart a failed machine's ranks on the same agent after SEC seconds "
                        "(default: never, the job fails)")
    p.add_argument("--max-failures", "--max_failures", dest="max_failures", type=_non_negative_int, metavar="K",
                   default=DEFAULT_MAX_FAILURES,
                   help=f"machine failures the job survives before it gives up (default {DEFAULT_MAX_FAILURES})")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=_non_negative_int, default=None, metavar="R",
                   help="multi-host: this host's agent (0..nnodes-1 are machines, the next --spares are spares); "
                        "agent 0 hosts the job store at --master_addr:--master_port")
    p.add_argument("--master_addr", "--master-addr", dest="master_addr", default=None, metavar="ADDR",
                   help="multi-host: address of agent 0 (the job store); default 127.0.0.1 or the hostfile's first host")
    p.add_argument("--master_port", "--master-port", dest="master_port", type=_positive_int, default=None, metavar="PORT",
                   help=f"job store port (default: a free port on one host, {DEFAULT_MASTER_PORT} multi-host)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="DeepSpeed hostfile ('host slots=N' lines). Hosts other than this one are not reached by ssh: "
                        "ds-swift-launch prints the command to run on each")
    p.add_argument("--job-token", "--job_token", dest="job_token", default=None, metavar="TOKEN",
                   help="the job's secret (default: random on one host; multi-host: the same on every host, "
                        "or env SWIFT_JOB_TOKEN)")
    p.add_argument("--run-dir", "--run_dir", dest="run_dir", default="./swift-run", metavar="DIR",
                   help="directory for recovery timelines and launcher events (default ./swift-run)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="machine=M,iteration=I[,phase=forward|backward|step|send|recv]: kill machine M there, once "
                        "(repeatable, or several separated by ';')")
    p.add_argument("--op-timeout", "--op_timeout", dest="op_timeout", type=_seconds, default=None, metavar="SEC",
                   help="per-communication-op timeout for the workers (SWIFT_OP_TIMEOUT_S)")
    p.add_argument("--no_local_rank", "--no-local-rank", dest="no_local_rank", action="store_true",
                   help="do not pass --local_rank=N to the script")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a Python module (python -m)")
    p.add_argument("--no_python", "--no-python", dest="no_python", action="store_true",
                   help="start the script directly, without the Python interpreter")
    p.add_argument("user_script", help="the training script")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return p


def read_hostfile(path: str) -> tuple[HostEntry, ...]:
    """Read a DeepSpeed hostfile; blank lines and ``#`` comments are skipped."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise LaunchUsageError(f"--hostfile {path}: cannot read it: {exc.strerror}") from None
    hosts: list[HostEntry] = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots="):
            raise LaunchUsageError(f"--hostfile {path}:{n}: {raw.strip()!r} is not 'hostname slots=N'")
        try:
            slots = int(parts[1].removeprefix("slots="))
        except ValueError:
            slots = -1
        if slots < 1:
            raise LaunchUsageError(f"--hostfile {path}:{n}: slots must be a positive integer in {raw.strip()!r}")
        if any(h.host == parts[0] for h in hosts):
            raise LaunchUsageError(f"--hostfile {path}:{n}: host {parts[0]} is listed twice")
        hosts.append(HostEntry(parts[0], slots))
    if not hosts:
        raise LaunchUsageError(f"--hostfile {path}: no hosts in it")
    return tuple(hosts)


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    return host in names or host.split(".")[0] in {n.split(".")[0] for n in names}


def _parse_inject(values: Sequence[str], nnodes: int) -> tuple[FaultSpec, ...]:
    specs: list[FaultSpec] = []
    for value in values:
        try:
            specs.extend(FaultSpec.parse(value))
        except FaultSpecError as exc:
            raise LaunchUsageError(f"--inject {value!r}: {exc}") from None
    for spec in specs:
        if spec.machine >= nnodes:
            raise LaunchUsageError(
                f"--inject {spec}: machine={spec.machine} does not exist: the job has machines 0..{nnodes - 1} "
                "(spares take over a failed machine's id)"
            )
    return tuple(specs)


def _ssh_message(hosts: Sequence[HostEntry], ns: argparse.Namespace, nnodes: int, nproc: int, spares: int) -> str:
    """The commands to run by hand: ds-swift-launch never uses ssh (a node agent is a node's daemon)."""
    port = ns.master_port or DEFAULT_MASTER_PORT
    addr = ns.master_addr or hosts[0].host
    script = shlex.join([ns.user_script, *ns.user_args])
    lines = [
        f"--hostfile {ns.hostfile} lists remote hosts; ds-swift-launch does not start processes over ssh.",
        "Start one agent per host (same --job-token everywhere, e.g. from `python -c 'import secrets; "
        "print(secrets.token_hex(16))'`):",
    ]
    for rank, h in enumerate(hosts[: nnodes + spares]):
        role = "machine" if rank < nnodes else "spare"
        lines.append(
            f"  on {h.host} ({role}): ds-swift-launch --nnodes {nnodes} --nproc-per-node {nproc} --spares {spares} "
            f"--node-rank {rank} --master_addr {addr} --master_port {port} --job-token TOKEN {script}"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> LaunchArgs:
    """Parse and validate; argparse exits on syntax errors, LaunchUsageError covers the rest."""
    ns = build_parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    hosts = read_hostfile(ns.hostfile) if ns.hostfile else ()

    spares = ns.spares
    nnodes = ns.nnodes
    nproc = ns.nproc_per_node
    if hosts:
        if nnodes is None:
            nnodes = len(hosts) - spares
            if nnodes < 1:
                raise LaunchUsageError(f"--hostfile lists {len(hosts)} hosts, not enough for --spares {spares} plus one machine")
        if nnodes + spares > len(hosts):
            raise LaunchUsageError(
                f"--nnodes {nnodes} + --spares {spares} needs {nnodes + spares} hosts; --hostfile lists {len(hosts)}"
            )
        min_slots = min(h.slots for h in hosts[: nnodes + spares])
        if nproc is None:
            nproc = min_slots
        elif nproc > min_slots:
            raise LaunchUsageError(f"--nproc-per-node {nproc} exceeds the hostfile's slots ({min_slots} on some host)")
    nnodes = nnodes or 1
    nproc = nproc or 1

    if ns.module and ns.no_python:
        raise LaunchUsageError("--module and --no_python exclude each other")
    if ns.no_python and not ns.no_local_rank:
        # Same rule as the deepspeed launcher: a non-Python program rarely parses --local_rank.
        raise LaunchUsageError("--no_python needs --no_local_rank")

    node_rank = ns.node_rank
    if node_rank is None and hosts and not all(_is_local(h.host) for h in hosts[: nnodes + spares]):
        raise LaunchUsageError(_ssh_message(hosts, ns, nnodes, nproc, spares))

    master_addr = ns.master_addr or (hosts[0].host if hosts and node_rank is not None else "127.0.0.1")
    master_port = ns.master_port
    # The env var only counts multi-host: on one host a leaked SWIFT_JOB_TOKEN (a launcher started from
    # inside a worker) must not make two jobs share a token.
    token = ns.job_token or (env.get("SWIFT_JOB_TOKEN") if node_rank is not None else None) or None
    if node_rank is not None:
        if node_rank >= nnodes + spares:
            raise LaunchUsageError(
                f"--node-rank {node_rank} is out of range: agents are 0..{nnodes - 1} (machines) and "
                f"{nnodes}..{nnodes + spares - 1} (spares)" if spares else
                f"--node-rank {node_rank} is out of range: agents are 0..{nnodes - 1} (add --spares for spare agents)"
            )
        if token is None:
            raise LaunchUsageError(
                "--node-rank needs --job-token TOKEN (or env SWIFT_JOB_TOKEN), the same on every host, so that "
                "only this job's workers can use the job store"
            )
        master_port = master_port or DEFAULT_MASTER_PORT
    elif ns.master_addr is not None and not _is_local(ns.master_addr):
        raise LaunchUsageError(
            f"--master_addr {ns.master_addr} without --node-rank: on one host the job store is local; "
            "give --node-rank to run one agent of a multi-host job"
        )

    command = Command(
        script=ns.user_script,
        args=tuple(ns.user_args),
        module=ns.module,
        no_python=ns.no_python,
        local_rank_arg=not ns.no_local_rank,
    )
    return LaunchArgs(
        command=command,
        nnodes=nnodes,
        nproc_per_node=nproc,
        spares=spares,
        restart_delay_s=ns.restart_delay,
        max_failures=ns.max_failures,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        job_token=token,
        run_dir=os.path.abspath(ns.run_dir),
        inject=_parse_inject(ns.inject, nnodes),
        op_timeout_s=ns.op_timeout,
        hosts=hosts,
    )
