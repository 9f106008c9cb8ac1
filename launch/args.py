"""``ds-swift-launch`` arguments: parsed and validated before anything is started.

Flags mirror the ``deepspeed`` launcher where they overlap (``--num_nodes``, ``--num_gpus``,
``--hostfile``, ``--master_addr``, ``--master_port``, ``--no_local_rank``, ``--module``,
``--no_python``, ``--launcher``, ``--include``, ``--exclude``), with torchrun spellings as aliases
(``--nnodes``, ``--nproc-per-node``, ``--node-rank``). Under ``srun`` the node rank, node count and
hosts come from SLURM (:mod:`.slurm`). Nothing here imports torch, so ``--help`` and usage errors
are instant.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_swift.jobstore.auth import SECRET_ENV, SecretError, job_secret
from ds_swift.jobstore.signed_kv import LAUNCH_ENV, check_launch_id
from ds_swift.jobstore.url import CREDENTIAL_ENV, PASSWORD_FILE_ENV, StoreCredentials, StoreURL
from ds_swift.testing.faults import FaultSpec, FaultSpecError

from .hostfile import HostEntry, is_local
from .placement import DEFAULT_MASTER_PORT, LaunchUsageError, place_agents, ssh_message
from .slurm import in_slurm_step

__all__ = ["Command", "LaunchArgs", "LaunchUsageError", "build_parser", "parse_args"]

DEFAULT_MAX_FAILURES = 3
#: an agent whose liveness counter has not moved for this long is dead, with its machine
DEFAULT_AGENT_TIMEOUT_S = 10.0
LAUNCHERS = ("local", "slurm", "pdsh", "ssh")


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
class LaunchArgs:
    """A validated ``ds-swift-launch`` command line."""

    command: Command
    nnodes: int = 1
    """Machines the job trains on (spares come on top)."""
    nproc_per_node: int = 1
    spares: int = 0
    cold_spares: bool = False
    """Spares start their workers at a failure instead of keeping warm ones (slower; for comparison)."""
    restart_delay_s: float | None = None
    """Restart a failed machine's ranks on the same agent after this delay (None: never)."""
    max_failures: int = DEFAULT_MAX_FAILURES
    elastic: bool = False
    """With no spare left (and no restart), go on without the failed machine (an elastic shrink)."""
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
    launcher: str = "local"
    """local (this process runs its agents), slurm (one srun task = one agent), pdsh or ssh (start them)."""
    store_url: str | None = None
    """``tcp://HOST:PORT`` or ``etcd://...``: a store no agent hosts; None: agent 0 hosts a TCPStore."""
    agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S
    agent_hosts: tuple[str, ...] = ()
    """pdsh/ssh: the hosts whose agents this launcher starts, in rank order."""
    agent_slots: tuple[tuple[int, ...], ...] = ()
    """pdsh/ssh: the GPU slots each of those hosts uses (--include/--exclude)."""
    job_id: str | None = None
    """SLURM_JOB_ID under srun (shown in the events)."""
    job_secret: str = field(default="", repr=False)
    """Signs the job's store values (:mod:`ds_swift.jobstore.auth`); environment only, never argv."""
    job_secret_file: str | None = None
    launch_id: str | None = None
    """This launch's id (:mod:`ds_swift.jobstore.signed_kv`), the same for every agent of it and new for each
    launch; None: a new one (one host, or agent 0's own store) or, for an agent that joins, the
    one the store serves."""
    store_credentials: StoreCredentials = field(default_factory=StoreCredentials, repr=False)
    """CA, client certificate, user and password of an ``etcd+https://`` store."""

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
    p.add_argument("--spares", type=_non_negative_int, default=None, metavar="S",
                   help="spare machines that replace failed ones (default 0; under srun the allocation's nodes "
                        "beyond --nnodes)")
    p.add_argument("--cold-spares", "--cold_spares", dest="cold_spares", action="store_true",
                   help="spares start their workers only when a machine fails (default: each spare keeps its "
                        "workers started and imported, waiting, and hands them the failed machine's ranks)")
    p.add_argument("--restart-delay", "--restart_delay", dest="restart_delay", type=_seconds, default=None, metavar="SEC",
                   help="with no spare left, restart a failed machine's ranks on the same agent after SEC seconds "
                        "(default: never, the job fails)")
    p.add_argument("--elastic", action="store_true",
                   help="with no spare left, go on without the failed machine: the workers drop its data-parallel "
                        "replicas (swift config: strategy elastic; default: the job fails); "
                        "with --restart-delay the machine comes back after the delay and the job grows back")
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
                   help="DeepSpeed hostfile ('host slots=N' lines). With --launcher pdsh|ssh one agent is started on "
                        "each host; without, remote hosts are not reached: ds-swift-launch prints the command for each")
    p.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="how agents start: local (this process; default), slurm (each `srun` task is one node's "
                        "agent; the default inside an srun step), pdsh or ssh (one agent per --hostfile host)")
    p.add_argument("--include", default=None, metavar="SPEC",
                   help="pdsh/ssh: only these hosts/slots, deepspeed syntax: 'host1@host2:0,2'")
    p.add_argument("--exclude", default=None, metavar="SPEC",
                   help="pdsh/ssh: all hosts/slots but these, deepspeed syntax: 'host1@host2:0,2'")
    p.add_argument("--store", default=None, metavar="URL",
                   help="the job store: etcd://H1:2379,H2:2379 (an etcd cluster: survives every training machine) "
                        "or tcp://HOST:PORT (a TCPStore served there; pdsh/ssh: by this launcher). Default: agent 0 "
                        "hosts it (one host: in-process)")
    p.add_argument("--store-ca", dest="store_ca", default=None, metavar="FILE",
                   help=f"etcd+https://: the CA that signed the etcd servers' certificates (or env {CREDENTIAL_ENV['ca']})")
    p.add_argument("--store-cert", dest="store_cert", default=None, metavar="FILE",
                   help=f"etcd+https://: client certificate (no Common Name; or env {CREDENTIAL_ENV['cert']})")
    p.add_argument("--store-key", dest="store_key", default=None, metavar="FILE",
                   help=f"etcd+https://: the client certificate's key (or env {CREDENTIAL_ENV['key']})")
    p.add_argument("--store-user", dest="store_user", default=None, metavar="NAME",
                   help=f"etcd+https://: etcd user (or env {CREDENTIAL_ENV['user']}); its password from "
                        f"--store-password-file or env {CREDENTIAL_ENV['password']}, never the command line")
    p.add_argument("--store-password-file", dest="store_password_file", default=None, metavar="PATH",
                   help=f"a mode-0600 file holding the etcd user's password (or env {PASSWORD_FILE_ENV})")
    p.add_argument("--launch-id", "--launch_id", dest="launch_id", default=None, metavar="ID",
                   help="multi-host with --store: this launch's id, the same on every host and new for each "
                        f"launch (or env {LAUNCH_ENV}; default under srun: the job, step and restart count)")
    p.add_argument("--agent-timeout", "--agent_timeout", dest="agent_timeout", type=_seconds,
                   default=DEFAULT_AGENT_TIMEOUT_S, metavar="SEC",
                   help="multi-host: an agent silent this long is dead with its machine (default %(default)s)")
    # Set by --launcher pdsh|ssh on each host's command line: the agent's rank is its host's index.
    p.add_argument("--node-host", dest="node_host", default=None, help=argparse.SUPPRESS)
    p.add_argument("--agent-hosts", dest="agent_hosts", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job-token", "--job_token", dest="job_token", default=None, metavar="TOKEN",
                   help="the job's secret (default: random on one host; multi-host: the same on every host, "
                        "or env SWIFT_JOB_TOKEN)")
    p.add_argument("--job-secret-file", "--job_secret_file", dest="job_secret_file", default=None, metavar="PATH",
                   help="multi-host: a mode-0600 file holding the job secret, the same for every host "
                        f"(or env {SECRET_ENV}); on one host a new secret is made")
    p.add_argument("--run-dir", "--run_dir", dest="run_dir", default="./swift-run", metavar="DIR",
                   help="directory for recovery timelines and launcher events (default ./swift-run)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="machine=M,iteration=I[,phase=forward|backward|step|send|recv]: kill machine M there, once "
                        "(repeatable, or several separated by ';'); machine=1+2 kills machines 1 and 2 at one "
                        "instant, when the first rank of either reaches the point (separate specs at one point "
                        "fire as each machine reaches it: under load, in two generations)")
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


