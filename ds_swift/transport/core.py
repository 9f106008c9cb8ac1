"""The transport of one generation: ds-swift's own process groups and the checked calls on them.

Which group a tensor goes on is decided here, from the tensor, never by the caller:

- a host tensor goes on a gloo group this module created with an explicit ``backend="gloo"``
  (one per channel: :data:`HOST` for the training thread's recoveries and agreements,
  :data:`COPIER` for the buddy copier thread, so two threads never share one gloo group), whose
  pairs of ranks connect lazily, at their first message (:func:`lazy_gloo`: no world-wide full mesh);
- a device tensor goes on the default group, which ``ds_swift.runtime.context`` makes NCCL
  wherever CUDA is present.

A caller may still name a group (``group=``); strict mode (:func:`strict_enabled`) then checks the
route: a host tensor on any group this module did not create as gloo (the world, DeepSpeed's
groups: NCCL on a GPU cluster, whatever they are in a CPU test) and a device tensor on a gloo group
(gloo moves CUDA tensors only in all_reduce and broadcast) raise :class:`StrictTransportError`.
Every call is recorded (op, channel, device) so a test can see what went where.

Values are agreed without pickle: JSON bytes in a uint8 tensor after an int64 length, decoded by
``json.loads`` (a peer's bytes can at worst be malformed, never run code here).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.threadname import threads_yield_on_wakeup
from ds_swift.transport.shutdown import parse_backends

__all__ = [
    "COPIER",
    "HOST",
    "STRICT_ENV",
    "Call",
    "StrictTransportError",
    "Transport",
    "TransportError",
    "route_problem",
    "set_strict",
    "strict_enabled",
]

HOST = "host"
"""Channel of the training thread: state transfers, buddy restores, resharding, agreements, barriers."""
COPIER = "copier"
"""Channel of the buddy copier thread (its rounds run while the training thread computes)."""
CHANNELS = (HOST, COPIER)
DEVICE = "device"
"""The default group, as the route of device tensors (NCCL on a GPU cluster)."""
STRICT_ENV = "SWIFT_STRICT_TRANSPORT"

_strict_override: bool | None = None


class TransportError(RuntimeError):
    """ds-swift's transport cannot serve a call (not open for this process group, a malformed value)."""


class StrictTransportError(TransportError):
    """A call that would fail on a GPU cluster (found by strict mode on CPU)."""


def set_strict(on: bool | None) -> None:
    """Turn strict mode on or off from code (None: follow ``SWIFT_STRICT_TRANSPORT`` again)."""
    global _strict_override
    _strict_override = on


