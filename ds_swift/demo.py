"""``ds-swift demo``: kill a machine of a tiny GPT job and show that nothing was lost.

Two jobs of ``examples/pretrain_gpt.py`` on 2 simulated machines x 2 ranks, under
``ds-swift-launch``, from the same seed: one without failure, one with a spare machine and an
injected SIGKILL of machine 1 during a backward pass. Then it prints the recovery timeline
(``<run_dir>/timeline-gen*.json``), the iterations lost (trained twice, from the loss logs),
whether the two final checkpoints are bitwise equal (tensor by tensor), and writes a PNG of the
two loss curves overlaid with the failure marked.

The examples/ and configs/ it runs come from the ds-swift checkout (``pip install -e .``): found
next to the installed package, in the working directory or its parents, or at ``$DS_SWIFT_ROOT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CheckpointDiff",
    "DemoError",
    "LossPoint",
    "RepoFiles",
    "compare_checkpoints",
    "find_repo",
    "format_timeline",
    "iterations_lost",
    "losses_by_iteration",
    "plot_losses",
    "read_loss_log",
    "register",
]

CONFIGS = {"pp2_dp2": "gpt_tiny_pp2_dp2.json", "pp4": "gpt_tiny_pp4.json"}
EXAMPLE = Path("examples") / "pretrain_gpt.py"
PHASES = (
    ("detect", "the kill seen (node agent or a neighbour's comm error)"),
    ("teardown", "survivors dropped the dead generation's process groups"),
    ("rendezvous", "the next generation formed, replacement ranks included"),
    ("rebuild", "DeepSpeed engines rebuilt in-process on every rank"),
    ("consensus_undo", "agreed on the iteration to resume from (and undid steps past it)"),
    ("checkpoint_load", "lost ranks loaded the last global checkpoint"),
    ("replay", "lost ranks replayed the iterations since, from the message log"),
    ("state_restore", "lost ranks' state restored (replica broadcast, or checkpoint + replay done)"),
    ("catch_up", "back at the pre-failure iteration"),
)


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
        return path


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("DS_SWIFT_ROOT")
    if env:
        out.append(Path(env))
    out.append(Path(__file__).resolve().parents[1])  # an editable install: the checkout itself
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


# ---------------------------------------------------------------------------- loss logs
@dataclass(frozen=True)
class LossPoint:
    iteration: int
    loss: float
    generation: int = 0


def read_loss_log(path: str | os.PathLike[str]) -> list[LossPoint]:
    """Entries of a ``--loss-log`` file in the order written; a torn last line (a killed writer) is skipped."""
    points = []
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text().splitlines():
        try:
            d = json.loads(line)
            points.append(LossPoint(int(d["iteration"]), float(d["loss"]), int(d.get("generation", 0))))
        except (ValueError, KeyError, TypeError):
            continue
    return points


def losses_by_iteration(points: Iterable[LossPoint]) -> dict[int, float]:
    """Loss per iteration; an iteration trained twice keeps its last value (the one training went on from)."""
    return {p.iteration: p.loss for p in points}


def iterations_lost(points: Iterable[LossPoint]) -> int:
    """Iterations trained more than once: finished before the failure, then trained again after it."""
    counts = Counter(p.iteration for p in points)
    return sum(1 for n in counts.values() if n > 1)


# ---------------------------------------------------------------------------- checkpoints
@dataclass
class CheckpointDiff:
    """Tensor-by-tensor comparison of two DeepSpeed checkpoint tags."""

    tensors: int
    differing: list[tuple[str, float]] = field(default_factory=list)
    """(name, largest absolute difference) of tensors whose bits differ."""
    only_in_one: list[str] = field(default_factory=list)

    @property
    def bitwise_equal(self) -> bool:
        return self.tensors > 0 and not self.differing and not self.only_in_one


def checkpoint_tensors(tag_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of one checkpoint tag directory (layer files, model and optimizer states)."""
    import torch

    out: dict[str, Any] = {}

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    files = sorted(Path(tag_dir).glob("*.pt"))
    if not files:
        raise DemoError(f"no checkpoint files (*.pt) in {tag_dir}")
    for f in files:
        walk(torch.load(f, map_location="cpu", weights_only=False), f.name)
    return out


def compare_checkpoints(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> CheckpointDiff:
    """Compare two checkpoint tags bit for bit (dtype, shape and every element)."""
    import torch

    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    diff = CheckpointDiff(tensors=len(ta.keys() & tb.keys()), only_in_one=sorted(ta.keys() ^ tb.keys()))

    def bits(t: Any) -> Any:
        # Bytes, not values: -0.0 == 0.0 and NaN != NaN would hide or invent differences.
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    for name in sorted(ta.keys() & tb.keys()):
        x, y = ta[name], tb[name]
        if x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)):
            continue
        gap = float((x.double() - y.double()).abs().max()) if x.shape == y.shape and x.numel() else float("inf")
        diff.differing.append((name, gap))
    return diff


