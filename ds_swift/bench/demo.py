"""``ds-swift demo``: kill a machine of a tiny GPT job and show that nothing was lost.

Two jobs of ``examples/pretrain_gpt.py`` on 2 simulated machines x 2 ranks, under
``ds-swift-launch``, from the same seed: one without failure, one with a spare machine and an
injected SIGKILL of machine 1 during a backward pass. Then it prints the recovery timeline
(``<run_dir>/timeline-gen*.json``), the iterations lost (trained twice, from the loss logs),
whether the two final checkpoints are bitwise equal (tensor by tensor), and writes a PNG of the
two loss curves overlaid with the failure marked. The jobs run through ``ds_swift.testing.jobs``
(as the recovery tests' do); what is reported is computed by ``ds_swift.bench.demo_report``.

The examples/ and configs/ it runs come from the ds-swift checkout (``pip install -e .``): found
next to the installed package, in the working directory or its parents, or at ``$DS_SWIFT_ROOT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ds_swift
from ds_swift.bench.demo_report import format_timeline, iterations_lost, losses_by_iteration, plot_losses, read_loss_log
from ds_swift.logs import say
from ds_swift.runtime.warm import deepspeed_shm_op_built
from ds_swift.testing.checkpoints import compare_checkpoints
from ds_swift.testing.jobs import JobRun, JobSpec, JobTimeout, build_deepspeed_shm_op, run_job

__all__ = ["DemoError", "RepoFiles", "find_repo", "register"]

#: the demo's configurations; the default is what users run (bf16 + ZeRO-1, DeepSpeed's BF16_Optimizer,
#: gradient clipping, an LR schedule), the fp32 ZeRO-0 ones are kept for comparison
CONFIGS = {
    "pp2_dp2_bf16": "gpt_tiny_pp2_dp2_bf16_zero1.json",
    "pp4_bf16": "gpt_tiny_pp4_bf16_zero1_budget.json",
    "pp2_dp2": "gpt_tiny_pp2_dp2.json",
    "pp4": "gpt_tiny_pp4.json",
}
EXAMPLE = Path("examples") / "pretrain_gpt.py"


class DemoError(RuntimeError):
    """The demo cannot run or a job failed; the message says what to do."""


# ---------------------------------------------------------------------------- locating the checkout
@dataclass(frozen=True)
class RepoFiles:
    root: Path
    example: Path
    configs: Path

    def config(self, name: str) -> Path:
        path = Path(name)
        if name in CONFIGS:
            path = self.configs / CONFIGS[name]
        if not path.is_file():
            raise DemoError(f"--config {name}: {path} not found (one of {', '.join(CONFIGS)}, or a JSON file)")
        from ds_swift.config import ConfigError, load_ds_config

        try:
            load_ds_config(path)  # before a job starts, not as a traceback from inside it
        except ConfigError as exc:
            raise DemoError(f"--config {name}: {exc}") from None
        return path


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("DS_SWIFT_ROOT")
    if env:
        out.append(Path(env))
    # an editable install: the checkout itself (found from the package, wherever this module sits in it)
    out.append(Path(ds_swift.__file__).resolve().parents[1])
    cwd = Path.cwd().resolve()
    out += [cwd, *cwd.parents]
    return out


def find_repo(candidates: Iterable[Path] | None = None) -> RepoFiles:
    """The first candidate directory holding ``examples/pretrain_gpt.py`` and ``configs/``."""
    tried = []
    for root in candidates if candidates is not None else _candidates():
        example, configs = root / EXAMPLE, root / "configs"
        if example.is_file() and (configs / CONFIGS["pp2_dp2"]).is_file():
            return RepoFiles(root.resolve(), example.resolve(), configs.resolve())
        tried.append(str(root))
    raise DemoError(
        f"cannot find {EXAMPLE} and configs/{CONFIGS['pp2_dp2']} (looked in: {', '.join(dict.fromkeys(tried))}). "
        "The demo runs the example of a ds-swift checkout: clone it, `pip install -e .`, and run "
        "`ds-swift demo` there, or set DS_SWIFT_ROOT to the checkout"
    )


# ---------------------------------------------------------------------------- running the jobs
def _events(path: Path, seen: int) -> tuple[list[dict[str, Any]], int]:
    if not path.exists():
        return [], seen
    lines = path.read_text().splitlines()
    out = []
    for line in lines[seen:]:
        try:
            out.append(json.loads(line))
        except ValueError:
            return out, seen + len(out)  # a line being written: read it next time
    return out, len(lines)


def _show_job(name: str, directory: Path, spec: JobSpec, timeout_s: float, progress: Any) -> JobRun:
    """One ``ds-swift-launch`` job, its progress shown from the loss log and the launcher's events (its
    failures and recoveries said on ds-swift's logging channel, which rich's live display prints above it)."""
    if directory.exists():
        shutil.rmtree(directory)  # only the demo's own sub-directory
    task = progress.add_task(name, total=spec.iterations, status="starting 4 ranks")
    seen = 0

    def poll(run: JobRun) -> None:
        nonlocal seen
        events, seen = _events(run.run_dir / "launcher-events.jsonl", seen)
        for ev in events:
            kind, message = ev.get("event"), str(ev.get("message", ""))
            if kind in ("failure", "takeover", "replacement_spawned", "error"):
                _say(f"[{name}] {message}")
            if kind in ("spawned", "failure", "spare_requested", "takeover", "replacement_spawned"):
                progress.update(task, status=message.split(":")[0] + ": " + kind.replace("_", " "))
        points = read_loss_log(run.loss_log)
        if points:
            last = points[-1]
            again = " (trained again)" if iterations_lost(points) else ""
            progress.update(
                task,
                completed=last.iteration + 1,
                status=f"iteration {last.iteration}, loss {last.loss:.3f}, generation {last.generation}{again}",
            )

    try:
        run = run_job(directory, spec, timeout_s, on_poll=poll)
    except JobTimeout as exc:
        raise DemoError(f"{name}: still running after {timeout_s:.0f} s (killed); see {exc.job.proc_logs}") from None
    progress.update(
        task, completed=run.iterations if run.code == 0 else None, status=f"exit {run.code} after {run.seconds:.1f} s"
    )
    for line in run.output.splitlines():
        if line.startswith("[ds-swift] recovery of generation"):
            _say(f"[{name}] {line}")
    if run.code != 0:
        tail = "\n".join(run.output.splitlines()[-40:])
        raise DemoError(f"{name}: ds-swift-launch exited {run.code}; last lines:\n{tail}")
    return run


def _warm_up(work_dir: Path) -> None:
    """Build what the first DeepSpeed start on a machine builds, once, saying so."""
    from ds_swift.data.corpus import load_corpus

    t0 = time.monotonic()
    load_corpus()  # gathers the stdlib's docstrings once (~5 s), then cached for every rank and run
    if time.monotonic() - t0 > 1.5:
        _say(f"gathered the training text (the standard library's docstrings) once: {time.monotonic() - t0:.0f} s")
    if not deepspeed_shm_op_built():
        t0 = time.monotonic()
        _say("first DeepSpeed start on this machine: compiling its shm comm op once (about 40 s, cached afterwards)")
        try:
            build_deepspeed_shm_op(work_dir / "warm-up")
        except RuntimeError as exc:
            raise DemoError(str(exc)) from None
        _say(f"DeepSpeed's shm comm op compiled in {time.monotonic() - t0:.0f} s")


# ---------------------------------------------------------------------------- the sub-command
def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="kill a machine of a tiny GPT job, recover, show the timeline, iterations lost and a loss plot",
        description="Run a tiny GPT on 2 simulated machines x 2 ranks twice, without failure and with machine 1 "
        "killed mid-iteration, then show the recovery timeline, the iterations lost, whether the final states are "
        "bitwise equal, and a PNG of both loss curves.",
    )
    p.add_argument(
        "--run-dir", default="./swift-demo", help="where the jobs, logs and the plot go (default %(default)s)"
    )
    p.add_argument(
        "--config",
        default="pp2_dp2_bf16",
        help=f"{' | '.join(CONFIGS)} (configs/ of the checkout) or a DeepSpeed JSON path (default %(default)s)",
    )
    p.add_argument("--iterations", type=int, default=15, help="training iterations of each job (default %(default)s)")
    p.add_argument(
        "--kill-iteration",
        type=int,
        default=7,
        help="iteration (from 0) during which machine 1 dies (default %(default)s)",
    )
    p.add_argument("--phase", default="backward", choices=["forward", "backward", "step", "send", "recv"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may take (default %(default)s)")
    p.set_defaults(func=run)


def _say(text: str) -> None:
    """One line of the demo's progress on ds-swift's logging channel."""
    say(text, name=__name__, prefix="ds-swift demo")


def _plain(console: Any) -> Callable[[str], None]:
    """Print without rich markup: job output is full of [brackets] (paths, rank lists)."""
    return lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True)


def _bad_numbers(args: argparse.Namespace) -> str | None:
    """The first of the demo's numbers that cannot work, named with what it must be."""
    if args.iterations < 2:
        return f"--iterations {args.iterations} must be 2 or more (a failure, then training after it)"
    if not 0 <= args.kill_iteration < args.iterations:
        return f"--kill-iteration {args.kill_iteration} must be in [0, --iterations {args.iterations})"
    if not args.timeout > 0:
        return f"--timeout {args.timeout:g} must be a positive number of seconds (each job's deadline)"
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(highlight=False)
    if (why := _bad_numbers(args)) is not None:
        _plain(console)(f"ds-swift demo: error: {why}")
        return 2
    try:
        repo = find_repo()
        config = repo.config(args.config)
    except DemoError as exc:
        _plain(console)(f"ds-swift demo: error: {exc}")
        return 2
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    console.print(
        f"[bold]ds-swift demo[/bold]: {escape(str(repo.example.relative_to(repo.root)))} with "
        f"{escape(config.name)}, 2 simulated machines x 2 ranks, {args.iterations} iterations; "
        f"output in {escape(str(run_dir))}"
    )
    inject = f"machine=1,iteration={args.kill_iteration},phase={args.phase}"
    base = JobSpec(repo.example, config, args.iterations, loss_log=True)
    jobs = [
        ("without failure", run_dir / "baseline", base),
        ("with failure", run_dir / "failure", replace(base, launcher_args=["--spares", "1", "--inject", inject])),
    ]
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<17}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
    )
    try:
        _warm_up(run_dir)
        with Progress(*columns, console=console) as progress:
            baseline, failed = [_show_job(*job, args.timeout, progress) for job in jobs]
    except DemoError as exc:
        console.print("ds-swift demo: failed:", style="red")
        _plain(console)(str(exc))
        return 1
    return _report(console, baseline, failed, args, run_dir, time.monotonic() - t0)