def strict_enabled() -> bool:
    """Strict mode: set from code, else ``SWIFT_STRICT_TRANSPORT=1`` (the multi-process tests set it)."""
    if _strict_override is not None:
        return _strict_override
    return os.environ.get(STRICT_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def route_problem(op: str, device_type: str, channel: str | None) -> str | None:
    """Why sending a tensor on ``device_type`` over ``channel`` would fail on a GPU cluster (None: it
    would not). ``channel`` is one of the transport's gloo channels, or None for any other group
    (the world, DeepSpeed's): those are NCCL where CUDA is present."""
    host = device_type == "cpu"
    if host and channel is None:
        return (
            f"ds-swift transport: {op} of a host tensor on a group the transport did not create as gloo (the world "
            "or a DeepSpeed group, NCCL on a GPU cluster, where it would raise a backend error); leave group= unset "
            "so the transport picks its gloo group"
        )
    if not host and channel is not None:
        return (
            f"ds-swift transport: {op} of a {device_type} tensor on ds-swift's gloo group {channel!r} (gloo moves device "
            "tensors only in all_reduce and broadcast); leave group= unset so the transport picks the NCCL group, or "
            "copy the tensor to the host first"
        )
    return None


#: torch's switch for gloo groups that connect a pair of ranks at its first message (read when a
#: gloo group is created)
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def lazy_gloo() -> Iterator[None]:
    """The gloo groups created inside connect each pair of ranks only when it first exchanges a
    message. Created eagerly, a world-wide gloo group is a full mesh made at once through the job
    store: every rank writes its addresses, then waits for and reads every other rank's (3 N^2
    requests and O(N^3) bytes per group: 1.6 million requests per generation at 512 ranks); lazily,
    one write per rank, then one wait and read per pair that exchanges (buddies, pipeline neighbours,
    donor and replacement, a ring's neighbours): O(N). Only ds-swift's own groups: the world and
    DeepSpeed's keep torch's default (a user's TORCH_GLOO_LAZY_INIT stays as set)."""
    with _ENV_LOCK:
        previous = os.environ.get(LAZY_ENV)
        os.environ[LAZY_ENV] = "1"
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(LAZY_ENV, None)
            else:
                os.environ[LAZY_ENV] = previous


@dataclass(frozen=True)
class Call:
    """One recorded transport call."""

    op: str
    channel: str
    """HOST, COPIER, DEVICE (the default group) or "foreign" (a group named by the caller)."""
    device: str


class Transport:
    """ds-swift's process groups of one generation and the calls on them. Made by
    :func:`ds_swift.transport.open_generation`, collectively, on every rank.

    Args:
        world: the default process group it belongs to (a later generation has another).
        groups: channel name -> the gloo group created for it.
        world_backends: the world's backend names (``{"nccl"}`` on a GPU cluster).
    """

    def __init__(
        self, world: Any, groups: dict[str, Any], world_backends: frozenset[str] = frozenset({"gloo"})
    ) -> None:
        self.world = world
        self.world_backends = world_backends
        """The world's backends when the transport opened (read once: the watchdog thread asks)."""
        self.generation = -1
        """The generation it serves (-1: none named, e.g. without ds-swift-launch)."""
        self.aborted: str | None = None
        """Why ds-swift aborted (or is about to abort) this generation's device communicators; set
        before any abort (ds_swift.transport.on_generation_failed), never cleared: the generation's
        collectives are not trusted from then on."""
        self._groups = dict(groups)
        self._lock = threading.Lock()
        self.calls: collections.deque[Call] = collections.deque(maxlen=4096)
        """The newest calls (every call while strict mode is on; only its route is kept)."""
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        """(op, channel, device) -> how many calls, since the generation began."""

    @classmethod
    def create(cls, timeout_s: float | None = None) -> Transport:
        """Create the transport's gloo groups: a collective over every rank of the world, which each
        must call in the same order relative to its other ``new_group`` calls (torch names groups by
        a counter): right after the world is initialised, before DeepSpeed creates any group."""
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        world = dist.distributed_c10d._get_default_group()
        # The groups' gloo threads (a loop and two workers each, started here) carry the buddy copies
        # beside training: they must not preempt the training thread whenever a message comes in.
        with threads_yield_on_wakeup(), lazy_gloo():
            groups = {
                name: dist.new_group(backend="gloo", timeout=timeout, group_desc=f"ds_swift_{name}")
                for name in CHANNELS
            }
        return cls(world, groups, parse_backends(str(dist.get_backend(world))))

    # ------------------------------------------------------------------ routing
    @property
    def open(self) -> bool:
        return bool(self._groups)

    def group(self, channel: str = HOST) -> Any:
        """The gloo group of ``channel``."""
        g = self._groups.get(channel)
        if g is None:
            raise TransportError(
                f"ds-swift transport: channel {channel!r} is closed (the generation was torn down)"
                if not self._groups
                else f"ds-swift transport: no channel {channel!r}"
            )
        return g

    def _channel_of(self, group: Any) -> str | None:
        return next((name for name, g in self._groups.items() if g is group), None)

    def route(self, op: str, tensor: torch.Tensor, group: Any = None, channel: str = HOST) -> Any:
        """The group ``tensor`` goes on (see the module's docstring); records the call and, in strict
        mode, refuses a route that would fail on a GPU cluster."""
        device = tensor.device.type
        if group is None:
            group = self.group(channel) if device == "cpu" else self.world
        named = self._channel_of(group)
        recorded = named or (DEVICE if group is self.world and device != "cpu" else "foreign")
        strict = strict_enabled()
        with self._lock:
            self.counts[(op, recorded, device)] += 1
            if strict:
                self.calls.append(Call(op, recorded, device))
        if strict:
            problem = route_problem(op, device, named)
            if problem is not None:
                raise StrictTransportError(problem)
        return group

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, channel: str = HOST) -> None:
        dist.send(tensor, dst, group=self.route("send", tensor, group, channel), tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0, channel: str = HOST) -> None:
        dist.recv(tensor, src, group=self.route("recv", tensor, group, channel), tag=tag)

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, channel: str = HOST) -> Any:
        """Post a send; returns its work (``wait()`` it; keep ``tensor`` alive until then)."""
        return dist.isend(tensor, dst, group=self.route("isend", tensor, group, channel), tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0, channel: str = HOST) -> Any:
        return dist.irecv(tensor, src, group=self.route("irecv", tensor, group, channel), tag=tag)

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, channel: str = HOST) -> None:
        """Every rank's ``tensor`` into ``out`` (one per rank, same shape and dtype)."""
        dist.all_gather(out, tensor, group=self.route("all_gather", tensor, group, channel))

    def barrier(self, channel: str = HOST) -> None:
        """Every rank of the generation reaches this point (on the channel's gloo group)."""
        with self._lock:
            self.counts[("barrier", channel, "cpu")] += 1
        dist.barrier(group=self.group(channel))

    def all_gather_ints(self, values: Sequence[int], channel: str = HOST) -> list[list[int]]:
        """Every rank's ``values`` (the same count on every rank), as int64."""
        mine = torch.tensor(list(values), dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        self.all_gather(out, mine, channel=channel)
        return [[int(v) for v in t] for t in out]

    def all_gather_json(self, value: Any, channel: str = HOST) -> list[Any]:
        """Every rank's ``value`` (anything ``json.dumps`` takes), in rank order: length-prefixed JSON
        bytes in uint8 tensors, never pickle."""
        data = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
        lengths = [n for (n,) in self.all_gather_ints([len(data)], channel)]
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in lengths]
        self.all_gather(out, mine, channel=channel)
        values = []
        for rank, (t, n) in enumerate(zip(out, lengths, strict=True)):
            try:
                values.append(json.loads(t[:n].numpy().tobytes().decode()))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise TransportError(f"ds-swift transport: rank {rank} sent a malformed value ({exc})") from exc
        return values

    # ------------------------------------------------------------------ end
    def release(self) -> list[Any]:
        """Forget the groups (before they are destroyed: a group still referenced keeps its sockets
        open, and peers blocked on this rank then wait for the op timeout). Returns them."""
        groups, self._groups = list(self._groups.values()), {}
        return groups
