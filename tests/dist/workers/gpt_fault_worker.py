"""examples/pretrain_gpt.py with faults placed more precisely than ``--inject`` can (test helper).

In generation 0 only (replacements never fault):

- ``SWIFT_TEST_STALL="rank=R,iteration=I"``: rank R stops at the start of iteration I's
  ReduceGrads (before its gradient all-reduce) until its agent kills it;
- ``SWIFT_TEST_KILL_AFTER_STEP="rank=R,iteration=I"``: rank R SIGKILLs itself right after its
  optimizer step of iteration I;
- ``SWIFT_TEST_PAUSE="rank=R,iteration=I,seconds=S"``: rank R stops (SIGSTOP: every thread, its
  watchdog's heartbeats too) at iteration I's first forward pass, and a child of its own sends it
  SIGCONT S seconds later: a slow machine, not a dead one (a stall; issue 30);
- ``SWIFT_TEST_DEAF_RECV="rank=R"``: rank R never raises at the failure flag after a pipeline receive
  (as a rank whose receive returned just before the flag was set): it goes on into the next forward
  pass while its tensor-parallel peer leaves (tests/dist/test_recovery_tp.py).

``SWIFT_TEST_CPU_FP16=1``: fp16 allowed on DeepSpeed's CPU accelerator (ds_swift.patches.cpu_fp16).

``SWIFT_TEST_HOLD_FOR_GROW="iteration=I"`` (an elastic grow, tests/dist/test_elastic.py): after the
first rebuild, rank 0 waits at iteration I's first forward pass until the generation ends (the
returning machine's ranks have started and its agent ended it), so that the grow lands mid-job
however long their start takes.

``SWIFT_TEST_NAN_LOSS="rank=R,iteration=I"`` (the post-recovery guard, tests/dist/test_guard_after_restore.py):
rank R, a last-stage rank, on an engine built after a recovery, makes iteration I's reported loss
NaN (once per process): every rank then sees NaN (DeepSpeed averages it over the replicas and
broadcasts it down the pipeline).

And after every recovery, with ``SWIFT_TEST_DUMP_DIR=DIR``, every rank saves the state it resumes
from as a DeepSpeed checkpoint ``DIR/recovered_gen<g>`` (what an undo left, before any further
training amplifies its rounding).

For logging-based recovery (tests/dist/test_recovery_logging.py):

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
  checkpoint after I iterations starts (once per job), leaving the others in DeepSpeed's save.

Together (R=2 stalls, R=3 dies after its step, both on machine 1) they make the update-undo case
deterministic: rank 3's replica (rank 1) completed the step's collectives with rank 3 and stepped
iteration I, rank 2's replica (rank 0) never got rank 2's gradients and did not. ``--inject``
kills the first rank of a machine to reach a phase, and its agent kills the rest some 50-100 ms
later: whether the second rank finished its all-reduce by then is a race.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import log_faults  # tests/dist/workers/log_faults.py: this script's directory is on sys.path

import ds_swift.recovery.replay.engine as replay_module
import ds_swift.recovery.replay.runner as logging_recovery
from ds_swift.patches.instructions import hook_instructions, schedule
from ds_swift.runtime.context import current_context
from ds_swift.runtime.engine import SwiftPipelineEngine
from ds_swift.runtime.hooks import EngineHooks

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"


def _spec(name: str) -> dict[str, int]:
    text = os.environ.get(name, "")
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def _once(key: str) -> bool:
    """True for the first caller in the job (the job store's counter)."""
    ctx = current_context()
    return ctx is not None and ctx.store is not None and ctx.store.add(f"test/{key}", 1) == 1



def _patch_logging_recovery(rank: int) -> None:
    import deepspeed

    load = deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint
    who = "replacement" if os.environ.get("SWIFT_REPLACEMENT") == "1" else "original"

    def load_checkpoint(self: Any, load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        sys.stderr.write(f"[test] rank {rank} ({who}): load_checkpoint {tag}\n")  # one write: lines stay whole
        sys.stderr.flush()
        return load(self, load_dir, tag, *args, **kwargs)

    deepspeed.runtime.engine.DeepSpeedEngine.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
    kill = _spec("SWIFT_TEST_KILL_IN_REPLAY")
    corrupt, change = {}, log_faults.corrupt
    for name, how in (("SWIFT_TEST_CORRUPT_LOG", log_faults.corrupt), ("SWIFT_TEST_PERTURB_LOG", log_faults.perturb),
                      ("SWIFT_TEST_TRUNCATE_LOG", log_faults.truncate),
                      ("SWIFT_TEST_MISSING_LOG", log_faults.delete)):
        if _spec(name):
            corrupt, change = _spec(name), how
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
    in_save = _spec("SWIFT_TEST_KILL_IN_SAVE")
    if in_save and in_save["rank"] == rank:
        from ds_swift.checkpoint.periodic import CheckpointManager

        save = CheckpointManager.save

        def save_or_die(self: Any, engine: Any) -> str:
            if int(engine.global_steps) == in_save["iteration"] and _once("kill_in_save"):
                print(f"[test] rank {rank}: SIGKILL in the checkpoint of iteration {in_save['iteration']}",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return save(self, engine)

        CheckpointManager.save = save_or_die  # type: ignore[method-assign]


def _patch_state_transfer(rank: int) -> None:
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

    recv = _spec("SWIFT_TEST_KILL_IN_RECV_STATE")
    if recv and recv["rank"] == rank and os.environ.get("SWIFT_REPLACEMENT") == "1":
        recv_state = buddy.recv_state
        buddy.recv_state = lambda src, group=None, recv=None: recv_state(  # type: ignore[assignment]
            src, group, dying(recv or transport.recv, "receiving"))
    send = _spec("SWIFT_TEST_KILL_IN_SEND_STATE")
    if send and send["rank"] == rank and os.environ.get("SWIFT_REPLACEMENT") != "1":
        send_state = buddy.send_state
        buddy.send_state = lambda state, dst, group=None, send=None: send_state(  # type: ignore[assignment]
            state, dst, group, dying(send or transport.send, "sending"))


def _patch_log_write(rank: int) -> None:
    spec = _spec("SWIFT_TEST_KILL_IN_LOG_WRITE")
    if not spec or spec["rank"] != rank or os.environ.get("SWIFT_REPLACEMENT") == "1":
        return
    from ds_swift.msglog import writer

    append = writer.ChunkWriter.append

    def append_or_die(self: Any, header: Any, payload: Any) -> Any:
        # On the writer thread; generation 0 of this process only, so no job-wide "once" is needed.
        if header.iteration == spec["iteration"]:
            record = header.pack(0) + payload.numpy().tobytes()
            os.write(self.fd, record[: len(record) // 2])
            print(f"[test] rank {rank}: SIGKILL in the middle of writing a log record of iteration "
                  f"{header.iteration} to {self.path.name}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return append(self, header, payload)

    writer.ChunkWriter.append = append_or_die  # type: ignore[method-assign]


def _pause_hook(rank: int, iteration: int, seconds: int) -> Any:
    paused = [False]

    def pause_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
        if int(eng.global_steps) == iteration and not paused[0]:
            paused[0] = True
            print(f"[test] rank {rank}: stopped (SIGSTOP) for {seconds} s at iteration {iteration}", file=sys.stderr,
                  flush=True)
            # The waker is a separate process: a stopped process runs nothing of its own.
            subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            print(f"[test] rank {rank}: resumed (SIGCONT)", file=sys.stderr, flush=True)
        return call_next(**kw)

    return pause_hook


def _hold_hook(iteration: int) -> Any:
    held = [False]  # once: the forward passes after it run into the generation's end

    def hold_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
        import torch.distributed as dist

        ctx = current_context()
        if (int(eng.global_steps) == iteration and dist.get_rank() == 0 and ctx is not None and ctx.store is not None
                and not held[0]):
            held[0] = True
            g = ctx.store.generation()
            print(f"[test] rank 0: holding at iteration {iteration} until generation {g} ends", file=sys.stderr,
                  flush=True)
            deadline = time.monotonic() + 300
            while ctx.store.failure(g) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return call_next(**kw)

    return hold_hook


def _nan_hook(rank: int, iteration: int, fired: list[bool]) -> Any:
    def nan_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
        result = call_next(**kw)
        if int(eng.global_steps) == iteration and eng.is_last_stage() and not fired[0]:
            fired[0] = True  # the later micro-batches add to NaN: the iteration's loss is NaN
            eng.total_loss = eng.total_loss * float("nan")
            print(f"[test] rank {rank}: NaN loss at iteration {iteration}", file=sys.stderr, flush=True)
        return result

    return nan_hook


def _corrupt_on_load(rank: int, iteration: int, delete: bool) -> None:
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


def main() -> None:
    stall, kill = _spec("SWIFT_TEST_STALL"), _spec("SWIFT_TEST_KILL_AFTER_STEP")
    pause = _spec("SWIFT_TEST_PAUSE")
    rank = int(os.environ["RANK"])
    for name, delete in (("SWIFT_TEST_CORRUPT_CKPT", False), ("SWIFT_TEST_MISSING_CKPT", True)):
        spec = _spec(name)
        if spec and spec["rank"] == rank:
            _corrupt_on_load(rank, spec["iteration"], delete)
    deaf = _spec("SWIFT_TEST_DEAF_RECV")
    if deaf and deaf["rank"] == rank and os.environ.get("SWIFT_REPLACEMENT") != "1":
        from ds_swift.detect.monitor import FailureMonitor

        FailureMonitor.check_after_receive = lambda self, received=None: None  # type: ignore[method-assign]
    _patch_logging_recovery(rank)
    _patch_state_transfer(rank)
    _patch_log_write(rank)
    original = EngineHooks.install
    installs = [0]

    hold = _spec("SWIFT_TEST_HOLD_FOR_GROW")
    nan, nan_fired = _spec("SWIFT_TEST_NAN_LOSS"), [False]

    def install(self: Any, engine: Any) -> None:
        original(self, engine)
        installs[0] += 1
        if hold and installs[0] == 2 and os.environ.get("SWIFT_REPLACEMENT") != "1":
            self.add(hook_instructions(engine, "test.hold", {schedule.ForwardPass: _hold_hook(hold["iteration"])}))
        if nan and nan["rank"] == rank and (installs[0] > 1 or os.environ.get("SWIFT_REPLACEMENT") == "1"):
            self.add(hook_instructions(engine, "test.nan", {schedule.ForwardPass: _nan_hook(rank, nan["iteration"],
                                                                                            nan_fired)}))
        if os.environ.get("SWIFT_REPLACEMENT") == "1" or installs[0] > 1:
            return  # generation 0 only: later engines are rebuilt after a recovery
        hooks = {}
        if stall and stall["rank"] == rank:

            def stall_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
                if int(eng.global_steps) == stall["iteration"]:
                    print(f"[test] rank {rank}: stalling before ReduceGrads of iteration {stall['iteration']}",
                          file=sys.stderr, flush=True)
                    time.sleep(300)
                return call_next(**kw)

            hooks[schedule.ReduceGrads] = stall_hook
        if pause and pause["rank"] == rank:
            hooks[schedule.ForwardPass] = _pause_hook(rank, pause["iteration"], pause["seconds"])
        if kill and kill["rank"] == rank:

            def kill_hook(eng: Any, call_next: Any, **kw: Any) -> Any:
                iteration = int(eng.global_steps)
                result = call_next(**kw)
                if iteration == kill["iteration"]:
                    print(f"[test] rank {rank}: SIGKILL after the step of iteration {iteration}",
                          file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return result

            hooks[schedule.OptimizerStep] = kill_hook
        if hooks:
            self.add(hook_instructions(engine, "test.faults", hooks))

    EngineHooks.install = install  # type: ignore[method-assign]
    dump_dir = os.environ.get("SWIFT_TEST_DUMP_DIR")
    if dump_dir:
        resume = SwiftPipelineEngine._resume

        def resume_and_dump(self: Any, *args: Any, **kwargs: Any) -> None:
            resume(self, *args, **kwargs)
            self.engine.save_checkpoint(dump_dir, tag=f"recovered_gen{self.generation}")

        SwiftPipelineEngine._resume = resume_and_dump  # type: ignore[method-assign]
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    if os.environ.get("SWIFT_TEST_CPU_FP16"):
        from ds_swift.patches.cpu_fp16 import allow_cpu_fp16

        with allow_cpu_fp16():
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    else:
        runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
