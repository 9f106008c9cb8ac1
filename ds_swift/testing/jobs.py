"""One training job under ``ds-swift-launch`` as a real process tree (tests, the demo, benchmarks).

Everything a job writes stays in its directory, whatever its config says::

    <dir>/ds_config.json  the config it ran with     <dir>/run/    launcher events, timelines
    <dir>/ckpt/           periodic global checkpoints <dir>/final/  --save (global_step<iterations>)
    <dir>/swift-logs/     the message log             <dir>/logs/   the launcher's output
    <dir>/loss.jsonl      --loss-log (when asked)

The launcher starts in its own session: on a deadline or any failure the whole tree (agents,
workers, replacements) is SIGKILLed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_swift.launch.fork_client import ZYGOTE_ENV
from ds_swift.recovery.verify import OWN_COPY
from ds_swift.testing.procs import ProcessSet, worker_env

__all__ = [
    "FORK_SERVER_ENV",
    "JobRun",
    "JobSpec",
    "JobTimeout",
    "assert_verified",
    "build_deepspeed_shm_op",
    "fork_zygote",
    "run_job",
]


#: "1": jobs run with ``--fork-server`` unless their spec says otherwise (tests/dist/conftest.py sets it)
FORK_SERVER_ENV = "SWIFT_TEST_FORK_SERVER"


@dataclass(frozen=True)
class JobSpec:
    """What to run: a training script (``examples/pretrain_gpt.py`` or one like it) and its config."""

    script: Path
    config: Path
    """The DeepSpeed JSON (with its ``swift`` section) the job's config is made from."""
    iterations: int
    launcher_args: Sequence[str] = ()
    """Extra ``ds-swift-launch`` flags (``--spares``, ``--inject``, ...)."""
    script_args: Sequence[str] = ()
    swift: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the ``swift`` section, merged one level deep (``{"checkpoint": {"interval": 1}}``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    nnodes: int = 2
    nproc_per_node: int = 2
    save: bool = True
    """Pass ``--save <dir>/final``: the final state is written as a checkpoint tag."""
    loss_log: bool = False
    """Pass ``--loss-log <dir>/loss.jsonl``."""
    fork_server: bool = field(default_factory=lambda: os.environ.get(FORK_SERVER_ENV) == "1")
    """Pass ``--fork-server`` (ranks forked from one pre-imported interpreter: about half the CPU of a
    job's start-up). Default: on where ``SWIFT_TEST_FORK_SERVER=1`` (the multi-process tests set it)."""


@dataclass
class JobRun:
    """One job's directory and, once it ran, how it ended."""

    dir: Path
    iterations: int
    code: int | None = None
    output: str = ""
    """The launcher's output (its workers' lines included)."""
    seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    pid: int | None = None
    """The launcher's process id (the root of the job's process tree), once started."""

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    @property
    def save_dir(self) -> Path:
        return self.dir / "final"

    @property
    def final_tag(self) -> Path:
        return self.save_dir / f"global_step{self.iterations}"

    @property
    def ckpt_dir(self) -> Path:
        return self.dir / "ckpt"

    @property
    def loss_log(self) -> Path:
        return self.dir / "loss.jsonl"

    @property
    def proc_logs(self) -> Path:
        return self.dir / "logs"

    @property
    def op_timeout_s(self) -> float:
        return float(self.config["swift"]["watchdog"]["op_timeout_s"])

    def timelines(self) -> list[dict[str, Any]]:
        """The recovery timelines the job wrote, one per recovered generation."""
        return [json.loads(p.read_text()) for p in sorted(self.run_dir.glob("timeline-gen*.json"))]


class JobTimeout(TimeoutError):
    """The job ran past its deadline and was killed."""

    def __init__(self, job: JobRun, timeout_s: float, tail: str) -> None:
        super().__init__(f"still running after {timeout_s:.0f} s (killed); see {job.proc_logs}\n{tail}")
        self.job, self.timeout_s, self.tail = job, timeout_s, tail


def job_config(spec: JobSpec, job: JobRun) -> dict[str, Any]:
    """The spec's config with every path pointed into the job's directory, then its overrides."""
    cfg: dict[str, Any] = json.loads(spec.config.read_text())
    swift = cfg.setdefault("swift", {})
    swift["enabled"] = True
    swift.setdefault("checkpoint", {})["dir"] = str(job.ckpt_dir)
    swift.setdefault("logging", {})["storage"] = f"file://{job.dir / 'swift-logs'}"
    swift["run_dir"] = str(job.run_dir)
    for key, value in spec.swift.items():
        if isinstance(value, Mapping):
            swift.setdefault(key, {}).update(value)
        else:
            swift[key] = value
    return cfg


def launcher_argv(spec: JobSpec, job: JobRun, config_path: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "ds_swift.launch.cli",
        "--run-dir",
        str(job.run_dir),
        "--nnodes",
        str(spec.nnodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        *(["--fork-server"] if spec.fork_server else []),
        *spec.launcher_args,
        str(spec.script),
        "--deepspeed_config",
        str(config_path),
        "--train-iters",
        str(spec.iterations),
    ]
    if spec.save:
        argv += ["--save", str(job.save_dir)]
    if spec.loss_log:
        argv += ["--loss-log", str(job.loss_log)]
    return [*argv, *spec.script_args]


def run_job(
    directory: str | Path,
    spec: JobSpec,
    timeout_s: float,
    on_poll: Callable[[JobRun], None] | None = None,
) -> JobRun:
    """Run one job to its end and return how it ended (a non-zero exit is the caller's to judge).

    Args:
        directory: the job's directory (created; what is in it already stays).
        spec: what to run.
        timeout_s: deadline for the whole job.
        on_poll: called about every 0.2 s while the job runs (progress display).

    Raises:
        JobTimeout: past the deadline; the whole process tree is killed.
    """
    job = JobRun(Path(directory).resolve(), spec.iterations)  # the launcher runs in it: absolute paths
    job.dir.mkdir(parents=True, exist_ok=True)
    job.config = job_config(spec, job)
    config_path = job.dir / "ds_config.json"
    config_path.write_text(json.dumps(job.config, indent=2))
    start = time.monotonic()
    argv, env = launcher_argv(spec, job, config_path), worker_env(spec.env)
    with ProcessSet(job.proc_logs) as procs:
        zygote = env.get(ZYGOTE_ENV) if spec.fork_server else None
        if zygote:  # forked, torch imported: its job store is up ~3 s sooner
            proc = procs.fork_module("launcher", zygote, argv[2], argv[3:], env, job.dir)
        else:
            proc = procs.spawn("launcher", argv, env=env, cwd=job.dir)
        job.pid = proc.pid
        while proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                job.output = procs.logs_tail(60)
                raise JobTimeout(job, timeout_s, job.output)
            if on_poll is not None:
                on_poll(job)
            time.sleep(0.2)
        job.code = proc.returncode
        job.seconds = time.monotonic() - start
        job.output = procs.log("launcher")
    return job


# ---------------------------------------------------------------------------- one zygote for many jobs
@contextmanager
def fork_zygote(directory: str | Path, timeout_s: float = 300.0) -> Iterator[Path]:
    """A fork server zygote (:func:`ds_swift.runtime.forkserver.zygote`) for the jobs started inside:
    every ``--fork-server`` launcher forks its server from it (``SWIFT_FORK_ZYGOTE`` is set in this
    process's environment, which jobs inherit), so torch, DeepSpeed and megatron-core are imported
    once for all of them, not once per job (~5 CPU-s each on this machine). Yields the socket's path;
    the zygote is killed on exit. RuntimeError if it is not ready within ``timeout_s``."""
    directory = Path(directory)
    path = directory / "zygote.sock"
    with ProcessSet(directory) as procs:
        zygote = procs.spawn_python("zygote", ["-u", "-m", "ds_swift.runtime.forkserver", "--zygote", str(path)])
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if zygote.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server zygote did not start:\n{procs.log('zygote')[-3000:]}")
            time.sleep(0.1)
        before = os.environ.get(ZYGOTE_ENV)
        os.environ[ZYGOTE_ENV] = str(path)
        try:
            yield path
        finally:
            if before is None:
                os.environ.pop(ZYGOTE_ENV, None)
            else:
                os.environ[ZYGOTE_ENV] = before


# ---------------------------------------------------------------------------- DeepSpeed's first start
_SHM_BUILD = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def build_deepspeed_shm_op(log_dir: str | Path, timeout_s: float = 600.0) -> None:
    """Build (or load the cached build of) DeepSpeed's shm comm op in a child process, so that the
    first job's ranks do not each spend their start-up deadline compiling it."""
    with ProcessSet(log_dir) as procs:
        procs.spawn_python("warm", ["-c", _SHM_BUILD], env=worker_env())
        if procs.wait("warm", timeout_s) != 0:
            raise RuntimeError(f"building DeepSpeed's shm comm op failed:\n{procs.log('warm')[-3000:]}")


def assert_verified(tl: Mapping[str, Any], ranks: Sequence[int], against: str) -> None:
    """A recovery timeline says the state of ``ranks`` was verified bitwise ``against`` (a pattern of
    the verdict's detail), and of no other rank, except survivors that went back a step by their own
    copies (each checked against its own digest); raises AssertionError otherwise."""
    for r in tl["ranks"]:
        verify = r["extra"].get("verify")
        if r["rank"] in ranks:
            if verify is None or verify["status"] != "verified" or not re.search(against, verify["detail"]):
                raise AssertionError(f"rank {r['rank']}: {verify}")
        elif verify is not None and not (verify["status"] == "verified" and verify["detail"].startswith(OWN_COPY)):
            raise AssertionError(f"rank {r['rank']} verified a state it kept: {r}")  # kept as it was: nothing to check