def _report(
    console: Any, baseline: JobRun, failed: JobRun, args: argparse.Namespace, run_dir: Path, elapsed: float
) -> int:
    ok = True
    timelines = failed.timelines()
    console.print()
    if not timelines:
        console.print("[red]no recovery timeline was written: the failure job did not recover[/red]")
        ok = False
    for tl in timelines:
        for line in format_timeline(tl):
            _plain(console)(line)
    base_points, fail_points = read_loss_log(baseline.loss_log), read_loss_log(failed.loss_log)
    base, fail = losses_by_iteration(base_points), losses_by_iteration(fail_points)
    lost = iterations_lost(fail_points)
    missing = sorted(set(range(args.iterations)) - set(fail))
    console.print(
        f"iterations lost (trained twice): [bold]{lost}[/bold]"
        + (f"; iterations missing from the loss log: {missing}" if missing else "")
    )
    same_losses = base == fail
    console.print(
        f"loss curves: {'identical at every iteration' if same_losses else 'differ'} ({len(fail)} iterations)"
    )
    diff = compare_checkpoints(baseline.final_tag, failed.final_tag)
    if diff.bitwise_equal:
        console.print(
            f"final parameters and optimizer state: [bold green]bitwise equal[/bold green] "
            f"({diff.tensors} tensors compared)"
        )
    else:
        ok = False
        worst = max((gap for _, gap in diff.differing), default=0.0)
        console.print(
            f"final checkpoints: [yellow]{len(diff.differing)} of {diff.tensors} tensors differ[/yellow] "
            f"(largest difference {worst:.3g}; {len(diff.only_in_one)} only in one)"
        )
    note = "; ".join(
        [f"recovered by {tl['strategy']} in {tl['total_s']:.1f} s" for tl in timelines]
        + [f"{lost} iteration(s) lost", "final state bitwise equal" if diff.bitwise_equal else "final state differs"]
    )
    png = plot_losses(
        base,
        fail,
        args.kill_iteration,
        run_dir / "loss_curves.png",
        title=f"tiny GPT, 2 machines x 2 ranks: machine 1 killed at iteration {args.kill_iteration}",
        note=note,
    )
    _plain(console)(f"loss curves plotted: {png}")
    console.print(
        f"jobs: without failure {baseline.seconds:.1f} s, with failure {failed.seconds:.1f} s; demo {elapsed:.1f} s"
    )
    return 0 if ok else 1
