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
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_swift.jobstore.auth import SecretError, job_secret
from ds_swift.jobstore.signed_kv import LAUNCH_ENV, check_launch_id
from ds_swift.jobstore.url import CREDENTIAL_ENV, StoreCredentials, StoreURL
from ds_swift.logs import say
from ds_swift.testing.faults import FaultSpec, FaultSpecError

from .flags import DEFAULT_AGENT_TIMEOUT_S, DEFAULT_MAX_FAILURES, build_parser
from .hostfile import HostEntry, is_local
from .placement import DEFAULT_MASTER_PORT, LaunchUsageError, place_agents, ssh_message
from .slurm import in_slurm_step

# build_parser lives in .flags (the flags themselves); it stays importable from here.
__all__ = ["Command", "LaunchArgs", "LaunchUsageError", "build_parser", "parse_args"]


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
    fork_server: bool = False
    """Workers are forked from one pre-imported interpreter per launcher process (``launch/fork_client.py``)."""
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
        where = StoreURL.parse(ns.store)
    except ValueError as exc:
        raise LaunchUsageError(f"--store: {exc}") from None
    if where.is_etcd and not where.tls:
        say(PLAIN_ETCD_RISK, name=__name__, level=logging.WARNING, prefix="ds-swift-launch")
    return str(where)


#: What a plain ``etcd://`` store leaves open, said at every launch that uses one.
PLAIN_ETCD_RISK = (
    "--store etcd:// is plain HTTP without authentication: anyone who reaches etcd can read every value, and "
    "torch's own rendezvous keys (gen<g>/pg/..., written by torch, not signed by ds-swift) can be overwritten "
    "to break or redirect a process group while it forms. ds-swift's own values stay signed. Use "
    "etcd+https:// with --store-ca and an etcd user (README: 'Where the job store lives')"
)


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


def _launch_id(
    ns: argparse.Namespace, env: dict[str, str], place: Any, store_url: str | None, multi_host: bool
) -> str | None:
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

    command = _command(ns)
    remote = launcher in ("pdsh", "ssh")
    if node_rank is None and not remote and hosts and not all(is_local(h.host) for h in hosts[: nnodes + spares]):
        raise LaunchUsageError(ssh_message(hosts, ns, nnodes, nproc, spares))

    master_addr = ns.master_addr or place.master_default
    token = _job_token(ns, env, place, multi_host=node_rank is not None or remote)
    master_port = _master_port(ns, node_rank, nnodes, spares, token, remote)
    try:
        secret = job_secret(
            ns.job_secret_file, env, multi_host=node_rank is not None or remote, generate=node_rank is None
        )
    except SecretError as exc:
        raise LaunchUsageError(str(exc)) from exc

    from .preflight import under_a_file

    if (blocker := under_a_file(ns.run_dir)) is not None:
        raise LaunchUsageError(
            f"--run-dir {ns.run_dir}: {blocker} is a file, so the directory cannot be created; give a directory"
        )
    if ns.fork_server and command.no_python:
        raise LaunchUsageError("--fork-server forks a Python interpreter: it cannot run a --no_python command")
    return LaunchArgs(
        command=command,
        nnodes=nnodes,
        nproc_per_node=nproc,
        spares=spares,
        cold_spares=ns.cold_spares,
        fork_server=ns.fork_server,
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


def _command(ns: argparse.Namespace) -> Command:
    """How each worker runs the user's script (the interpreter flags checked)."""
    if ns.module and ns.no_python:
        raise LaunchUsageError("--module and --no_python exclude each other")
    if ns.no_python and not ns.no_local_rank:
        # Same rule as the deepspeed launcher: a non-Python program rarely parses --local_rank.
        raise LaunchUsageError("--no_python needs --no_local_rank")
    return Command(
        script=ns.user_script,
        args=tuple(ns.user_args),
        module=ns.module,
        no_python=ns.no_python,
        local_rank_arg=not ns.no_local_rank,
    )


def _job_token(ns: argparse.Namespace, env: dict[str, str], place: Any, multi_host: bool) -> str | None:
    """The job token: the flag, SWIFT_JOB_TOKEN (multi-host only), or one derived from the SLURM step."""
    # The env var only counts multi-host: on one host a leaked SWIFT_JOB_TOKEN (a launcher started from
    # inside a worker) must not make two jobs share a token.
    token = ns.job_token or (env.get("SWIFT_JOB_TOKEN") if multi_host else None) or None
    if place.step is not None and token is None:
        # Every task of the step derives the same one; unique per job step, so a stale agent of an
        # earlier step in the same allocation cannot join. (Export SWIFT_JOB_TOKEN for a secret one.)
        token = f"slurm-{place.step.job_id}.{place.step.step_id}"
    return token


def _master_port(
    ns: argparse.Namespace, node_rank: int | None, nnodes: int, spares: int, token: str | None, remote: bool
) -> int | None:
    """The job store's port, once ``--node-rank`` (in range, with a token) or its absence (a local
    store) is checked against the other flags."""
    if node_rank is not None:
        if node_rank >= nnodes + spares:
            raise LaunchUsageError(
                f"--node-rank {node_rank} is out of range: agents are 0..{nnodes - 1} (machines) and "
                f"{nnodes}..{nnodes + spares - 1} (spares)"
                if spares
                else f"--node-rank {node_rank} is out of range: agents are 0..{nnodes - 1} (add --spares for spare agents)"
            )
        if token is None:
            raise LaunchUsageError(
                "--node-rank needs --job-token TOKEN (or env SWIFT_JOB_TOKEN), the same on every host, so that "
                "only this job's workers can use the job store"
            )
        return ns.master_port or DEFAULT_MASTER_PORT
    if not remote and ns.master_addr is not None and not is_local(ns.master_addr):
        raise LaunchUsageError(
            f"--master_addr {ns.master_addr} without --node-rank: on one host the job store is local; "
            "give --node-rank to run one agent of a multi-host job"
        )
    return ns.master_port