def _parse_inject(values: Sequence[str], nnodes: int) -> tuple[FaultSpec, ...]:
    specs: list[FaultSpec] = []
    for value in values:
        try:
            specs.extend(FaultSpec.parse(value))
        except FaultSpecError as exc:
            raise LaunchUsageError(f"--inject {value!r}: {exc}") from None
    for spec in specs:
        for machine in spec.machines:
            if machine >= nnodes:
                raise LaunchUsageError(
                    f"--inject {spec}: machine={machine} does not exist: the job has machines 0..{nnodes - 1} "
                    "(spares take over a failed machine's id)"
                )
    return tuple(specs)


def _store(ns: argparse.Namespace) -> str | None:
    if ns.store is None:
        return None
    try:
        return str(StoreURL.parse(ns.store))
    except ValueError as exc:
        raise LaunchUsageError(f"--store: {exc}") from None


def _credentials(ns: argparse.Namespace, env: dict[str, str], store_url: str | None) -> StoreCredentials:
    """Flags first, then the SWIFT_STORE_* environment; only for a store that can use them."""
    merged = dict(env)
    for name in ("ca", "cert", "key", "user"):
        flag = getattr(ns, f"store_{name}")
        if flag is not None:
            merged[CREDENTIAL_ENV[name]] = os.path.abspath(flag) if name != "user" else flag
    try:
        cred = StoreCredentials.from_env(merged, password_file=ns.store_password_file)
    except ValueError as exc:
        raise LaunchUsageError(str(exc)) from None
    where = StoreURL.parse(store_url) if store_url else None
    if not cred.empty and (where is None or not where.tls):
        raise LaunchUsageError(
            f"store credentials (--store-ca/-cert/-key/-user or {', '.join(CREDENTIAL_ENV.values())}) are for an "
            f"etcd+https:// store; --store is {store_url or 'not given'} (over etcd:// a password would travel in clear)"
        )
    return cred


