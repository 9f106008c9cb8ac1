"""Runs a job's agents: all of them simulated on one host, or this host's one agent of a multi-host job.

One loop in the main thread ticks every agent: it blocks until a worker dies (SIGCHLD wakes it:
the death is seen at once) or the next look at the job store is due (every :data:`LOOK_S`), with
no thread per worker and no race between agents sharing the store client.
The loop ends when every machine is done (exit 0), when some agent aborted the job (exit 1), or on
SIGINT/SIGTERM (exit 130/143). Whatever way it ends, every worker is killed and reaped before the
launcher returns: ``finally`` SIGKILLs each process group that is still alive.

Multi-host, the loop also beats this agent's liveness counter and watches the other agents'
(:mod:`.liveness`): a dead agent's machine fails as if its ranks had died. The job store is agent
0's TCPStore by default, or, with ``--store``, one that no agent hosts (etcd, or a TCPStore on the
launch host), which then outlives agent 0 too. ``--launcher pdsh|ssh`` hands over to :mod:`.remote`.
"""

from __future__ import annotations

import logging
import secrets
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING

from ds_swift.jobstore.membership import JobStore, MembershipError
from ds_swift.jobstore.signed_kv import BEAT_S
from ds_swift.jobstore.url import StoreURL
from ds_swift.logs import say
from ds_swift.testing.faults import FaultSpec, unfired

from .agent import JobSpec, MachineAgent
from .args import LaunchArgs
from .control import EventLog, JobControl
from .liveness import AgentLiveness
from .spawn import spawn_warm, spawn_worker

if TYPE_CHECKING:
    from .fork_client import ForkServer

__all__ = ["Supervisor", "run"]

POLL_S = 0.01
#: seconds between the loop's looks at the job store (abort, done, spares' requests): the loop
#: itself blocks until then, woken at once by a worker's death. A look every POLL_S was two store
#: requests per machine every 10 ms: a thousand machines, 200k requests a second.
LOOK_S = 1.0
#: SIGTERM to SIGKILL, for workers on Ctrl-C / SIGTERM of the launcher
TERM_GRACE_S = 3.0
#: how long agent 0 keeps the store up for other hosts' agents to read how the job ended
STORE_LINGER_S = 10.0


