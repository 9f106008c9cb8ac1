"""Job membership: the key-value store, generations, the failure flag, heartbeats.

One store serves the whole job: by default a ``TCPStore`` in the node agent of machine 0 (never
in a worker: a store inside a worker dies with that worker and takes every client with it); with
``ds-swift-launch --store tcp://HOST:PORT`` a ``TCPStore`` served elsewhere (the launch host);
with ``--store etcd://H1:P1,H2:P2`` an etcd cluster (:mod:`ds_swift.etcd_store`), which outlives
every training machine, machine 0 included. Workers learn which from ``SWIFT_STORE_URL``. All keys
sit under ``swift/<token>/``: a worker started with another job's token sees none of them and
:meth:`JobStore.connect` refuses it, so a stale worker of an earlier job that reached a reused
port cannot join this one.

Generations. Workers train in generation ``g``. When a machine fails, its agent calls
:meth:`JobStore.declare_failure` for ``g``: the first caller writes ``gen<g>/failed`` (the
reason) and moves ``generation`` to ``g + 1``; every worker's watchdog sees the flag within one
poll. Survivors and replacement workers then :meth:`JobStore.join` generation ``g + 1``: the
join completes when all ``world_size`` ranks arrived, and raises :class:`GenerationFailed` if
``g + 1`` itself failed meanwhile (a cascading failure), in which case everyone joins ``g + 2``.

Keys (relative to the job prefix)::

    generation                 current generation (decimal)
    gen<g>/failed              reason string, set once when generation g failed
    gen<g>/failed_n            counter making the first declarer unique
    gen<g>/joined              number of ranks that joined g
    gen<g>/pg/...              torch.distributed's own rendezvous for g
    gen<g>/<topic>/<rank>      values published by ranks during recovery (see publish/gather)
    hb/<rank>                  last heartbeat of a rank (time.time(), decimal)
    done/<rank>                a rank finished training
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

from ds_swift.store_url import StoreURL

__all__ = [
    "GenerationFailed",
    "JobStore",
    "MembershipError",
    "WorkerEnv",
]

_POLL_S = 0.02


class MembershipError(RuntimeError):
    """The job store cannot be reached, or a worker does not belong to this job."""


class GenerationFailed(RuntimeError):
    """The generation being joined or run has failed; join the next one."""

    def __init__(self, generation: int, reason: str) -> None:
        super().__init__(f"generation {generation} failed: {reason}")
        self.generation = generation
        self.reason = reason


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
        }


class JobStore:
    """Typed access to the job's keys. Thread-safe as far as torch's TCPStore client is."""

    def __init__(self, store: dist.Store, token: str) -> None:
        self.raw = store
        self.token = token
        self.kv = dist.PrefixStore(f"swift/{token}/", store)

    # ------------------------------------------------------------------ construction
    @classmethod
    def host(cls, token: str, port: int = 0, addr: str = "127.0.0.1", timeout_s: float = 60.0) -> JobStore:
        """Serve the job's store in this process (the agent of machine 0). ``port=0`` picks a free port."""
        store = dist.TCPStore(
            addr,
            port,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            use_libuv=True,
        )
        js = cls(store, token)
        js.kv.set("token", token)
        js.kv.set("generation", "0")
        return js

    @property
    def port(self) -> int:
        return int(self.raw.port)  # type: ignore[attr-defined]

    @classmethod
    def connect(cls, addr: str, port: int, token: str, timeout_s: float = 60.0, wait_s: float = 0.0) -> JobStore:
        """Connect as a client; refuse a store that does not serve this job's token.

        ``wait_s``: how long the token may take to appear. An agent started beside the store's host
        (srun starts them all at once) can connect between the host's listen and its first write."""
        try:
            store = dist.TCPStore(
                addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
            )
        except (RuntimeError, OSError) as exc:
            raise MembershipError(f"cannot reach the job store at {addr}:{port}: {exc}") from exc
        js = cls(store, token)
        if wait_s > 0 and not js.kv.check(["token"]):
            try:
                js.kv.wait(["token"], datetime.timedelta(seconds=wait_s))
            except (RuntimeError, OSError):
                pass  # (DistStoreError on a timeout) refused just below, naming the token
        if not js.kv.check(["token"]):
            raise MembershipError(
                f"the store at {addr}:{port} does not serve job token {token[:8]}...: "
                "this worker belongs to another job (or the job ended)"
            )
        return js

    @classmethod
    def open(cls, url: str, token: str, timeout_s: float = 60.0, create: bool = False) -> JobStore:
        """Connect to the store at ``url`` (see :class:`StoreURL`), hosted by nobody in this job.

        ``create``: an agent initialises the job's keys if no agent did yet (idempotent, so every
        agent may); a worker (False) is refused when they are missing, as with :meth:`connect`.
        """
        where = StoreURL.parse(url)
        if where.scheme == "tcp":
            (addr, port), = where.endpoints
            if not create:
                return cls.connect(addr, port, token, timeout_s)
            try:
                raw: dist.Store = dist.TCPStore(
                    addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
                )
            except (RuntimeError, OSError) as exc:
                raise MembershipError(f"cannot reach the job store at {where}: {exc}") from exc
        else:
            from ds_swift.etcd_store import EtcdStore

            raw = EtcdStore(where.endpoints, timeout=datetime.timedelta(seconds=timeout_s))
        js = cls(raw, token)
        try:
            present = bool(js.kv.check(["token"]))
            if create and not present:
                js.kv.set("token", token)
                # compare_set from "absent": the first agent's "0", never a reset of a running job's generation.
                js.kv.compare_set("generation", "", "0")
                present = True
        except (RuntimeError, OSError) as exc:
            raise MembershipError(f"cannot reach the job store at {where}: {exc}") from exc
        if not present:
            raise MembershipError(
                f"the store at {where} does not serve job token {token[:8]}...: "
                "this worker belongs to another job (or the job ended)"
            )
        return js

    @classmethod
    def from_env(cls, env: WorkerEnv, timeout_s: float = 60.0) -> JobStore:
        if env.store_url:
            return cls.open(env.store_url, env.token, timeout_s)
        return cls.connect(env.store_addr, env.store_port, env.token, timeout_s)

    # ------------------------------------------------------------------ generations
    def generation(self) -> int:
        return int(self.kv.get("generation"))

    def failure(self, generation: int) -> str | None:
        """The reason generation ``generation`` failed, or None while it is healthy."""
        key = f"gen{generation}/failed"
        if self.kv.check([key]):
            return self.kv.get(key).decode()
        return None

    def declare_failure(self, generation: int, reason: str) -> bool:
        """Mark ``generation`` failed and open the next one. True for the first declarer only.

        Idempotent and self-repairing: the first declarer may be a rank of the machine that is
        dying, killed between its store writes; then the flag or the generation bump is missing
        and replacements would start into the failed generation. Every later declarer completes
        whatever the first left undone.
        """
        first = int(self.kv.add(f"gen{generation}/failed_n", 1)) == 1
        if first or self.failure(generation) is None:
            self.kv.set(f"gen{generation}/failed", reason)
        # Only move forward: a late declarer of an older generation must not roll it back.
        self.kv.compare_set("generation", str(generation), str(generation + 1))
        return first

    def join(
        self,
        generation: int,
        world_size: int,
        timeout_s: float,
        should_abort: Callable[[], str | None] | None = None,
    ) -> dist.PrefixStore:
        """Arrive at ``generation``; return the store prefix for its process group once all arrived.

        Raises GenerationFailed if the generation fails before everyone arrived (the caller joins
        the next one) and TimeoutError after ``timeout_s``.
        """
        self.kv.add(f"gen{generation}/joined", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            reason = self.failure(generation) or (should_abort() if should_abort else None)
            if reason is not None:
                raise GenerationFailed(generation, reason)
            if int(self.kv.add(f"gen{generation}/joined", 0)) >= world_size:
                return dist.PrefixStore(f"gen{generation}/pg/", self.kv)
            if time.monotonic() > deadline:
                arrived = int(self.kv.add(f"gen{generation}/joined", 0))
                raise TimeoutError(
                    f"generation {generation}: {arrived}/{world_size} ranks arrived within {timeout_s:.0f} s"
                )
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ exchange
    def publish(self, generation: int, topic: str, rank: int, value: str) -> None:
        self.kv.set(f"gen{generation}/{topic}/{rank}", value)

    def gather(
        self, generation: int, topic: str, ranks: Iterable[int], timeout_s: float
    ) -> dict[int, str]:
        """Wait for every rank in ``ranks`` to publish ``topic``; GenerationFailed if g fails first."""
        ranks = list(ranks)
        keys = [f"gen{generation}/{topic}/{r}" for r in ranks]
        deadline = time.monotonic() + timeout_s
        while not self.kv.check(keys):
            reason = self.failure(generation)
            if reason is not None:
                raise GenerationFailed(generation, reason)
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(ranks, keys) if not self.kv.check([k])]
                raise TimeoutError(f"generation {generation}: ranks {missing} did not publish {topic!r}")
            time.sleep(_POLL_S)
        return {r: self.kv.get(k).decode() for r, k in zip(ranks, keys)}

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, rank: int, note: str = "") -> None:
        """``hb/<rank>``: the time, then what the rank's training thread is doing (``note``)."""
        self.kv.set(f"hb/{rank}", f"{time.time()!r} {note}".rstrip())

    def last_heartbeat(self, rank: int) -> float | None:
        beat = self.heartbeat_of(rank)
        return beat[0] if beat is not None else None

    def heartbeat_of(self, rank: int) -> tuple[float, str] | None:
        """(time, note) of ``rank``'s last heartbeat, or None before its first."""
        key = f"hb/{rank}"
        if not self.kv.check([key]):
            return None
        when, _, note = self.kv.get(key).decode().partition(" ")
        return float(when), note

    def mark_done(self, rank: int) -> None:
        self.kv.set(f"done/{rank}", "1")

    def set(self, key: str, value: str) -> None:
        self.kv.set(key, value)

    def get(self, key: str) -> str | None:
        return self.kv.get(key).decode() if self.kv.check([key]) else None

    def add(self, key: str, amount: int) -> int:
        return int(self.kv.add(key, amount))

    def clear(self) -> None:
        """Delete the job's keys from a store that outlives the job (etcd); a no-op for a TCPStore."""
        delete_prefix = getattr(self.raw, "delete_prefix", None)
        if delete_prefix is not None:
            delete_prefix(f"swift/{self.token}/")
