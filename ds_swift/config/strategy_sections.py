"""The ``swift`` config sub-sections that one recovery strategy reads (each names its strategy)."""

from __future__ import annotations

from dataclasses import dataclass

from ds_swift.config.checks import _check_type, _fail

__all__ = ["BuddyConfig", "CheckFreqConfig", "ElasticConfig", "PipeChurnConfig", "SimulateConfig"]


@dataclass(frozen=True)
class BuddyConfig:
    """Buddy copies of each rank's optimizer partition (ZeRO-1, BF16_Optimizer), for recovery
    without the checkpoint when a partition's machine fails (ds_swift.recovery.strategies.buddy)."""

    enabled: bool = True
    """Copy each rank's partition to its buddies after its step (every step, or every ``interval``-th:
    asynchronously, into their host memory). Has no effect where the optimizer state is not
    partitioned (a replica holds it)."""

    replication_factor: int = 1
    """How many buddies, each on another machine (and failure domain), hold each partition."""

    interval: int | str = "auto"
    """Copy after the steps of every ``interval``-th iteration only (iterations divisible by it).
    A copy per step costs a host copy and a send of the whole partition per iteration; with an
    interval, a lost rank's copy is up to ``interval`` steps old, and every rank then goes back to
    it (survivors bitwise, from their own copies of that iteration) and trains the iterations since
    again: fewer bytes per iteration, more iterations recomputed after a failure. ``"auto"`` (the
    default): a copy after every step for the first rounds of each generation, then the interval of
    1, 2, 5, 10, ... that leaves at least half a second, and twice a round's time, between rounds,
    from the step time rank 0 measured (ds_swift.protect.buddy_interval): a step of 0.5 s or more keeps
    a copy after every step. Strategy ``pipechurn`` keeps erasure-coded chunks after every step
    instead and refuses a number."""

    def __post_init__(self) -> None:
        _check_type("buddy.enabled", self.enabled, bool, "true or false")
        _check_type("buddy.replication_factor", self.replication_factor, int, "a positive integer")
        if self.replication_factor < 1:
            raise _fail(
                "buddy.replication_factor", self.replication_factor, "a positive integer (disable with enabled: false)"
            )
        allowed = '"auto" or a positive number of iterations (1: a copy after every step)'
        if self.interval != "auto":
            _check_type("buddy.interval", self.interval, int, allowed)
            if int(self.interval) < 1:
                raise _fail("buddy.interval", self.interval, allowed)

    @property
    def fixed_interval(self) -> int | None:
        """The configured interval, or None for ``"auto"``."""
        return None if self.interval == "auto" else int(self.interval)


@dataclass(frozen=True)
class PipeChurnConfig:
    """PipeChurn's erasure-coded in-memory checkpoints (strategy ``pipechurn``): after every step
    each rank's state is cut into ``data_chunks`` chunks plus ``parity_chunks`` Reed-Solomon parity
    chunks, held in host memory of as many other machines; any ``parity_chunks`` + 1 machine losses
    at once are recovered from the surviving chunks (a rank's own machine holds none of its chunks:
    ds_swift.recovery.state.erasure)."""

    data_chunks: int = 2
    """k: each holder keeps 1/k of the state (host memory per rank: (k + r)/k of its state, spread)."""

    parity_chunks: int = 1
    """r: each rank's chunks that may be lost. The job needs k + r machines besides each rank's own."""

    partial_recompute: bool = True
    """Only the passes of the iteration in flight that the failure lost run again (the lost ranks',
    and those survivors had not finished), fed by the survivors' kept sends (device memory: one
    iteration's sends and a gradient copy; ds_swift.recovery.state.inflight); false: every rank
    trains the iteration again."""

    def __post_init__(self) -> None:
        for name in ("data_chunks", "parity_chunks"):
            value = getattr(self, name)
            _check_type(f"pipechurn.{name}", value, int, "a positive integer")
            if value < 1:
                raise _fail(f"pipechurn.{name}", value, "a positive integer")
        _check_type("pipechurn.partial_recompute", self.partial_recompute, bool, "true or false")


