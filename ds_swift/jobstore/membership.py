"""Job membership: the key-value store, generations, the failure flag, heartbeats.

One store serves the whole job: by default a ``TCPStore`` in the node agent of machine 0 (never
in a worker: a store inside a worker dies with that worker and takes every client with it); with
``ds-swift-launch --store tcp://HOST:PORT`` a ``TCPStore`` served elsewhere (the launch host);
with ``--store etcd://H1:P1,H2:P2`` an etcd cluster (:mod:`ds_swift.jobstore.etcd`), which outlives
every training machine, machine 0 included (``etcd+https://`` with TLS and etcd authentication).
Workers learn which from ``SWIFT_STORE_URL``. All keys sit under ``swift/<token>.<tag>/L.<launch>/``,
``tag`` derived from the job secret, ``launch`` new for each launch (:mod:`ds_swift.jobstore.signed_kv`),
and every value, counters included, is signed with the secret and the launch id
(:mod:`ds_swift.jobstore.auth`): a worker of another job or of a dead launch sees none of them and
:meth:`JobStore.connect` refuses it, and a write by anyone without the secret is rejected.

Generations. Workers train in generation ``g``. When a machine fails, its agent calls
:meth:`JobStore.declare_failure` for ``g``: the first caller writes ``gen<g>/failed`` (the
reason) and moves ``generation`` to ``g + 1``; every worker's watchdog sees the flag within one
wait. Survivors and replacement workers then :meth:`JobStore.join` generation ``g + 1``: the
join completes when all ``world_size`` ranks arrived (an agreement round, rank 0 its leader), and raises :class:`GenerationFailed` if
``g + 1`` itself failed meanwhile (a cascading failure), in which case everyone joins ``g + 2``.

Keys (relative to the job prefix)::

    generation                 current generation (decimal)
    gen<g>/failed              reason string, set once when generation g failed
    gen<g>/failed_n            counter making the first declarer unique (counters: signed, CAS)
    gen<g>/joined/<rank>       rank <rank> arrived at g; ``gen<g>/joined/verdict``: "complete" (rank 0)
    gen<g>/pg/...              torch.distributed's own rendezvous for g
    gen<g>/<topic>/<rank>      values published by ranks during recovery (see publish/gather)
    hb/<rank>                  a rank's heartbeat: its beat count, then what its training thread does
                               (a replacement rank counts on from its predecessor's count)
    done/<rank>                a rank finished training
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch.distributed as dist

from ds_swift.jobstore.agreement import GenerationFailed, RoundTimeout, agree, collect, round_prefix, verdict_key
from ds_swift.jobstore.auth import SECRET_ENV
from ds_swift.jobstore.layout import LAYOUT_KEY, fate_key, grow_key, grown_layout, read_layout, resumed_key
from ds_swift.jobstore.signed_kv import SignedKV, new_launch_id
from ds_swift.jobstore.url import StoreCredentials, StoreURL
from ds_swift.jobstore.worker_env import MembershipError, WorkerEnv
from ds_swift.threadname import threads_yield_on_wakeup

# The layout keys live in ds_swift.jobstore.layout, GenerationFailed in ds_swift.jobstore.agreement
# (whose rounds raise it); they stay importable from here too.
__all__ = [
    "LAYOUT_KEY",
    "GenerationFailed",
    "JobStore",
    "MembershipError",
    "WorkerEnv",
    "fate_key",
    "grow_key",
    "grown_layout",
    "read_layout",
    "resumed_key",
]

_NOT_OURS = (
    "does not serve job token {}... with this job's secret: this worker belongs to another job "
    "(or the job ended, or the secret differs)"
)


class JobStore(SignedKV):
    """Typed access to the job's keys. Thread-safe as far as torch's TCPStore client is.

    ``secret``: the job secret (:mod:`ds_swift.jobstore.auth`): the keys' namespace depends on it and
    every value is signed with it; a value not signed with it reads as absent. None: no signing
    (unit tests and offline tools only; the launcher always gives one). ``launch``: the launch
    whose keys this client uses (:mod:`ds_swift.jobstore.signed_kv`); the constructors below set it."""

    collected: list[tuple[str, str]] = []
    """Dead launches' namespaces that :meth:`open` deleted: (launch id, why)."""

    def __init__(self, store: dist.Store, token: str, secret: str | None = None, launch: str = "") -> None:
        super().__init__(store, token, secret, launch)
        self._beats: dict[int, int] = {}  # rank -> the last beat count this client wrote (heartbeat)

    # ------------------------------------------------------------------ construction
    @classmethod
    def host(
        cls,
        token: str,
        port: int = 0,
        addr: str = "127.0.0.1",
        timeout_s: float = 60.0,
        secret: str | None = None,
        launch: str | None = None,
    ) -> JobStore:
        """Serve the job's store in this process (the agent of machine 0). ``port=0`` picks a free port.

        The server's thread answers every rank's heartbeats, flag reads and buddy-round keys; started
        under SCHED_BATCH (ds_swift.threadname), it answers them on a free core instead of preempting a
        training rank of its machine whenever a request comes in."""
        with threads_yield_on_wakeup():
            store = dist.TCPStore(
                addr,
                port,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
                use_libuv=True,
            )
        js = cls(store, token, secret)
        js.begin(launch or new_launch_id())
        return js

    @property
    def port(self) -> int:
        return int(self.raw.port)  # type: ignore[attr-defined]

    @classmethod
    def connect(
        cls,
        addr: str,
        port: int,
        token: str,
        timeout_s: float = 60.0,
        wait_s: float = 0.0,
        secret: str | None = None,
        launch: str | None = None,
    ) -> JobStore:
        """Connect as a client; refuse a store that does not serve this job's token and secret.

        ``wait_s``: how long the token may take to appear. An agent started beside the store's host
        (srun starts them all at once) can connect between the host's listen and its first write.
        ``launch``: refuse a store serving another launch of the job; None: join the one it serves."""
        try:
            store = dist.TCPStore(
                addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
            )
        except (RuntimeError, OSError) as exc:
            raise MembershipError(f"cannot reach the job store at {addr}:{port}: {exc}") from exc
        js = cls(store, token, secret)
        js._join(f"{addr}:{port}", launch, wait_s)
        return js

    def _join(self, where: str, launch: str | None, wait_s: float) -> None:
        """Use the launch the store serves (``launch``, if given, must be it)."""
        if wait_s > 0 and not self.root.check(["token"]):
            try:
                self.root.wait(["token"], datetime.timedelta(seconds=wait_s))
            except (RuntimeError, OSError):
                pass  # (DistStoreError on a timeout) refused just below, naming the token
        current = self.current_launch()
        if current is None or current[0] != self.token:
            raise MembershipError(f"the store at {where} {_NOT_OURS.format(self.token[:8])}")
        if launch is not None and current[1] != launch:
            raise MembershipError(
                f"the store at {where} serves launch {current[1] or '(none)'} of job token {self.token[:8]}..., "
                f"not launch {launch}: this process belongs to an earlier launch of the job (it was relaunched)"
            )
        self._bind(current[1])

    @classmethod
    def open(
        cls,
        url: str,
        token: str,
        timeout_s: float = 60.0,
        create: bool = False,
        secret: str | None = None,
        launch: str | None = None,
        credentials: StoreCredentials | None = None,
        wait_s: float = 0.0,
    ) -> JobStore:
        """Connect to the store at ``url`` (see :class:`StoreURL`), hosted by nobody in this job.

        ``create``: begin launch ``launch`` (a new one if None), idempotent, so every agent of the
        launch may; then delete what dead launches of the job left (etcd). Otherwise join the launch
        the store serves (``launch``, if given, must be it), refused when there is none, as with
        :meth:`connect`. ``credentials``: for etcd with TLS/auth; default from ``SWIFT_STORE_*``.
        """
        where = StoreURL.parse(url)
        if where.scheme == "tcp":
            ((addr, port),) = where.endpoints
            if not create:
                return cls.connect(addr, port, token, timeout_s, wait_s=wait_s, secret=secret, launch=launch)
            try:
                raw: dist.Store = dist.TCPStore(
                    addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
                )
            except (RuntimeError, OSError) as exc:
                raise MembershipError(f"cannot reach the job store at {where}: {exc}") from exc
        else:
            raw = _etcd(where, timeout_s, credentials)
        js = cls(raw, token, secret)
        try:
            if create:
                js.begin(launch or new_launch_id())
                js.collected = js.collect_leftovers()
            else:
                js._join(str(where), launch, wait_s)
        except (RuntimeError, OSError) as exc:
            raise MembershipError(f"cannot reach the job store at {where}: {exc}") from exc
        return js

    @classmethod
    def from_env(cls, env: WorkerEnv, timeout_s: float = 60.0) -> JobStore:
        if not env.secret:
            raise MembershipError(
                f"worker environment lacks {SECRET_ENV}: start the job with ds-swift-launch, which gives "
                "every worker the job secret"
            )
        launch = env.launch or None
        if env.store_url:
            credentials = None if env.store_credentials.empty else env.store_credentials
            return cls.open(
                env.store_url, env.token, timeout_s, secret=env.secret, launch=launch, credentials=credentials
            )
        return cls.connect(env.store_addr, env.store_port, env.token, timeout_s, secret=env.secret, launch=launch)

    # ------------------------------------------------------------------ generations
    def generation(self) -> int:
        raw = self._raw_get("generation")
        value = None if raw is None else self.sealer.open("generation", raw)
        if value is None and "generation" in self._high:
            return int(self._high["generation"])  # deleted or forged: the last one this process read
        if value is None:
            raise MembershipError(
                f"job-store key {self.prefix}generation is missing or not signed with this job's secret"
            )
        return int(self._not_lower("generation", int(value), len(raw or b"")))

    @staticmethod
    def failed_key(generation: int) -> str:
        """The key of generation ``generation``'s failure flag (its value: the reason)."""
        return f"gen{generation}/failed"

    @staticmethod
    def buddy_round_key(generation: int, version: int) -> str:
        """The prefix of buddy round ``version``'s keys in ``generation``: ``<prefix>/<rank>`` per
        rank whose copies landed (ds_swift.protect.buddy_holdings.StoreLanding)."""
        return f"buddy/{generation}/{version}"

    @staticmethod
    def buddy_done_key(generation: int, version: int) -> str:
        """The key set once every rank's copies of buddy round ``version`` landed (the round's verdict)."""
        return verdict_key(JobStore.buddy_round_key(generation, version))

    def failure(self, generation: int) -> str | None:
        """The reason generation ``generation`` failed, or None while it is healthy (or only a
        write not signed with the job secret says otherwise: rejected, see :mod:`.store_auth`). Read
        with a check first: every rank's watchdog waits on the flag (:meth:`SignedKV._peek`)."""
        return self._peek(self.failed_key(generation))

    def wait_for_failure(self, generation: int, timeout_s: float) -> str | None:
        """The reason generation ``generation`` failed, once its flag is set; None after ``timeout_s``."""
        return self.wait_value(self.failed_key(generation), timeout_s)

    def declare_failure(self, generation: int, reason: str) -> bool:
        """Mark ``generation`` failed and open the next one. True for the first declarer only.

        Idempotent and self-repairing: the first declarer may be a rank of the machine that is
        dying, killed between its store writes; then the flag or the generation bump is missing
        and replacements would start into the failed generation. Every later declarer completes
        whatever the first left undone.
        """
        if self.failure(generation) is not None:  # a stall seen by every rank at once: one read each, no CAS storm
            self.advance_generation(generation)
            return False
        first = self.add(f"gen{generation}/failed_n", 1) == 1
        if first or self.failure(generation) is None:
            self._put(self.failed_key(generation), reason)
        self.advance_generation(generation)  # after the flag: the relays read it when they wake
        return first

    @staticmethod
    def relay_key(generation: int) -> str:
        """What the agents' relays of the failure flag wait on (ds_swift.detect.relay): written when the
        job leaves ``generation`` (:meth:`advance_generation`), or with ``"job over"`` when the job ends
        (their waits end before the store goes away: a wait cut by a closed store prints a C++ stack trace)."""
        return f"gen{generation}/relay"

    def advance_generation(self, generation: int) -> None:
        """Move the job's generation from ``generation`` to the next; never backwards (a late
        declarer of an older generation finds another value and changes nothing: one request).

        The only way the generation moves, and it wakes the agents' relays first (``relay_key``), by
        whatever path the job leaves ``generation``: a failure's declarer (its flag set before), a
        later declarer finishing what one that died half-way left undone, a rank moving it past a
        failure it saw, an elastic grow. A relay waiting on a generation the job left without it would
        wait there for ever, and its ranks would learn of every later failure only by their backstop read."""
        self.advance("generation", generation + 1, before=lambda: self._put(self.relay_key(generation), "failed"))

    def join(self, generation: int, rank: int, world_size: int, timeout_s: float) -> dist.PrefixStore:
        """Arrive at ``generation``; return the store prefix for its process group once all arrived.

        An agreement round (ds_swift.jobstore.agreement): each rank writes ``gen<g>/joined/<rank>``,
        rank 0 waits for all of them and writes the signed ``complete``, which every rank waits on.
        Raises GenerationFailed if the generation fails before everyone arrived (the caller joins
        the next one) and TimeoutError after ``timeout_s``.
        """
        agree(
            self,
            round_prefix(generation, "joined"),
            rank,
            "1",
            range(world_size),
            lambda _: "complete",
            timeout_s=timeout_s,
            generation=generation,
        )
        return dist.PrefixStore(f"gen{generation}/pg/", self.kv)

    def joined(self, generation: int, ranks: Iterable[int]) -> bool:
        """Whether every rank of ``ranks`` arrived at ``generation``'s join (one request: that their
        keys exist; the join itself reads them signed)."""
        return bool(self.kv.check([f"{round_prefix(generation, 'joined')}/{r}" for r in ranks]))

    # ------------------------------------------------------------------ exchange
    def publish(self, generation: int, topic: str, rank: int, value: str) -> None:
        self._put(f"gen{generation}/{topic}/{rank}", value)

    def gather(self, generation: int, topic: str, ranks: Iterable[int], timeout_s: float) -> dict[int, str]:
        """Wait for every rank in ``ranks`` to publish ``topic``; GenerationFailed if g fails first.
        For a few ranks' values (a donor's digest, the replayers' summaries): where every rank must
        act on every rank's value, an agreement round (:func:`~ds_swift.jobstore.agreement.agree`)."""
        ranks = list(ranks)
        keys = [f"gen{generation}/{topic}/{r}" for r in ranks]
        try:
            values = collect(self, keys, timeout_s, generation=generation)
        except RoundTimeout as late:
            missing = [r for r, k in zip(ranks, keys, strict=True) if k in set(late.pending)]
            raise TimeoutError(
                f"generation {generation}: ranks {missing} did not publish {topic!r} within {timeout_s:g} s"
            ) from None
        assert values is not None  # no stopped(): only a value or an exception ends it
        return dict(zip(ranks, values, strict=True))

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, rank: int, note: str = "") -> None:
        """Bump ``rank``'s beat counter; ``hb/<rank>``: the count, then what the rank's training
        thread is doing (``note``). A counter, not a time: observers judge it on their own
        monotonic clock (:mod:`ds_swift.detect.beats`), never against another host's clock."""
        count = self._beats.get(rank)
        if count is None:  # a replacement rank counts on from its predecessor: one read, at its first beat
            beat = self.heartbeat_of(rank)
            count = beat[0] if beat is not None else 0
        self._beats[rank] = count = count + 1
        self._put(f"hb/{rank}", f"{count} {note}".rstrip())

    def last_heartbeat(self, rank: int) -> int | None:
        """``rank``'s beat count (None before its first beat)."""
        beat = self.heartbeat_of(rank)
        return beat[0] if beat is not None else None

    def heartbeat_of(self, rank: int) -> tuple[int, str] | None:
        """(beat count, note) of ``rank``'s last heartbeat, or None before its first."""
        beat = self._read(f"hb/{rank}")
        if beat is None:
            return None
        count, _, note = beat.partition(" ")
        try:
            value = int(count)
        except ValueError:
            return None  # not a count (a heartbeat of an older ds-swift): no evidence either way
        # An older heartbeat written again would make a live rank look stopped: never backwards.
        return int(self._not_lower(f"hb/{rank}", value, len(beat))), note

    def mark_done(self, rank: int) -> None:
        self._put(f"done/{rank}", "1")

    def set(self, key: str, value: str) -> None:
        self._put(key, value)

    def wait_value(self, key: str, timeout_s: float) -> str | None:
        """The value at ``key`` once set, or None after ``timeout_s``: one blocking wait, one read
        (a value not signed with the job secret is waited past, without polling, until the timeout)."""
        return self.wait_signed(key, timeout_s)

    def get(self, key: str) -> str | None:
        """The signed value at ``key``; None when absent or not signed with the job secret."""
        return self._read(key)


def _etcd(where: StoreURL, timeout_s: float, credentials: StoreCredentials | None) -> dist.Store:
    """An etcd client for ``where``; credentials default to the ``SWIFT_STORE_*`` environment."""
    from ds_swift.jobstore.etcd import EtcdStore

    try:
        credentials = credentials or StoreCredentials.from_env(os.environ)
        return EtcdStore(
            where.endpoints, timeout=datetime.timedelta(seconds=timeout_s), tls=where.tls, credentials=credentials
        )
    except ValueError as exc:
        raise MembershipError(f"job store {where}: {exc}") from exc
