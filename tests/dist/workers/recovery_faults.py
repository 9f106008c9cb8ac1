"""The faults of tests/dist/workers/gpt_fault_worker.py in a recovery's own path, mostly for
logging-based recovery (tests/dist/test_recovery_logging.py):

- every rank prints ``[test] rank R (original|replacement): load_checkpoint TAG`` whenever DeepSpeed
  loads a checkpoint (survivors of a logging-based recovery must never print it);
- ``SWIFT_TEST_CORRUPT_LOG="rank=R,iteration=I,micro_batch=M[,src=S]"``: rank R, when it opens the
  message log for a replay and the log holds it, flips one payload byte of the activation (I, M)
  stage S sent (once per job): the replay must fail on its checksum and every rank fall back to
  the global checkpoint;
- ``SWIFT_TEST_TRUNCATE_LOG`` (same form): instead, cuts the chunk file holding that activation in the
  middle of its record (a write or an upload cut short); ``SWIFT_TEST_MISSING_LOG``: deletes the
  chunk and its index (storage lost them). Either way the replay must refuse the log and fall back;
- ``SWIFT_TEST_PERTURB_LOG="rank=R,iteration=I,micro_batch=M[,src=S]"``: the same, but instead of
  flipping a byte it adds 1 to the first element of that activation and writes the checksums again
  (record header and index entry): the log reader accepts it, the replay runs on a wrong message,
  and only the digest check (verified recovery) can tell;
- ``SWIFT_TEST_KILL_IN_REPLAY="rank=R,iteration=I"``: replacement rank R SIGKILLs itself when its
  replay reaches iteration I (once per job): a cascading failure during the recovery;
- ``SWIFT_TEST_CORRUPT_CKPT="rank=R,iteration=I"``: rank R, the first time it loads the global
  checkpoint of I iterations (a checkpoint fallback), overwrites the first optimizer-state file of
  its own it opens there with garbage first: a corrupt file of one rank (once per job);
  ``SWIFT_TEST_MISSING_CKPT`` (same form): deletes that file instead;
- ``SWIFT_TEST_KILL_IN_RECV_STATE="rank=R"``: replacement rank R SIGKILLs itself in the middle of
  receiving its state from a buddy copy (the manifest in, the tensors not; once per job), and
  ``SWIFT_TEST_KILL_IN_SEND_STATE="rank=R"``: rank R, a survivor, SIGKILLs itself in the middle of
  sending one: a peer vanishing mid-transfer, on either end;
- ``SWIFT_TEST_KILL_IN_LOG_WRITE="rank=R,iteration=I"``: rank R SIGKILLs itself in the middle of
  writing the first record of iteration I to its message log (half the record on disk: a torn
  tail its replacement's writer must cut off before it logs again);
- ``SWIFT_TEST_KILL_IN_SAVE="rank=R,iteration=I"``: rank R SIGKILLs itself when the periodic global
  checkpoint after I iterations starts (once per job), leaving the others in DeepSpeed's save;
- ``SWIFT_TEST_HOLD_RECORD="machine=M,iteration=I"`` (strategy tranlogs): in generation 0, the
  update-log writer of each rank of machine M blocks on its record of iteration I until the rank is
  killed, so the record is never stored. A rank lost in iteration I + 1's forward or backward passes
  (its step, which waits for the record, never comes) then lacks the record of I every survivor
  stepped: the race ds_swift/protect/update_logger.py describes, made certain.

The worker imports this module from its own directory and installs these faults (``patch_*``,
``corrupt_on_load``) before the example starts.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import log_faults  # tests/dist/workers/log_faults.py: this script's directory is on sys.path

import ds_swift.recovery.replay.engine as replay_module
import ds_swift.recovery.replay.runner as logging_recovery
from ds_swift.runtime.context import current_context


def fault_spec(name: str) -> dict[str, int]:
    """The variable ``name`` (``k=v,...`` of integers) as a dict; empty if it is not set."""
    text = os.environ.get(name, "")
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def _once(key: str) -> bool:
    """True for the first caller in the job (the job store's counter)."""
    ctx = current_context()
    return ctx is not None and ctx.store is not None and ctx.store.add(f"test/{key}", 1) == 1


def patch_logging_recovery(rank: int) -> None:
    import deepspeed

    load = deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint
    who = "replacement" if os.environ.get("SWIFT_REPLACEMENT") == "1" else "original"

    def load_checkpoint(self: Any, load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        sys.stderr.write(f"[test] rank {rank} ({who}): load_checkpoint {tag}\n")  # one write: lines stay whole
        sys.stderr.flush()
        return load(self, load_dir, tag, *args, **kwargs)

    deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
    kill = fault_spec("SWIFT_TEST_KILL_IN_REPLAY")
    corrupt, change = {}, log_faults.corrupt
    for name, how in (
        ("SWIFT_TEST_CORRUPT_LOG", log_faults.corrupt),
        ("SWIFT_TEST_PERTURB_LOG", log_faults.perturb),
        ("SWIFT_TEST_TRUNCATE_LOG", log_faults.truncate),
        ("SWIFT_TEST_MISSING_LOG", log_faults.delete),
    ):
        if fault_spec(name):
            corrupt, change = fault_spec(name), how
    if corrupt and corrupt["rank"] == rank:
        open_reader = logging_recovery._open_reader

        def open_and_corrupt(rt: Any) -> Any:
            ctx = current_context()
            store = ctx.store if ctx is not None else None
            if store is not None and store.get("test/corrupted") is None:
                if change(rt.storage, corrupt["iteration"], corrupt["micro_batch"], corrupt.get("src")):
                    store.set("test/corrupted", "1")  # once per job: the next replay reads what was re-logged
            return open_reader(rt)

        logging_recovery._open_reader = open_and_corrupt  # type: ignore[assignment]
    if kill and kill["rank"] == rank:
        run_iteration = replay_module._run_iteration

        def run_or_die(engine: Any, batch_fn: Any, plan: Any, iteration: int) -> None:
            if iteration == kill["iteration"] and _once("kill_in_replay"):
                print(f"[test] rank {rank}: SIGKILL while replaying iteration {iteration}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            run_iteration(engine, batch_fn, plan, iteration)

        replay_module._run_iteration = run_or_die  # type: ignore[assignment]
    in_save = fault_spec("SWIFT_TEST_KILL_IN_SAVE")
    if in_save and in_save["rank"] == rank:
        from ds_swift.checkpoint.periodic import CheckpointManager

        save = CheckpointManager.save

        def save_or_die(self: Any, engine: Any) -> str:
            if int(engine.global_steps) == in_save["iteration"] and _once("kill_in_save"):
                print(
                    f"[test] rank {rank}: SIGKILL in the checkpoint of iteration {in_save['iteration']}",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            return save(self, engine)

        CheckpointManager.save = save_or_die  # type: ignore[method-assign]


def patch_state_transfer(rank: int) -> None:
    import ds_swift.recovery.state.transfer as buddy  # hand_over, which every strategy's transfer goes through
    from ds_swift import transport

    def dying(op: Any, what: str) -> Any:
        """``op`` (the transport's send or recv) that SIGKILLs this process after the first two calls."""
        calls = [0]

        def call(*args: Any, **kwargs: Any) -> Any:
            if calls[0] == 2 and _once("kill_in_transfer"):
                print(f"[test] rank {rank}: SIGKILL in the middle of {what} a state", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            calls[0] += 1
            return op(*args, **kwargs)

        return call

    recv = fault_spec("SWIFT_TEST_KILL_IN_RECV_STATE")
    if recv and recv["rank"] == rank and os.environ.get("SWIFT_REPLACEMENT") == "1":
        recv_state = buddy.recv_state
        buddy.recv_state = lambda src, group=None, recv=None: recv_state(  # type: ignore[assignment]
            src, group, dying(recv or transport.recv, "receiving")
        )
    send = fault_spec("SWIFT_TEST_KILL_IN_SEND_STATE")
    if send and send["rank"] == rank and os.environ.get("SWIFT_REPLACEMENT") != "1":
        send_state = buddy.send_state
        buddy.send_state = lambda state, dst, group=None, send=None: send_state(  # type: ignore[assignment]
            state, dst, group, dying(send or transport.send, "sending")
        )


def patch_log_write(rank: int) -> None:
    spec = fault_spec("SWIFT_TEST_KILL_IN_LOG_WRITE")
    if not spec or spec["rank"] != rank or os.environ.get("SWIFT_REPLACEMENT") == "1":
        return
    from ds_swift.msglog import writer

    append = writer.ChunkWriter.append

    def append_or_die(self: Any, header: Any, payload: Any) -> Any:
        # On the writer thread; generation 0 of this process only, so no job-wide "once" is needed.
        if header.iteration == spec["iteration"]:
            record = header.pack(0) + payload.numpy().tobytes()
            os.write(self.fd, record[: len(record) // 2])
            print(
                f"[test] rank {rank}: SIGKILL in the middle of writing a log record of iteration "
                f"{header.iteration} to {self.path.name}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        return append(self, header, payload)

    writer.ChunkWriter.append = append_or_die  # type: ignore[method-assign]


def patch_update_record_hold(rank: int) -> None:
    spec = fault_spec("SWIFT_TEST_HOLD_RECORD")
    if not spec or int(os.environ["SWIFT_MACHINE"]) != spec["machine"] or os.environ.get("SWIFT_REPLACEMENT") == "1":
        return
    import threading

    from ds_swift.protect.update_logger import UpdateLogger

    write, never = UpdateLogger._do, threading.Event()

    def held(self: UpdateLogger, item: tuple[str, Any]) -> None:
        kind, arg = item
        if kind == "record" and arg.iteration == spec["iteration"]:
            print(
                f"[test] rank {rank}: holding the update record of iteration {arg.iteration}",
                file=sys.stderr,
                flush=True,
            )
            never.wait()
        write(self, item)

    UpdateLogger._do = held  # type: ignore[method-assign]


def corrupt_on_load(rank: int, iteration: int, delete: bool) -> None:
    import torch

    original = torch.load
    done = [False]

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        path = str(f)
        if not done[0] and f"global_step{iteration}" in path and "optim_states" in path and _once("corrupt_ckpt"):
            done[0] = True
            if delete:
                Path(path).unlink()
            else:
                Path(path).write_bytes(b"garbage, not a checkpoint" * 64)
            print(f"[test] rank {rank}: {'deleted' if delete else 'corrupted'} {path}", file=sys.stderr, flush=True)
        return original(f, *args, **kwargs)

    torch.load = load  # type: ignore[assignment]