class Supervisor:
    """Ticks the agents of this process until the job ends; returns the exit code."""

    def __init__(
        self,
        agents: list[MachineAgent],
        store: JobStore,
        events: EventLog,
        num_machines: int,
        hosts_store: bool,
        remote_agents: int = 0,
        poll_s: float = POLL_S,
        liveness: AgentLiveness | None = None,
        clear_after: int = 0,
        inject: Sequence[FaultSpec] = (),
        server: ForkServer | None = None,
    ) -> None:
        self.agents = agents
        self.server = server
        """``--fork-server``: its reports wake the loop (a worker's exit), as SIGCHLD does without it."""
        self.inject = tuple(inject)
        """The job's --inject specs, for the line at its end on any that never fired (one launcher says it)."""
        self.store = store
        self.control = JobControl(store)
        self.events = events
        self.num_machines = num_machines
        self.hosts_store = hosts_store
        self.remote_agents = remote_agents
        """Agents in other processes (multi-host): the store host waits for them before closing."""
        self.poll_s = poll_s
        self.liveness = liveness
        self.clear_after = clear_after
        """External store: the launcher processes of the job; the last of them to end deletes its keys."""
        self._signal: int | None = None
        self._record_at = time.monotonic() + BEAT_S
        self._look_at = 0.0  # the first turn looks at once
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is not None:
            # Second Ctrl-C: no more grace.
            for agent in self.agents:
                agent.signal_all(signal.SIGKILL)
        self._signal = signum

    def run(self) -> int:
        previous: dict[int, object] = {}
        old_wakeup = -1
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
            # A worker's death (SIGCHLD) wakes the loop at once instead of at the next tick: detection
            # latency drops from ~poll_s/2 to scheduling noise. The handler does nothing; the
            # wakeup fd written by the C-level handler is what interrupts select().
            previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda signum, frame: None)
            signal.siginterrupt(signal.SIGCHLD, False)  # SA_RESTART: blocking calls elsewhere see no EINTR
            self._wake_r, wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            wake_w.setblocking(False)
            self._wake_w = wake_w
            old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        try:
            return self._loop()
        except Exception as exc:  # noqa: BLE001 - whatever broke, the workers must not outlive us
            traceback.print_exc()
            self.events(f"launcher error: {type(exc).__name__}: {exc}; stopping every worker", event="error")
            return 1
        finally:
            self._kill_everything()
            for agent in self.agents:
                agent.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]
            if self._wake_r is not None:
                signal.set_wakeup_fd(old_wakeup)
                self._wake_r.close()
                if self._wake_w is not None:
                    self._wake_w.close()

    def _loop(self) -> int:
        for agent in self.agents:
            agent.start()
        while True:
            code = self.step()
            if code is not None:
                return code
            self._sleep(self.pause_s())

    def step(self) -> int | None:
        """One turn of the loop: the job's exit code once it ended, else None (benchmarks/scale.py
        drives the same turns on a fake clock). The agents look at their workers at every turn
        (waitpid: no store traffic); the job store is read once every :data:`LOOK_S`."""
        if self._signal is not None:
            return self._stop_on_signal(self._signal)
        for agent in self.agents:
            agent.tick()
        now = time.monotonic()
        if now >= self._look_at:
            self._look_at = now + LOOK_S
            code = self._look()
            if code is not None:
                return code
        if self.clear_after and time.monotonic() >= self._record_at:
            self._record_at = time.monotonic() + BEAT_S
            self.store.write_record()  # a record seen unchanged for STALE_S marks a dead launch
            self._collect()
        if self.liveness is not None:
            for node in self.liveness.step():
                if self.liveness.claim(node):
                    self.agents[0].adopt_lost_machine(node, self.liveness.silent_for(node))
        if any([agent.requested_spare() for agent in self.agents]):
            # A spare of this launcher takes over at the next turn, not at the next look (up to
            # LOOK_S later: the replacement's start, which every survivor waits for at the rendezvous).
            self._look_at = time.monotonic()
        return None

    def _look(self) -> int | None:
        """The store's side of a turn: the job aborted, or done; a spare's replacement requests."""
        reason = self.control.abort_reason()
        if reason is not None:
            return self._end(1, f"job failed: {reason}; stopping every worker", reason=reason)
        if self.control.all_done(self.num_machines):
            if self.inject and (missed := unfired(self.inject, self.store)) is not None:
                self.events(missed, event="inject_unfired")
            return self._end(
                0,
                f"job finished: all {self.num_machines} machines' ranks exited 0 (generation "
                f"{self.store.generation()}, {self.control.failures()} machine failure(s))",
            )
        for agent in self.agents:
            agent.poll_store()
        return None

    def pause_s(self) -> float:
        """How long the loop waits before its next turn: until the next look at the store or beat,
        woken sooner by a signal (a worker's death, Ctrl-C); without the wake-up (the loop is not on
        the main thread) a tick of ``poll_s``, so that a death is still seen within it."""
        now = time.monotonic()
        pause = self._look_at - now
        if self.liveness is not None:
            pause = min(pause, self.liveness.pause_s())
        if self._wake_r is None or any(agent.busy for agent in self.agents):
            pause = min(pause, self.poll_s)
        return max(0.0, pause)

    def _collect(self) -> None:
        """Delete the keys of this job's other launches that are over (seen unchanged since the last beats)."""
        try:
            gone = self.store.collect_leftovers()
        except Exception as exc:  # noqa: BLE001 - garbage left in the store must not end the job
            self.events(f"collecting dead launches' keys failed: {type(exc).__name__}: {exc}", event="warning")
            return
        for launch, why in gone:
            self.events(
                f"deleted the keys of dead launch {launch} of this job ({why})",
                event="launch_collected",
                launch=launch,
                why=why,
            )

    def _sleep(self, pause_s: float) -> None:
        """Wait ``pause_s``, or less if a signal (a child's death, Ctrl-C) arrives, or the fork server
        reports (a worker it forked ended: the launcher gets no SIGCHLD for it, and a death seen only
        at the next look was up to :data:`LOOK_S` late)."""
        reports = self.server.reports_fd() if self.server is not None else -1
        fds: list[int | socket.socket] = [f for f in (self._wake_r, reports) if f is not None and f != -1]
        if not fds:
            time.sleep(pause_s)
            return
        readable, _, _ = select.select(fds, [], [], pause_s)
        if reports in readable and self.server is not None:
            self.server.pump()
        if self._wake_r is not None and self._wake_r in readable:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass

    # ------------------------------------------------------------------ endings
    def _leave(self) -> None:
        """Before reaping (which can take seconds): the other agents must not take the silence for a death."""
        if self.liveness is None:
            return
        try:
            self.liveness.leave()
        except Exception:  # noqa: BLE001 - the store may be what went away
            pass

    def _end(self, code: int, message: str, **fields: object) -> int:
        self._leave()
        if code != 0:
            for agent in self.agents:
                agent.signal_all(signal.SIGKILL)
        for agent in self.agents:
            agent.stop_warm()  # a spare never taken over: its warm workers would outwait the reap
        self.events(message, event="end", exit_code=code, **fields)
        self._reap(timeout_s=10.0)
        self._linger()
        return code

    def _stop_on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self._leave()
        self.events(f"got {name}: stopping every worker", event="signal", signal=name)
        if self.remote_agents or not self.hosts_store:
            # Other hosts' agents must stop their workers too.
            try:
                self.control.abort(f"{name} to the launcher of {', '.join(a.name for a in self.agents)}")
            except Exception:  # noqa: BLE001 - the store may be what went away
                pass
        for agent in self.agents:
            agent.signal_all(signal.SIGTERM)
        if self._reap(timeout_s=TERM_GRACE_S):
            for agent in self.agents:
                agent.signal_all(signal.SIGKILL)
            self._reap(timeout_s=10.0)
        self._linger(timeout_s=2.0)
        return 128 + signum

    def _reap(self, timeout_s: float) -> list[int]:
        """Wait until every worker ended; returns the pids still alive after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [w.pid for agent in self.agents for w in agent.alive()]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(self.poll_s)

    def _linger(self, timeout_s: float = STORE_LINGER_S) -> None:
        """Multi-host: agents other than 0 say they saw the end; agent 0 waits for them before the store goes."""
        try:
            if not self.hosts_store:
                self.control.ack_exit()
                lost = self.store.add("launch/lost_agents", 0)
                if self.clear_after:
                    self.store.write_record(ended=True)  # collected by the next launch if not cleared here
                if self.clear_after and self.control.exits() >= self.clear_after - lost:
                    self.store.clear()  # the last agent out: a shared etcd keeps no finished job's keys
            elif self.remote_agents:
                deadline = time.monotonic() + timeout_s
                while self.control.exits() < self.remote_agents and time.monotonic() < deadline:
                    time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the job is over; a vanished store changes nothing
            pass

    def _kill_everything(self) -> None:
        for agent in self.agents:
            agent.signal_all(signal.SIGKILL)
        alive = self._reap(timeout_s=10.0)
        if alive:
            say(f"could not reap pids {alive}", level=logging.WARNING, name=__name__, prefix="ds-swift-launch")


def _describe(args: LaunchArgs, where: str) -> str:
    parts = [f"{args.nnodes} machine(s) x {args.nproc_per_node} rank(s)", f"{args.spares} spare(s)"]
    if args.restart_delay_s is not None:
        parts.append(f"restart after {args.restart_delay_s:g} s")
    if args.elastic:
        parts.append("elastic (no spare left: go on without the failed machine)")
    parts.append(f"max {args.max_failures} failure(s)")
    if args.inject:
        parts.append("inject " + "; ".join(str(s) for s in args.inject))
    if args.job_id:
        parts.append(f"SLURM job {args.job_id}")
    return f"job store {where}; " + ", ".join(parts) + f"; run dir {args.run_dir}"


def _open_store(args: LaunchArgs, token: str) -> tuple[JobStore, str, int, bool]:
    """(store, address and port for the workers' MASTER_ADDR/PORT, whether this process hosts it)."""
    launch = args.launch_id
    if args.store_url is not None:
        # An agent that pdsh/ssh started without a launch id joins the one its launcher began.
        join = launch is None and args.multi_host
        store = JobStore.open(
            args.store_url,
            token,
            create=not join,
            secret=args.job_secret,
            launch=launch,
            credentials=args.store_credentials,
            wait_s=30.0 if join else 0.0,
        )
        host, port = StoreURL.parse(args.store_url).endpoints[0]
        return store, host, port, False
    if args.node_rank is None:
        store = JobStore.host(
            token, port=args.master_port or 0, addr="127.0.0.1", secret=args.job_secret, launch=launch
        )
        return store, "127.0.0.1", store.port, True
    if args.node_rank == 0:
        store = JobStore.host(
            token, port=args.master_port or 0, addr=args.master_addr, secret=args.job_secret, launch=launch
        )
        return store, args.master_addr, store.port, True
    assert args.master_port is not None
    # Started with the others (srun): the host agent may not have written the job's keys yet.
    store = JobStore.connect(
        args.master_addr, args.master_port, token, wait_s=30.0, secret=args.job_secret, launch=launch
    )
    return store, args.master_addr, args.master_port, False


def run(args: LaunchArgs, server: ForkServer | None = None) -> int:
    """Start the job described by ``args``; returns the launcher's exit code.

    ``server``: the ``--fork-server`` server, already started and owned (closed) by the caller:
    ds-swift-launch starts it before it imports torch; None: workers are started as processes."""
    if args.launcher in ("pdsh", "ssh"):
        from .remote import run_remote

        return run_remote(args)
    events = EventLog(args.run_dir, node=args.node_rank)
    token = args.job_token or secrets.token_hex(16)
    try:
        store, addr, port, hosts_store = _open_store(args, token)
    except (MembershipError, RuntimeError, OSError) as exc:
        where = args.store_url or f"{args.master_addr}:{args.master_port}"
        print(f"ds-swift-launch: error: job store at {where}: {exc}", file=sys.stderr)
        return 1
    nodes = list(range(args.num_agents)) if args.node_rank is None else [args.node_rank]
    remote = args.num_agents - 1 if hosts_store and args.node_rank == 0 else 0
    job = JobSpec.from_args(args, addr, port, token, store_url=args.store_url or "", launch=store.launch)
    where = "simulated on this host" if args.node_rank is None else f"this host is agent {args.node_rank}"
    events(
        _describe(args, args.store_url or f"{addr}:{port}") + f" ({where}, launch {store.launch})",
        event="start",
        store_port=port,
        launch=store.launch,
    )
    for launch, why in store.collected:
        events(
            f"deleted the keys of dead launch {launch} of this job ({why})",
            event="launch_collected",
            launch=launch,
            why=why,
        )
    # --fork-server: one pre-imported interpreter forks every worker of this process's agents.
    if server is not None:
        try:
            server.wait_ready()
        except OSError as exc:
            print(f"ds-swift-launch: error: --fork-server: {exc}", file=sys.stderr)
            return 1
    spawn, warm_start = (spawn_worker, spawn_warm) if server is None else (server.spawn, server.spawn_warm)
    agents = [MachineAgent(node, job, store, events, spawn=spawn, warm_start=warm_start) for node in nodes]
    liveness = None
    if args.node_rank is not None:
        liveness = AgentLiveness(store, nodes, args.num_agents, args.agent_timeout_s)
    clear_after = 0 if args.store_url is None else (1 if args.node_rank is None else args.num_agents)
    supervisor = Supervisor(
        agents,
        store,
        events,
        args.nnodes,
        hosts_store=hosts_store,
        remote_agents=remote,
        liveness=liveness,
        clear_after=clear_after,
        inject=args.inject if args.node_rank in (None, 0) else (),
        server=server,
    )
    return supervisor.run()
