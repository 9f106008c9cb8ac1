"""The replay's side of the message log: prefetching the records it needs, and progress reports.

:class:`LogFeeder` reads the records of a replay's inbound edges in a background thread, up to
``ahead`` iterations in advance (download and checksum of chunk k+1 while chunk k is replayed);
:func:`chunks_needed` checks by name only (nothing downloaded) that the log covers the iterations
to replay, so a gap is found before anything is loaded. A missing or corrupt record surfaces as
:class:`LogUnavailable`, naming the chunk file and record: the caller falls back to the global
checkpoint, loudly.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from ds_swift.msglog.edge import LogEdge

__all__ = [
    "LogFeeder",
    "LogUnavailable",
    "Message",
    "ProgressFn",
    "ReplayProgress",
    "await_progressing",
    "chunks_needed",
    "rich_progress",
    "text_progress",
]

Message = torch.Tensor | tuple[torch.Tensor, ...]


class LogUnavailable(RuntimeError):
    """A message the replay needs is missing from the log or corrupt: fall back to the global checkpoint.

    Attributes name what was asked for; ``file`` is the chunk file involved, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        iteration: int | None = None,
        micro_batch: int | None = None,
        edge: LogEdge | None = None,
        file: str | None = None,
    ) -> None:
        super().__init__(message)
        self.iteration = iteration
        self.micro_batch = micro_batch
        self.edge = edge
        self.file = file


# ----------------------------------------------------------------------------- log prefetch
def chunks_needed(reader: Any, edges: Sequence[LogEdge], start: int, end: int) -> dict[tuple[LogEdge, int], Any]:
    """(edge, iteration) -> ChunkName for ``start..end``, by name only (nothing downloaded).

    Raises LogUnavailable naming the edge, the iteration and what the log holds on a gap.
    """
    names = reader.chunk_names()
    found: dict[tuple[LogEdge, int], Any] = {}
    for edge in edges:
        mine = [cn for cn in names if cn.edge == edge]
        for it in range(start, end + 1):
            cn = next((c for c in mine if c.first_iteration <= it < c.end_iteration), None)
            if cn is None:
                have = sorted((c.first_iteration, c.end_iteration) for c in mine)
                raise LogUnavailable(
                    f"message log {reader.location}: no chunk of edge {edge} holds iteration {it} "
                    f"(replay needs {start}..{end}; chunks of this edge cover {have or 'nothing'})",
                    iteration=it,
                    edge=edge,
                )
            found[(edge, it)] = cn
    return found


@dataclass
class _Batch:
    iteration: int
    messages: dict[tuple[str, int], Message]
    nbytes: int