# ---------------------------------------------------------------------------- timeline
def format_timeline(tl: dict[str, Any]) -> list[str]:
    """The recovery timeline as text lines: what happened, each phase's duration, the paper's totals."""
    machine = f"machine {tl['failed_machine']}" if tl.get("failed_machine") is not None else "a machine"
    lines = [f"recovery of generation {tl['failed_generation']}: {machine} failed; recovered by {tl['strategy']}"]
    if tl.get("reason"):
        lines.append(f"  why: {tl['reason']}")
    ckpt = tl.get("checkpoint_step")
    tag = f"global_step{ckpt}" if ckpt is not None else "the initial state"
    back = f"back at iteration {tl['pre_failure_iteration']}"
    if tl["strategy"] == "checkpoint":
        how = f"every rank reloaded {tag} and trained iterations {ckpt or 0}..{tl['consensus']} again"
    elif tl["strategy"] == "logging":
        how = f"survivors kept their state; the lost ranks loaded {tag} and replayed the iterations since"
    else:
        how = "survivors kept their state in memory; replacements got theirs from replicas"
    lines.append(f"  consensus: iteration {tl['consensus']} finished everywhere; {how}; {back}")
    if tl.get("undo_ranks"):
        lines.append(f"  update-undo on ranks {tl['undo_ranks']} (they had stepped past the consensus)")
    if tl.get("donors"):
        pairs = ", ".join(f"{src}->{dst}" for dst, src in sorted(tl["donors"].items(), key=lambda kv: int(kv[0])))
        moved = sum(int(r.get("bytes_moved", 0)) for r in tl.get("ranks", []))
        lines.append(f"  state sent donor->replacement: {pairs} ({moved / 1e6:.2f} MB)")
    replay = tl.get("replay")
    if isinstance(replay, dict) and replay.get("iterations") is not None:
        per_rank = replay.get("per_rank") or {}
        messages = sum(int(r.get("messages_from_log", 0)) for r in per_rank.values() if isinstance(r, dict))
        lines.append(
            f"  replay: ranks {replay.get('ranks')} replayed iterations {replay.get('from')}..{replay.get('to')} "
            f"from {replay.get('source', tag)}: {messages} messages, {int(replay.get('log_bytes_read', 0)) / 1e6:.2f} MB "
            f"of log read, {float(replay.get('replay_s', 0.0)):.2f} s"
        )
    phases = tl.get("phases", {})
    known = dict(PHASES)
    for key in [k for k, _ in PHASES if k in phases] + [k for k in phases if k not in known]:
        lines.append(f"  {key.replace('_', ' '):<16}{float(phases[key]):7.2f} s   {known.get(key, '')}".rstrip())
    lines.append(f"  initialization {tl['initialization_s']:.2f} s (detection -> replacements joined), recovery "
                 f"{tl['recovery_s']:.2f} s (joined -> back), total {tl['total_s']:.2f} s "
                 f"({'kill' if tl.get('t_kill') is not None else 'detection'} -> back)")
    return lines


