"""``ds-swift-launch``'s flags: the argparse parser, in groups (:func:`build_parser`).

What the flags mean together, and the checks across them, is :func:`.args.parse_args`. Nothing here
imports torch, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse

from ds_swift.jobstore.auth import SECRET_ENV
from ds_swift.jobstore.signed_kv import LAUNCH_ENV
from ds_swift.jobstore.url import CREDENTIAL_ENV, PASSWORD_FILE_ENV

from .placement import DEFAULT_MASTER_PORT

__all__ = ["DEFAULT_AGENT_TIMEOUT_S", "DEFAULT_MAX_FAILURES", "LAUNCHERS", "build_parser"]

DEFAULT_MAX_FAILURES = 3
#: an agent whose liveness counter has not moved for this long is dead, with its machine
DEFAULT_AGENT_TIMEOUT_S = 10.0
LAUNCHERS = ("local", "slurm", "pdsh", "ssh")


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
    _add_machine_flags(p)
    _add_placement_flags(p)
    _add_store_flags(p)
    _add_secret_flags(p)
    _add_run_flags(p)
    _add_script_flags(p)
    return p


def _add_machine_flags(p: argparse.ArgumentParser) -> None:
    """How many machines and ranks, and what happens when one fails."""
    p.add_argument(
        "--nnodes",
        "--num_nodes",
        "--num-nodes",
        dest="nnodes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="machines the job trains on (default 1, or the hostfile's hosts minus spares)",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        "--num_gpus",
        "--num-gpus",
        dest="nproc_per_node",
        type=_positive_int,
        default=None,
        metavar="P",
        help="ranks per machine (default 1, or the hostfile's slots)",
    )
    p.add_argument(
        "--spares",
        type=_non_negative_int,
        default=None,
        metavar="S",
        help="spare machines that replace failed ones (default 0; under srun the allocation's nodes beyond --nnodes)",
    )
    p.add_argument(
        "--cold-spares",
        "--cold_spares",
        dest="cold_spares",
        action="store_true",
        help="spares start their workers only when a machine fails (default: each spare keeps its "
        "workers started and imported, waiting, and hands them the failed machine's ranks)",
    )
    p.add_argument(
        "--fork-server",
        "--fork_server",
        dest="fork_server",
        action="store_true",
        help="fork every worker from one interpreter that imported the script's modules once, instead "
        "of starting a fresh python per rank (saves the imports of torch, DeepSpeed and megatron-core "
        "per rank: CPU hosts with fewer cores than ranks, tests); the interpreter must not start a "
        "thread or CUDA before it forks (it checks, and stops the job saying so)",
    )
    p.add_argument(
        "--restart-delay",
        "--restart_delay",
        dest="restart_delay",
        type=_seconds,
        default=None,
        metavar="SEC",
        help="with no spare left, restart a failed machine's ranks on the same agent after SEC seconds "
        "(default: never, the job fails)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="with no spare left, go on without the failed machine: the workers drop its data-parallel "
        "replicas (swift config: strategy elastic; default: the job fails); "
        "with --restart-delay the machine comes back after the delay and the job grows back",
    )
    p.add_argument(
        "--max-failures",
        "--max_failures",
        dest="max_failures",
        type=_non_negative_int,
        metavar="K",
        default=DEFAULT_MAX_FAILURES,
        help=f"machine failures the job survives before it gives up (default {DEFAULT_MAX_FAILURES})",
    )


def _add_placement_flags(p: argparse.ArgumentParser) -> None:
    """Where the agents run: this host's agent, the job store's address, the hosts and how agents start."""
    p.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_non_negative_int,
        default=None,
        metavar="R",
        help="multi-host: this host's agent (0..nnodes-1 are machines, the next --spares are spares); "
        "agent 0 hosts the job store at --master_addr:--master_port",
    )
    p.add_argument(
        "--master_addr",
        "--master-addr",
        dest="master_addr",
        default=None,
        metavar="ADDR",
        help="multi-host: address of agent 0 (the job store); default 127.0.0.1 or the hostfile's first host",
    )
    p.add_argument(
        "--master_port",
        "--master-port",
        dest="master_port",
        type=_positive_int,
        default=None,
        metavar="PORT",
        help=f"job store port (default: a free port on one host, {DEFAULT_MASTER_PORT} multi-host)",
    )
    p.add_argument(
        "--hostfile",
        default=None,
        metavar="FILE",
        help="DeepSpeed hostfile ('host slots=N' lines). With --launcher pdsh|ssh one agent is started on "
        "each host; without, remote hosts are not reached: ds-swift-launch prints the command for each",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="how agents start: local (this process; default), slurm (each `srun` task is one node's "
        "agent; the default inside an srun step), pdsh or ssh (one agent per --hostfile host)",
    )
    p.add_argument(
        "--include",
        default=None,
        metavar="SPEC",
        help="pdsh/ssh: only these hosts/slots, deepspeed syntax: 'host1@host2:0,2'",
    )
    p.add_argument(
        "--exclude",
        default=None,
        metavar="SPEC",
        help="pdsh/ssh: all hosts/slots but these, deepspeed syntax: 'host1@host2:0,2'",
    )

    # Set by --launcher pdsh|ssh on each host's command line: the agent's rank is its host's index.
    p.add_argument("--node-host", dest="node_host", default=None, help=argparse.SUPPRESS)
    p.add_argument("--agent-hosts", dest="agent_hosts", default=None, help=argparse.SUPPRESS)


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    """A job store no agent hosts (tcp or etcd), its credentials, the launch id, the agents' liveness."""
    p.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="the job store: etcd://H1:2379,H2:2379 (an etcd cluster: survives every training machine) "
        "or tcp://HOST:PORT (a TCPStore served there; pdsh/ssh: by this launcher). Default: agent 0 "
        "hosts it (one host: in-process)",
    )
    p.add_argument(
        "--store-ca",
        dest="store_ca",
        default=None,
        metavar="FILE",
        help=f"etcd+https://: the CA that signed the etcd servers' certificates (or env {CREDENTIAL_ENV['ca']})",
    )
    p.add_argument(
        "--store-cert",
        dest="store_cert",
        default=None,
        metavar="FILE",
        help=f"etcd+https://: client certificate (no Common Name; or env {CREDENTIAL_ENV['cert']})",
    )
    p.add_argument(
        "--store-key",
        dest="store_key",
        default=None,
        metavar="FILE",
        help=f"etcd+https://: the client certificate's key (or env {CREDENTIAL_ENV['key']})",
    )
    p.add_argument(
        "--store-user",
        dest="store_user",
        default=None,
        metavar="NAME",
        help=f"etcd+https://: etcd user (or env {CREDENTIAL_ENV['user']}); its password from "
        f"--store-password-file or env {CREDENTIAL_ENV['password']}, never the command line",
    )
    p.add_argument(
        "--store-password-file",
        dest="store_password_file",
        default=None,
        metavar="PATH",
        help=f"a mode-0600 file holding the etcd user's password (or env {PASSWORD_FILE_ENV})",
    )
    p.add_argument(
        "--launch-id",
        "--launch_id",
        dest="launch_id",
        default=None,
        metavar="ID",
        help="multi-host with --store: this launch's id, the same on every host and new for each "
        f"launch (or env {LAUNCH_ENV}; default under srun: the job, step and restart count)",
    )
    p.add_argument(
        "--agent-timeout",
        "--agent_timeout",
        dest="agent_timeout",
        type=_seconds,
        default=DEFAULT_AGENT_TIMEOUT_S,
        metavar="SEC",
        help="multi-host: an agent silent this long is dead with its machine (default %(default)s)",
    )


