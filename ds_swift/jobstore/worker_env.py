"""What ``ds-swift-launch`` tells each worker through its environment (:class:`WorkerEnv`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ds_swift.jobstore.auth import SECRET_ENV
from ds_swift.jobstore.url import CREDENTIAL_ENV, StoreCredentials

__all__ = ["MembershipError", "WorkerEnv"]


class MembershipError(RuntimeError):
    """The job store cannot be reached, or a worker does not belong to this job."""


@dataclass(frozen=True)
class WorkerEnv:
    """What ``ds-swift-launch`` tells each worker through its environment."""

    rank: int
    local_rank: int
    world_size: int
    machine: int
    num_machines: int
    generation: int
    replacement: bool
    store_addr: str
    store_port: int
    token: str
    run_dir: str
    inject: str
    store_url: str = ""
    """``etcd://...`` when the job store is an etcd cluster; empty: the TCPStore at store_addr:store_port."""
    secret: str = field(default="", repr=False)
    """The job secret (:mod:`ds_swift.jobstore.auth`); environment only, never argv or a log."""
    launch: str = ""
    """The launch this worker belongs to (:mod:`ds_swift.jobstore.signed_kv`): its keys' namespace."""
    store_credentials: StoreCredentials = field(default_factory=StoreCredentials, repr=False)
    """CA, client certificate, user and password of an etcd store with TLS/auth (environment only)."""
    beat_dir: str = ""
    """The directory on this machine where the rank beats for its agent (ds_swift.detect.beats.BeatFile);
    empty: no agent reads it, the rank beats in the job store."""
    agent_timeout_s: float = 10.0
    """How long the agents wait before they take a silent agent for dead (``--agent-timeout``): a
    comm error waits that long, and a beat more, for a death to be declared (ds_swift.detect.classify)."""

    ENV_KEYS = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "SWIFT_MACHINE",
        "SWIFT_NUM_MACHINES",
        "SWIFT_GENERATION",
        "SWIFT_REPLACEMENT",
        "SWIFT_STORE_ADDR",
        "SWIFT_STORE_PORT",
        "SWIFT_JOB_TOKEN",
        "SWIFT_RUN_DIR",
        "SWIFT_INJECT",
        "SWIFT_STORE_URL",
        SECRET_ENV,
        "SWIFT_LAUNCH_ID",
        "SWIFT_BEAT_DIR",
        "SWIFT_AGENT_TIMEOUT_S",
        *CREDENTIAL_ENV.values(),
    )

    @staticmethod
    def present(environ: dict[str, str] | None = None) -> bool:
        """True when this process was started by ``ds-swift-launch``."""
        env = os.environ if environ is None else environ
        return "SWIFT_JOB_TOKEN" in env

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if environ is None else environ)
        required = ("RANK", "WORLD_SIZE", "SWIFT_STORE_ADDR", "SWIFT_STORE_PORT", "SWIFT_JOB_TOKEN")
        missing = [k for k in required if k not in env]
        if missing:
            raise MembershipError(
                f"worker environment lacks {', '.join(missing)}: start the job with ds-swift-launch "
                "(the stock deepspeed launcher cannot start replacement machines)"
            )
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            machine=int(env.get("SWIFT_MACHINE", "0")),
            num_machines=int(env.get("SWIFT_NUM_MACHINES", "1")),
            generation=int(env.get("SWIFT_GENERATION", "0")),
            replacement=env.get("SWIFT_REPLACEMENT", "0") == "1",
            store_addr=env["SWIFT_STORE_ADDR"],
            store_port=int(env["SWIFT_STORE_PORT"]),
            token=env["SWIFT_JOB_TOKEN"],
            run_dir=env.get("SWIFT_RUN_DIR", "./swift-run"),
            inject=env.get("SWIFT_INJECT", ""),
            store_url=env.get("SWIFT_STORE_URL", ""),
            secret=env.get(SECRET_ENV, ""),
            launch=env.get("SWIFT_LAUNCH_ID", ""),
            store_credentials=StoreCredentials(**{k: env.get(v, "") for k, v in CREDENTIAL_ENV.items()}),
            beat_dir=env.get("SWIFT_BEAT_DIR", ""),
            agent_timeout_s=float(env.get("SWIFT_AGENT_TIMEOUT_S", "10")),
        )

    def to_env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "SWIFT_MACHINE": str(self.machine),
            "SWIFT_NUM_MACHINES": str(self.num_machines),
            "SWIFT_GENERATION": str(self.generation),
            "SWIFT_REPLACEMENT": "1" if self.replacement else "0",
            "SWIFT_STORE_ADDR": self.store_addr,
            "SWIFT_STORE_PORT": str(self.store_port),
            "SWIFT_JOB_TOKEN": self.token,
            "SWIFT_RUN_DIR": self.run_dir,
            "SWIFT_INJECT": self.inject,
            "SWIFT_STORE_URL": self.store_url,
            SECRET_ENV: self.secret,
            "SWIFT_LAUNCH_ID": self.launch,
            "SWIFT_BEAT_DIR": self.beat_dir,
            "SWIFT_AGENT_TIMEOUT_S": repr(self.agent_timeout_s),
            **self.store_credentials.to_env(),
        }