# ---------------------------------------------------------------------------- plot
def plot_losses(
    baseline: dict[int, float],
    failed: dict[int, float],
    kill_iteration: int | None,
    path: str | os.PathLike[str],
    title: str = "tiny GPT, 2 machines x 2 ranks",
    note: str | None = None,
) -> Path:
    """PNG of both loss curves overlaid, the failure iteration marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    xs = sorted(baseline)
    ax.plot(xs, [baseline[i] for i in xs], color="#9ecae1", linewidth=6, solid_capstyle="round",
            label="without failure", zorder=1)
    xf = sorted(failed)
    ax.plot(xf, [failed[i] for i in xf], color="#d62728", linewidth=1.6, linestyle="--", marker="o", markersize=4,
            label="machine killed, recovered", zorder=2)
    if kill_iteration is not None:
        ax.axvline(kill_iteration, color="black", linestyle=":", linewidth=1.2, zorder=0)
        top = max([*baseline.values(), *failed.values()], default=1.0)
        ax.annotate(f"machine 1 killed\n(iteration {kill_iteration})", xy=(kill_iteration, top),
                    xytext=(6, -4), textcoords="offset points", va="top", fontsize=9)
    if note:
        ax.text(0.02, 0.03, note, transform=ax.transAxes, fontsize=9, va="bottom",
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "#bbbbbb"})
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- running the jobs
@dataclass
class Job:
    name: str
    dir: Path
    iterations: int
    code: int | None = None
    seconds: float = 0.0
    output: str = ""

    @property
    def loss_log(self) -> Path:
        return self.dir / "loss.jsonl"

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    @property
    def final_tag(self) -> Path:
        return self.dir / "final" / f"global_step{self.iterations}"

    def timelines(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.run_dir.glob("timeline-gen*.json"))]


def _prepare(job: Job, config: Path) -> Path:
    if job.dir.exists():
        shutil.rmtree(job.dir)  # only the demo's own sub-directory
    job.dir.mkdir(parents=True)
    cfg = json.loads(config.read_text())
    swift = cfg.setdefault("swift", {})
    swift["enabled"] = True
    # Everything a job writes stays in its directory (checkpoints, logs), whatever the config says.
    swift.setdefault("checkpoint", {})["dir"] = str(job.dir / "ckpt")
    if isinstance(swift.get("logging"), dict) and "storage" in swift["logging"]:
        swift["logging"]["storage"] = f"file://{job.dir / 'swift-logs'}"
    path = job.dir / "ds_config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


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


def run_job(
    job: Job,
    repo: RepoFiles,
    config: Path,
    launcher_args: list[str],
    timeout_s: float,
    progress: Any,
    log: Callable[[str], None],
) -> Job:
    """One ``ds-swift-launch`` job, its progress shown from the loss log and the launcher's events."""
    from ds_swift.testing.procs import ProcessSet, worker_env

    cfg_path = _prepare(job, config)
    argv = [
        sys.executable, "-m", "ds_swift.launch.cli", "--run-dir", str(job.run_dir), "--nnodes", "2",
        "--nproc-per-node", "2", *launcher_args, str(repo.example), "--deepspeed_config", str(cfg_path),
        "--train-iters", str(job.iterations), "--save", str(job.dir / "final"), "--loss-log", str(job.loss_log),
    ]
    task = progress.add_task(job.name, total=job.iterations, status="starting 4 ranks")
    start = time.monotonic()
    seen = 0
    with ProcessSet(job.dir / "logs") as procs:
        proc = procs.spawn("launcher", argv, env=worker_env(), cwd=job.dir)
        while proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                job.output = procs.logs_tail(60)
                raise DemoError(f"{job.name}: still running after {timeout_s:.0f} s (killed); see {job.dir / 'logs'}")
            events, seen = _events(job.run_dir / "launcher-events.jsonl", seen)
            for ev in events:
                kind, message = ev.get("event"), str(ev.get("message", ""))
                if kind in ("failure", "takeover", "replacement_spawned", "error"):
                    log(f"[{job.name}] {message}")
                if kind in ("spawned", "failure", "spare_requested", "takeover", "replacement_spawned"):
                    progress.update(task, status=message.split(":")[0] + ": " + kind.replace("_", " "))
            points = read_loss_log(job.loss_log)
            if points:
                last = points[-1]
                again = " (trained again)" if iterations_lost(points) else ""
                progress.update(task, completed=last.iteration + 1,
                                status=f"iteration {last.iteration}, loss {last.loss:.3f}, generation {last.generation}{again}")
            time.sleep(0.2)
        job.code = proc.returncode
        job.seconds = time.monotonic() - start
        job.output = procs.log("launcher")
    progress.update(task, completed=job.iterations if job.code == 0 else None,
                    status=f"exit {job.code} after {job.seconds:.1f} s")
    for line in job.output.splitlines():
        if line.startswith("[ds-swift] recovery of generation"):
            log(f"[{job.name}] {line}")
    if job.code != 0:
        tail = "\n".join(job.output.splitlines()[-40:])
        raise DemoError(f"{job.name}: ds-swift-launch exited {job.code}; last lines:\n{tail}")
    return job