@dataclass(frozen=True)
class SimulateConfig:
    """Nicolae et al.'s failure-simulation mode: a failure at ``iteration`` is simulated without
    killing anything, to measure an approximate strategy's effect on the model cheaply
    (ds_swift.runtime.failure_simulation). Off while ``iteration`` is null."""

    iteration: int | None = None
    """The iteration the simulated failure hits (null: off)."""

    strategy: str = "lossy_forward"
    """``lossy_forward``: that iteration averages only the surviving replicas' gradients (the
    ``casualties`` count as zero, from ``upto_layer`` down); ``immediate_rollback``: the ranks of
    ``stepped_stages`` keep that iteration's update, the others do not apply it (undone), and every
    rank trains it again."""

    casualties: tuple[int, ...] = ()
    """lossy_forward: the data-parallel replicas that fail (empty: the last one)."""

    upto_layer: int | None = None
    """lossy_forward: only the gradients of pipeline layers at or before this one are lost (the
    failure hit the backward pass there; later layers were reduced before it); null: every layer,
    what a real failure in DeepSpeed's pipeline loses (it reduces after the whole backward pass)."""

    stepped_stages: tuple[int, ...] = ()
    """immediate_rollback: the pipeline stages whose ranks had stepped when the failure hit."""

    def __post_init__(self) -> None:
        if self.iteration is not None:
            _check_type("simulate_failure.iteration", self.iteration, int, "null or an iteration number >= 0")
            if self.iteration < 0:
                raise _fail("simulate_failure.iteration", self.iteration, "null or an iteration number >= 0")
        # Whether it names a strategy with a simulation mode: ds_swift.recovery.registry.checked.
        _check_type("simulate_failure.strategy", self.strategy, str, "a registered strategy's name")
        if self.upto_layer is not None:
            _check_type("simulate_failure.upto_layer", self.upto_layer, int, "null or a pipeline layer index >= 0")
        for name in ("casualties", "stepped_stages"):
            value = getattr(self, name)
            _check_type(f"simulate_failure.{name}", value, (list, tuple), "a list of indices >= 0")
            for v in value:
                _check_type(f"simulate_failure.{name}", v, int, "a list of indices >= 0")
                if v < 0:
                    raise _fail(f"simulate_failure.{name}", value, "a list of indices >= 0")
            object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic shrink (strategy ``elastic``, Nicolae et al. section III-B): with no spare
    machine left (``ds-swift-launch --elastic``), the job goes on without the failed machine's
    data-parallel replicas instead of stopping (ds_swift.recovery.strategies.elastic)."""

    enabled: bool = False
    """Deprecated: write ``"strategy": "elastic"``. ``true`` with ``"strategy": "lossy_forward"`` (the
    configs written before elastic was a strategy of its own) still means strategy ``elastic``, with a
    warning."""

    global_batch: str = "keep"
    """``keep``: the global batch stays the same, each remaining replica accumulating more
    micro-batches (``gradient_accumulation_steps`` x dp / new dp; the same samples, the same
    update up to the summation order); ``shrink``: the accumulation stays, the global batch shrinks
    with the replicas (the casualties' samples are left out from then on)."""

    min_data_parallel: int = 1
    """Below this many data-parallel replicas the job stops instead of shrinking further."""

    def __post_init__(self) -> None:
        _check_type("elastic.enabled", self.enabled, bool, "true or false")
        if self.global_batch not in ("keep", "shrink"):
            raise _fail("elastic.global_batch", self.global_batch, '"keep" or "shrink"')
        _check_type("elastic.min_data_parallel", self.min_data_parallel, int, "an integer >= 1")
        if self.min_data_parallel < 1:
            raise _fail("elastic.min_data_parallel", self.min_data_parallel, "an integer >= 1")


@dataclass(frozen=True)
class CheckFreqConfig:
    """Strategy ``checkfreq``: asynchronous checkpoints at an interval chosen from measured costs
    (ds_swift.checkpoint.checkfreq); ``checkpoint.interval`` is then not used."""

    max_overhead: float = 0.05
    """The share of training time the checkpoint snapshots may take (CheckFreq's p)."""

    profile_at: int = 5
    """The first checkpoint, after this many iterations, measures the costs."""

    def __post_init__(self) -> None:
        _check_type("checkfreq.max_overhead", self.max_overhead, (int, float), "a fraction in (0, 1)")
        if not 0 < self.max_overhead < 1:
            raise _fail("checkfreq.max_overhead", self.max_overhead, "a fraction in (0, 1), e.g. 0.05")
        _check_type("checkfreq.profile_at", self.profile_at, int, "a positive number of iterations")
        if self.profile_at < 2:
            raise _fail("checkfreq.profile_at", self.profile_at, "at least 2 iterations (the first one warms up)")
