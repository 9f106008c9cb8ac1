"""A stand-in training script for the launcher's tests: no DeepSpeed, no torch.distributed group.

It does what a ds-swift worker does around a failure, with the job store only: join the
generation, agree on the iteration to resume from, run "iterations" in lockstep (a store
barrier per iteration plays the collective, and like one it blocks until the failure flag
says the generation is dead), call the injector at each phase, and join the next generation
when the current one failed. Rank 0 writes what the test checks to ``--result`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ds_swift.jobstore.membership import GenerationFailed, JobStore, WorkerEnv
from ds_swift.testing.faults import Injector

PHASES = ("forward", "backward", "step")
TIMEOUT_S = 60.0


def barrier(store: JobStore, generation: int, name: str, world: int) -> None:
    key = f"gen{generation}/test/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + TIMEOUT_S
    while store.add(key, 0) < world:
        reason = store.failure(generation)
        if reason is not None:
            raise GenerationFailed(generation, reason)
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {key}")
        time.sleep(0.005)


def record_env(store: JobStore, env: WorkerEnv, local_rank_arg: int | None) -> None:
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "SWIFT_MACHINE",
        "SWIFT_NUM_MACHINES",
        "SWIFT_GENERATION",
        "SWIFT_REPLACEMENT",
        "SWIFT_INJECT",
        "SWIFT_RUN_DIR",
        "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_WORLD_SIZE",
        "SWIFT_OP_TIMEOUT_S",
        "TORCHELASTIC_USE_AGENT_STORE",
    )
    info: dict[str, object] = {k: os.environ.get(k) for k in keys}
    info.update(pid=os.getpid(), local_rank_arg=local_rank_arg)
    store.set(f"test/env/{env.generation}/{env.rank}", json.dumps(info))


def collect(store: JobStore, final_generation: int, world: int, n_inject: int) -> dict[str, object]:
    """Everything the test asserts on, read from the store before the launcher takes it down."""
    out: dict[str, object] = {"final_generation": final_generation, "generation": store.generation()}
    envs = {}
    for g in range(final_generation + 1):
        for r in range(world):
            value = store.get(f"test/env/{g}/{r}")
            if value is not None:
                envs[f"{g}/{r}"] = json.loads(value)
    out["envs"] = envs
    timeline = {}
    for g in range(final_generation + 1):
        for key in ("failed", "failed_machine", "t/detected", "t/declared", "t/replacement_spawned"):
            value = store.get(f"gen{g}/{key}")
            if value is not None:
                timeline[f"gen{g}/{key}"] = value
        for r in range(world):
            value = store.get(f"test/seen/{g}/{r}")
            if value is not None:
                timeline[f"test/seen/{g}/{r}"] = value
    for i in range(n_inject):
        for key in ("fired", "t_fire", "rank"):
            value = store.get(f"inject/{i}/{key}") if key != "fired" else str(store.add(f"inject/{i}/fired", 0))
            if value is not None:
                timeline[f"inject/{i}/{key}"] = value
    out["timeline"] = timeline
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--iter-sleep", type=float, default=0.0)
    p.add_argument("--result", default=None)
    p.add_argument(
        "--block",
        action="store_true",
        help="after start-up, block without touching the store (a rank stuck in a collective): "
        "only a signal ends it, not the job store going away",
    )
    p.add_argument(
        "--crash-once",
        default=None,
        metavar="MACHINE:ITERATION:CODE",
        help="exit with CODE at ITERATION on MACHINE, once per job (a crash, not a signal)",
    )
    args = p.parse_args()

    env = WorkerEnv.from_env()
    store = JobStore.from_env(env)
    pid_dir = Path(env.run_dir) / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / str(os.getpid())).write_text(f"{env.rank} {env.generation}\n")
    record_env(store, env, args.local_rank)
    if args.block:
        while True:
            time.sleep(1)
    injector = Injector.from_env(store, env)
    crash = tuple(int(x) for x in args.crash_once.split(":")) if args.crash_once else None

    world = env.world_size
    generation, iteration = env.generation, 0
    while True:
        try:
            store.join(generation, env.rank, world, timeout_s=TIMEOUT_S)
            store.publish(generation, "iter", env.rank, str(iteration))
            iteration = max(int(v) for v in store.gather(generation, "iter", range(world), TIMEOUT_S).values())
            while iteration < args.iters:
                for phase in PHASES:
                    injector.maybe_fire(phase, iteration)
                if crash and crash[0] == env.machine and crash[1] == iteration and store.add("test/crashed", 1) == 1:
                    print(f"store_worker rank {env.rank}: crashing with exit code {crash[2]}", file=sys.stderr)
                    return crash[2]
                if args.iter_sleep:
                    time.sleep(args.iter_sleep)
                barrier(store, generation, f"it{iteration}", world)
                iteration += 1
            barrier(store, generation, "end", world)
            break
        except GenerationFailed as exc:
            store.set(f"test/seen/{exc.generation}/{env.rank}", repr(time.time()))
            generation = exc.generation + 1
    if env.rank == 0 and args.result:
        result = collect(store, generation, world, len(injector.specs))
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.result)
    store.mark_done(env.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