def _launch_id(ns: argparse.Namespace, env: dict[str, str], place: Any, store_url: str | None,
               multi_host: bool) -> str | None:
    """The launch id every agent of this launch derives alike, or None (see LaunchArgs.launch_id)."""
    text = ns.launch_id or (env.get(LAUNCH_ENV) if multi_host else None)
    if text is None and place.step is not None:
        # A requeued SLURM job keeps its job and step ids; SLURM_RESTART_COUNT tells the launches apart.
        text = f"slurm-{place.step.job_id}.{place.step.step_id}.r{env.get('SLURM_RESTART_COUNT') or 0}"
    if text is None and store_url is not None and place.node_rank is not None and ns.node_host is None:
        raise LaunchUsageError(
            f"--node-rank with --store {store_url} needs --launch-id ID (or env {LAUNCH_ENV}), the same on every "
            "host and new for each launch, so that a relaunch never reads a dead launch's keys"
        )
    try:
        return None if text is None else check_launch_id(text)
    except ValueError as exc:
        raise LaunchUsageError(f"--launch-id: {exc}") from None


def parse_args(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> LaunchArgs:
    """Parse and validate; argparse exits on syntax errors, LaunchUsageError covers the rest."""
    ns = build_parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    launcher = ns.launcher or (
        "slurm" if ns.node_rank is None and ns.node_host is None and in_slurm_step(env) else "local"
    )
    store_url = _store(ns)
    if (ns.include or ns.exclude) and launcher not in ("pdsh", "ssh"):
        raise LaunchUsageError("--include/--exclude select hostfile hosts for --launcher pdsh|ssh")
    place = place_agents(ns, env, launcher)
    hosts, nnodes, nproc, spares, node_rank = place.hosts, place.nnodes, place.nproc, place.spares, place.node_rank

    if ns.module and ns.no_python:
        raise LaunchUsageError("--module and --no_python exclude each other")
    if ns.no_python and not ns.no_local_rank:
        # Same rule as the deepspeed launcher: a non-Python program rarely parses --local_rank.
        raise LaunchUsageError("--no_python needs --no_local_rank")

    remote = launcher in ("pdsh", "ssh")
    if node_rank is None and not remote and hosts and not all(is_local(h.host) for h in hosts[: nnodes + spares]):
        raise LaunchUsageError(ssh_message(hosts, ns, nnodes, nproc, spares))

    master_addr = ns.master_addr or place.master_default
    master_port = ns.master_port
    # The env var only counts multi-host: on one host a leaked SWIFT_JOB_TOKEN (a launcher started from
    # inside a worker) must not make two jobs share a token.
    token = ns.job_token or (env.get("SWIFT_JOB_TOKEN") if node_rank is not None or remote else None) or None
    if place.step is not None and token is None:
        # Every task of the step derives the same one; unique per job step, so a stale agent of an
        # earlier step in the same allocation cannot join. (Export SWIFT_JOB_TOKEN for a secret one.)
        token = f"slurm-{place.step.job_id}.{place.step.step_id}"
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
    elif not remote and ns.master_addr is not None and not is_local(ns.master_addr):
        raise LaunchUsageError(
            f"--master_addr {ns.master_addr} without --node-rank: on one host the job store is local; "
            "give --node-rank to run one agent of a multi-host job"
        )
    try:
        secret = job_secret(ns.job_secret_file, env, multi_host=node_rank is not None or remote,
                            generate=node_rank is None)
    except SecretError as exc:
        raise LaunchUsageError(str(exc)) from exc

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
        cold_spares=ns.cold_spares,
        restart_delay_s=ns.restart_delay,
        max_failures=ns.max_failures,
        elastic=ns.elastic,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        job_token=token,
        run_dir=os.path.abspath(ns.run_dir),
        inject=_parse_inject(ns.inject, nnodes),
        op_timeout_s=ns.op_timeout,
        hosts=hosts,
        launcher=launcher,
        store_url=store_url,
        job_secret=secret,
        job_secret_file=os.path.abspath(ns.job_secret_file) if ns.job_secret_file else None,
        launch_id=_launch_id(ns, env, place, store_url, multi_host=node_rank is not None or remote),
        store_credentials=_credentials(ns, env, store_url),
        agent_timeout_s=ns.agent_timeout,
        agent_hosts=place.agent_hosts,
        agent_slots=place.agent_slots,
        job_id=place.step.job_id if place.step is not None else None,
    )