def _add_secret_flags(p: argparse.ArgumentParser) -> None:
    """The job's token and secret: only this job's workers may use the store."""
    p.add_argument(
        "--job-token",
        "--job_token",
        dest="job_token",
        default=None,
        metavar="TOKEN",
        help="the job's secret (default: random on one host; multi-host: the same on every host, "
        "or env SWIFT_JOB_TOKEN)",
    )
    p.add_argument(
        "--job-secret-file",
        "--job_secret_file",
        dest="job_secret_file",
        default=None,
        metavar="PATH",
        help="multi-host: a mode-0600 file holding the job secret, the same for every host "
        f"(or env {SECRET_ENV}); on one host a new secret is made",
    )


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The run directory, fault injection and the workers' op timeout."""
    p.add_argument(
        "--run-dir",
        "--run_dir",
        dest="run_dir",
        default="./swift-run",
        metavar="DIR",
        help="directory for recovery timelines and launcher events (default ./swift-run)",
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="machine=M,iteration=I[,phase=forward|backward|step|send|recv]: kill machine M there, once "
        "(repeatable, or several separated by ';'); machine=1+2 kills machines 1 and 2 at one "
        "instant, when the first rank of either reaches the point (separate specs at one point "
        "fire as each machine reaches it: under load, in two generations); settled=1 fires only "
        "once the buddy copies of the iteration before have landed",
    )
    p.add_argument(
        "--op-timeout",
        "--op_timeout",
        dest="op_timeout",
        type=_seconds,
        default=None,
        metavar="SEC",
        help="per-communication-op timeout for the workers (SWIFT_OP_TIMEOUT_S)",
    )


def _add_script_flags(p: argparse.ArgumentParser) -> None:
    """How each worker starts the user's script, and the script with its arguments."""
    p.add_argument(
        "--no_local_rank",
        "--no-local-rank",
        dest="no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script",
    )
    p.add_argument("-m", "--module", action="store_true", help="run the script as a Python module (python -m)")
    p.add_argument(
        "--no_python",
        "--no-python",
        dest="no_python",
        action="store_true",
        help="start the script directly, without the Python interpreter",
    )
    p.add_argument("user_script", help="the training script")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="arguments of the training script")