def _warm_up(log: Callable[[str], None], work_dir: Path) -> None:
    """Build what the first DeepSpeed start on a machine builds, once, saying so."""
    from ds_swift.corpus import load_corpus

    t0 = time.monotonic()
    load_corpus()  # gathers the stdlib's docstrings once (~5 s), then cached for every rank and run
    if time.monotonic() - t0 > 1.5:
        log(f"gathered the training text (the standard library's docstrings) once: {time.monotonic() - t0:.0f} s")
    built = True
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = (Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so").exists()
    except Exception:  # noqa: BLE001 - a private helper; without it just build (fast when cached)
        built = False
    if not built:
        t0 = time.monotonic()
        log("first DeepSpeed start on this machine: compiling its shm comm op once (about 40 s, cached afterwards)")
        from ds_swift.testing.procs import ProcessSet, worker_env

        with ProcessSet(work_dir / "warm-up") as procs:
            procs.spawn_python("warm", ["-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                               env=worker_env())
            if procs.wait("warm", 600) != 0:
                raise DemoError(f"building DeepSpeed's shm comm op failed:\n{procs.log('warm')[-3000:]}")
        log(f"DeepSpeed's shm comm op compiled in {time.monotonic() - t0:.0f} s")


# ---------------------------------------------------------------------------- the sub-command
def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="kill a machine of a tiny GPT job, recover, show the timeline, iterations lost and a loss plot",
        description="Run a tiny GPT on 2 simulated machines x 2 ranks twice, without failure and with machine 1 "
        "killed mid-iteration, then show the recovery timeline, the iterations lost, whether the final states are "
        "bitwise equal, and a PNG of both loss curves.",
    )
    p.add_argument("--run-dir", default="./swift-demo", help="where the jobs, logs and the plot go (default %(default)s)")
    p.add_argument("--config", default="pp2_dp2",
                   help=f"{' | '.join(CONFIGS)} (configs/ of the checkout) or a DeepSpeed JSON path (default %(default)s)")
    p.add_argument("--iterations", type=int, default=15, help="training iterations of each job (default %(default)s)")
    p.add_argument("--kill-iteration", type=int, default=7, help="iteration (from 0) during which machine 1 dies (default %(default)s)")
    p.add_argument("--phase", default="backward", choices=["forward", "backward", "step", "send", "recv"])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may take (default %(default)s)")
    p.set_defaults(func=run)


def _plain(console: Any) -> Callable[[str], None]:
    """Print without rich markup: job output is full of [brackets] (paths, rank lists)."""
    return lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(highlight=False)
    if not 0 <= args.kill_iteration < args.iterations:
        _plain(console)(f"ds-swift demo: error: --kill-iteration {args.kill_iteration} must be in [0, --iterations "
                        f"{args.iterations})")
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
    console.print(f"[bold]ds-swift demo[/bold]: {escape(str(repo.example.relative_to(repo.root)))} with "
                  f"{escape(config.name)}, 2 simulated machines x 2 ranks, {args.iterations} iterations; "
                  f"output in {escape(str(run_dir))}")
    inject = f"machine=1,iteration={args.kill_iteration},phase={args.phase}"
    jobs = [
        (Job("without failure", run_dir / "baseline", args.iterations), []),
        (Job("with failure", run_dir / "failure", args.iterations), ["--spares", "1", "--inject", inject]),
    ]
    columns = (SpinnerColumn(), TextColumn("{task.description:<17}"), BarColumn(bar_width=30), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[status]}"))
    try:
        _warm_up(_plain(console), run_dir)
        with Progress(*columns, console=console) as progress:
            for job, launcher_args in jobs:
                run_job(job, repo, config, launcher_args, args.timeout, progress, _plain(progress.console))
    except DemoError as exc:
        console.print("ds-swift demo: failed:", style="red")
        _plain(console)(str(exc))
        return 1
    baseline, failed = jobs[0][0], jobs[1][0]
    return _report(console, baseline, failed, args, run_dir, time.monotonic() - t0)


def _report(console: Any, baseline: Job, failed: Job, args: argparse.Namespace, run_dir: Path, elapsed: float) -> int:
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
    console.print(f"iterations lost (trained twice): [bold]{lost}[/bold]"
                  + (f"; iterations missing from the loss log: {missing}" if missing else ""))
    same_losses = base == fail
    console.print(f"loss curves: {'identical at every iteration' if same_losses else 'differ'}"
                  f" ({len(fail)} iterations)")
    diff = compare_checkpoints(baseline.final_tag, failed.final_tag)
    if diff.bitwise_equal:
        console.print(f"final parameters and optimizer state: [bold green]bitwise equal[/bold green] "
                      f"({diff.tensors} tensors compared)")
    else:
        ok = False
        worst = max((gap for _, gap in diff.differing), default=0.0)
        console.print(f"final checkpoints: [yellow]{len(diff.differing)} of {diff.tensors} tensors differ[/yellow] "
                      f"(largest difference {worst:.3g}; {len(diff.only_in_one)} only in one)")
    note = "; ".join(
        [f"recovered by {tl['strategy']} in {tl['total_s']:.1f} s" for tl in timelines]
        + [f"{lost} iteration(s) lost", "final state bitwise equal" if diff.bitwise_equal else "final state differs"]
    )
    png = plot_losses(base, fail, args.kill_iteration, run_dir / "loss_curves.png",
                      title=f"tiny GPT, 2 machines x 2 ranks: machine 1 killed at iteration {args.kill_iteration}",
                      note=note)
    _plain(console)(f"loss curves plotted: {png}")
    console.print(f"jobs: without failure {baseline.seconds:.1f} s, with failure {failed.seconds:.1f} s; "
                  f"demo {elapsed:.1f} s")
    return 0 if ok else 1
