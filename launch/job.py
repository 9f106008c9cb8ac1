"""What every node agent knows about the job (the same on every host), and what it tells each worker: :class:`JobSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ds_swift.jobstore.url import StoreCredentials
from ds_swift.jobstore.worker_env import WorkerEnv
from ds_swift.testing.faults import FaultSpec, format_specs

from .args import Command, LaunchArgs

__all__ = ["JobSpec"]


@dataclass(frozen=True)
class JobSpec:
    """What every agent knows about the job (the same on every host)."""

    command: Command
    num_machines: int
    nproc_per_node: int
    num_spares: int
    max_failures: int
    restart_delay_s: float | None
    store_addr: str
    store_port: int
    token: str
    run_dir: str
    inject: tuple[FaultSpec, ...] = ()
    op_timeout_s: float | None = None
    store_url: str = ""
    """``etcd://...`` or ``tcp://...`` when no agent hosts the store (workers get it as SWIFT_STORE_URL)."""
    warm_spares: bool = False
    """Spares keep warm workers (ds-swift-launch: on unless ``--cold-spares``)."""
    secret: str = field(default="", repr=False)
    elastic: bool = False
    """With no spare left, the job goes on without a failed machine (``--elastic``)."""
    launch: str = ""
    """The launch id (:mod:`ds_swift.jobstore.signed_kv`): workers use that launch's keys only."""
    store_credentials: StoreCredentials = field(default_factory=StoreCredentials, repr=False)
    agent_timeout_s: float = 10.0
    """``--agent-timeout``: workers wait that long for a dead agent's machine to be declared."""

    @classmethod
    def from_args(
        cls, args: LaunchArgs, store_addr: str, store_port: int, token: str, store_url: str = "", launch: str = ""
    ) -> JobSpec:
        return cls(
            command=args.command,
            num_machines=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            num_spares=args.spares,
            max_failures=args.max_failures,
            restart_delay_s=args.restart_delay_s,
            store_addr=store_addr,
            store_port=store_port,
            token=token,
            run_dir=args.run_dir,
            inject=args.inject,
            op_timeout_s=args.op_timeout_s,
            store_url=store_url,
            warm_spares=not args.cold_spares,
            secret=args.job_secret,
            elastic=args.elastic,
            launch=launch,
            store_credentials=args.store_credentials,
            agent_timeout_s=args.agent_timeout_s,
        )

    @property
    def world_size(self) -> int:
        return self.num_machines * self.nproc_per_node

    def ranks(self, machine: int) -> range:
        return range(machine * self.nproc_per_node, (machine + 1) * self.nproc_per_node)

    def worker_envs(
        self, machine: int, generation: int, replacement: bool, layout: list[int] | None = None
    ) -> list[WorkerEnv]:
        """What each of ``machine``'s workers is told (its environment), for ``generation``.

        Args:
            layout: the job's machines in rank order once an elastic grow changed them (None: all
                machines, in order): the machine's ranks follow from its place in it.
        """
        inject = format_specs(self.inject)
        ranks, world = self.ranks(machine), self.world_size
        if layout is not None:  # an elastic grow: the machine's place in the job's layout
            n = self.nproc_per_node
            position = layout.index(machine)
            ranks, world = range(position * n, (position + 1) * n), len(layout) * n
        return [
            WorkerEnv(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                machine=machine,
                num_machines=self.num_machines,
                generation=generation,
                replacement=replacement,
                store_addr=self.store_addr,
                store_port=self.store_port,
                token=self.token,
                run_dir=self.run_dir,
                inject=inject,
                store_url=self.store_url,
                secret=self.secret,
                launch=self.launch,
                store_credentials=self.store_credentials,
                agent_timeout_s=self.agent_timeout_s,
            )
            for local_rank, rank in enumerate(ranks)
        ]