class LogFeeder:
    """Reads the records ``replay`` needs in a background thread, ``ahead`` iterations in advance.

    Only the feeder's thread touches ``reader`` (LogReader caches chunks without a lock).

    Args:
        reader: a ``ds_swift.msglog.LogReader``.
        edges: the logged edges into this rank.
        start, end: iterations to read, inclusive.
        micro_batches: messages per edge and iteration, or which ones (a parallel-recovery share).
        ahead: iterations buffered (None: one chunk span plus one, so chunk k+1 loads while k replays).
        timeout_s: the longest ``take`` waits for one iteration's records.
    """

    def __init__(
        self,
        reader: Any,
        edges: tuple[LogEdge, ...],
        start: int,
        end: int,
        micro_batches: int | Sequence[int],
        ahead: int | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.reader = reader
        self.edges = edges
        self.start, self.end = start, end
        self.micro_batches = tuple(range(micro_batches)) if isinstance(micro_batches, int) else tuple(micro_batches)
        self.timeout_s = timeout_s
        self.chunks = chunks_needed(reader, edges, start, end)
        spans = [cn.end_iteration - cn.first_iteration for cn in self.chunks.values()]
        self.ahead = ahead if ahead is not None else max(2, (max(spans) if spans else 1) + 1)
        self.bytes_read = 0  # payload bytes of the records handed to the replay
        self.chunk_bytes = 0  # chunk files loaded (downloaded, for a remote store)
        self.chunks_loaded = 0
        self.wait_s = 0.0
        self._queue: queue.Queue[_Batch | BaseException] = queue.Queue(maxsize=self.ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ds-swift-replay-feeder", daemon=True)
        self._thread.start()

    @property
    def chunks_total(self) -> int:
        return len(set(self.chunks.values()))

    def _run(self) -> None:
        from ds_swift.msglog.format import FormatError
        from ds_swift.msglog.reader import MissingRecordError

        loaded: set[str] = set()
        it, mb, edge, cn = self.start, None, None, None
        try:
            for it in range(self.start, self.end + 1):
                batch = _Batch(it, {}, 0)
                for edge in self.edges:
                    cn = self.chunks[(edge, it)]
                    mb = None
                    if cn.chunk_file not in loaded:
                        info = self.reader.chunk(cn)
                        loaded.add(cn.chunk_file)
                        self.chunk_bytes += int(info.size)
                        self.chunks_loaded += 1
                    for mb in self.micro_batches:
                        msg = self.reader.message(edge, it, mb)
                        batch.messages[(edge.kind, mb)] = msg
                        parts = msg if isinstance(msg, tuple) else (msg,)
                        batch.nbytes += sum(t.numel() * t.element_size() for t in parts)
                if not self._put(batch):
                    return
        except (MissingRecordError, FormatError, OSError) as exc:
            # FormatError covers CorruptRecordError; OSError a download that failed its checksum.
            where = f" micro-batch {mb}" if mb is not None else ""
            self._put(
                LogUnavailable(
                    f"cannot replay iteration {it}{where} ({edge}): {exc}",
                    iteration=it,
                    micro_batch=mb,
                    edge=edge,
                    file=str(self.reader.directory / cn.chunk_file) if cn is not None else None,
                )
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which re-raises it
            self._put(exc)

    def _put(self, item: _Batch | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def take(self, iteration: int) -> dict[tuple[str, int], Message]:
        """The messages of ``iteration`` ((kind, micro-batch) -> tensor or tuple); raises what the thread hit."""
        t0 = time.perf_counter()
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise LogUnavailable(
                f"message log {self.reader.location}: iteration {iteration} not read within {self.timeout_s:.0f} s",
                iteration=iteration,
            ) from None
        finally:
            self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later take raises it too
            raise item
        if item.iteration != iteration:
            raise RuntimeError(f"replay asked for iteration {iteration}, the feeder is at {item.iteration}")
        self.bytes_read += item.nbytes
        return item.messages

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout_s)


# ----------------------------------------------------------------------------- progress
@dataclass(frozen=True)
class ReplayProgress:
    """Passed to the progress callback at the start and after every replayed iteration."""

    rank: int
    iterations_done: int
    iterations_total: int
    iteration: int  # the next iteration to replay
    log_bytes_read: int
    chunks_loaded: int
    chunks_total: int
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        if self.iterations_done == 0:
            return None
        return self.elapsed_s / self.iterations_done * (self.iterations_total - self.iterations_done)


ProgressFn = Callable[[ReplayProgress], None]


def text_progress(stream: TextIO | None = None, every: int = 1) -> ProgressFn:
    """A progress callback printing one line per ``every`` iterations."""

    def show(p: ReplayProgress) -> None:
        if p.iterations_done % every and p.iterations_done != p.iterations_total:
            return
        eta = f", eta {p.eta_s:.1f} s" if p.eta_s is not None else ""
        print(
            f"[ds-swift] rank {p.rank}: replay {p.iterations_done}/{p.iterations_total} iterations, "
            f"{p.log_bytes_read / 1e6:.1f} MB of log, chunks {p.chunks_loaded}/{p.chunks_total}{eta}",
            file=stream or sys.stderr,
            flush=True,
        )

    return show


@contextmanager
def rich_progress(description: str = "replay") -> Iterator[ProgressFn]:
    """A ``rich`` progress bar (iterations, MB of log read); plain lines when rich is not installed."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        yield text_progress()
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[mb]:.1f} MB log"),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task(description, total=None, mb=0.0)

        def update(p: ReplayProgress) -> None:
            bar.update(task, completed=p.iterations_done, total=p.iterations_total, mb=p.log_bytes_read / 1e6)

        yield update


def await_progressing(
    store: Any, generation: int, replayers: Sequence[int], stall_timeout_s: float, timeout_s: float
) -> dict[int, str]:
    """Every replayer's ``replayed`` summary, while the replay moves: each window of
    ``stall_timeout_s`` in which no replayer's ``replay_progress`` changed (after the first: the
    checkpoint load) ends the generation as stalled, as does ``timeout_s`` in all. A dead replayer
    ends it sooner through the failure flag (``GenerationFailed`` from the gather)."""
    from ds_swift.jobstore.membership import GenerationFailed

    deadline = time.monotonic() + timeout_s
    seen: object = object()  # unlike any progress: the first window (the checkpoint load) always passes
    while True:
        window = max(0.0, min(stall_timeout_s, deadline - time.monotonic()))
        try:
            return store.gather(generation, "replayed", replayers, window)
        except TimeoutError:
            now = {r: store.get(f"gen{generation}/replay_progress/{r}") for r in replayers}
            in_time = time.monotonic() < deadline
            if now != seen and in_time:
                seen = now
                continue
            why = (
                f"the replay made no progress for {stall_timeout_s:.0f} s (iterations done per replaying rank: "
                f"{now}): a replayer stopped without dying"
                if in_time
                else f"the replay did not finish within {timeout_s:.0f} s"
            )
            store.declare_failure(generation, why)
            raise GenerationFailed(generation, why) from None
