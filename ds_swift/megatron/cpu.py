"""The runs of ``scripts/megatron_deepspeed_cpu.sh``: a tiny GPT in the real Megatron-DeepSpeed on CPU.

The script trains Megatron-DeepSpeed's ``pretrain_gpt.py`` twice under ``ds-swift-launch``,
failure-free and with one machine SIGKILLed, and compares the final checkpoints bit for bit. This
module is its Python side: the options (shape, precision, ZeRO stage, strategy, the kill), the
DeepSpeed config and launch command of each run, the lines the script prints from a run's log, and
the comparison::

    python -m ds_swift.megatron.cpu prepare CHECKOUT WORK [options]   # shell assignments for the script
    python -m ds_swift.megatron.cpu summary LOG                       # iterations, recovery, job end
    python -m ds_swift.megatron.cpu compare REF_CKPT KILL_CKPT TAG    # bitwise verdict, exit 1 if not

The defaults are the README's run: pp 2 x dp 2, fp32, ZeRO-0, four machines of one rank and a
spare, machine 3 killed in the backward pass of iteration 5, eight iterations.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.recovery.registry import checked, strategy_names

__all__ = ["CpuRun", "ds_config", "launch_command", "megatron_args", "parse_run", "summary_lines"]

PRECISIONS = ("fp32", "bf16", "fp16")
PHASES = ("forward", "backward", "step", "send", "recv")


@dataclass(frozen=True)
class CpuRun:
    """One shape of the tiny GPT and the failure to inject into it."""

    tp: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``), inside a machine."""
    pp: int = 2
    """Pipeline stages (``--pipeline-model-parallel-size``)."""
    dp: int = 2
    """Data-parallel replicas: the job has ``tp * pp * dp`` ranks."""
    machines: int = 4
    """Simulated machines, each with ``tp * pp * dp / machines`` ranks (Megatron's rank order tp-dp-pp)."""
    spares: int = 1
    """Spare machines kept warm for the replacement."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (Megatron's ``--bf16``/``--fp16`` and DeepSpeed's section)."""
    zero: int = 0
    """DeepSpeed ZeRO stage, 0 or 1."""
    strategy: str = "auto"
    """ds-swift's strategy (the swift section's ``strategy``)."""
    kill_machine: int = -1
    """The machine killed; -1: the last one (machine 3 of the default four)."""
    kill_also: int | None = None
    """A second machine killed at the same instant (``--inject machine=M+N``), or None."""
    kill_iteration: int = 5
    kill_phase: str = "backward"
    iters: int = 8
    """``--train-iters``: the final checkpoint compared is ``global_step<iters>``."""
    save_interval: int = 4
    """``--save-interval``: also ds-swift's global checkpoint interval (a replay starts there)."""
    untie_embeddings: bool = False
    """Megatron's ``--untie-embeddings-and-output-weights``. Tied (the default), the first and the
    last stage all-reduce the embedding's gradient, which a message-log replay cannot redo when
    only one of them is lost: ds-swift then falls back to the global checkpoint, loudly."""
    initial_scale_power: int = 16
    """fp16 only: DeepSpeed's first loss scale is 2**this; a large one overflows (skipped steps)."""

    def __post_init__(self) -> None:
        if self.kill_machine == -1:
            object.__setattr__(self, "kill_machine", self.machines - 1)
        for name in ("tp", "pp", "dp", "machines", "iters", "save_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_flag(name)} {getattr(self, name)}: must be a positive integer")
        if self.spares < 0:
            raise ConfigError(f"--spares {self.spares}: must be 0 or more")
        if self.world % self.machines:
            raise ConfigError(
                f"--machines {self.machines}: the job's {self.world} ranks (tp {self.tp} x pp {self.pp} x dp {self.dp}) "
                "must split evenly over the machines; pick a divisor of that number"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision {self.precision!r}: one of {', '.join(PRECISIONS)}")
        if self.zero not in (0, 1):
            raise ConfigError(f"--zero {self.zero}: 0 or 1 (ds-swift supports ZeRO up to stage 1)")
        if self.strategy not in strategy_names():
            raise ConfigError(f"--strategy {self.strategy!r}: one of {', '.join(strategy_names())}")
        if not 0 <= self.kill_machine < self.machines:
            raise ConfigError(f"--kill-machine {self.kill_machine}: a machine of 0..{self.machines - 1}")
        if self.kill_also is not None and (
            not 0 <= self.kill_also < self.machines or self.kill_also == self.kill_machine
        ):
            raise ConfigError(
                f"--kill-also {self.kill_also}: another machine of 0..{self.machines - 1} than --kill-machine"
            )
        if not 1 <= self.kill_iteration <= self.iters:
            raise ConfigError(f"--kill-iteration {self.kill_iteration}: an iteration of 1..{self.iters} (--iters)")
        if self.kill_phase not in PHASES:
            raise ConfigError(f"--kill-phase {self.kill_phase!r}: one of {', '.join(PHASES)}")
        if not 0 <= self.initial_scale_power <= 40:
            raise ConfigError(f"--initial-scale-power {self.initial_scale_power}: 0..40")
        if 4 % self.tp:
            raise ConfigError(f"--tp {self.tp}: must divide the tiny GPT's 4 attention heads (1, 2 or 4)")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ranks_per_machine(self) -> int:
        return self.world // self.machines

    @property
    def layers(self) -> int:
        """Two transformer layers, or one per stage where there are more stages."""
        return max(2, self.pp)

    @property
    def global_batch_size(self) -> int:
        """Four micro-batches of one sample, at least one per replica (``dp`` divides it)."""
        return self.dp * -(-4 // self.dp)

    @property
    def inject(self) -> str:
        machines = str(self.kill_machine) + (f"+{self.kill_also}" if self.kill_also is not None else "")
        return f"machine={machines},iteration={self.kill_iteration},phase={self.kill_phase}"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def megatron_args(run: CpuRun) -> list[str]:
    """``pretrain_gpt.py``'s arguments for the tiny GPT (without data, save and DeepSpeed paths)."""
    argv = (
        f"--num-layers {run.layers} --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
        f"--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size {run.global_batch_size} "
        f"--train-iters {run.iters} --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 "
        "--weight-decay 0.01 --clip-grad 1.0 --seed 1234 --split 100,0,0 --tokenizer-type NullTokenizer "
        "--vocab-size 256 --data-impl mmap --num-workers 0 --eval-iters 0 --eval-interval 1000 --log-interval 1 "
        f"--tensor-model-parallel-size {run.tp} --pipeline-model-parallel-size {run.pp} --distributed-backend gloo "
        "--attention-dropout 0.1 --hidden-dropout 0.1 --no-masked-softmax-fusion --no-bias-gelu-fusion "
        f"--no-bias-dropout-fusion --no-gradient-accumulation-fusion --save-interval {run.save_interval}"
    ).split()
    if run.precision != "fp32":
        argv.append(f"--{run.precision}")
    if run.untie_embeddings:
        argv.append("--untie-embeddings-and-output-weights")
    return argv


def ds_config(run: CpuRun, run_dir: Path) -> dict[str, Any]:
    """The DeepSpeed config of one run (its message log, if any, under ``run_dir``/logs)."""
    config: dict[str, Any] = {
        "train_batch_size": run.global_batch_size,
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1000000,
        "zero_optimization": {"stage": run.zero},
        "gradient_clipping": 1.0,
        "swift": {
            "enabled": True,
            "machines": {"gpus_per_node": run.ranks_per_machine, "rank_order": "tp-dp-pp"},
            "strategy": run.strategy,
            # Each run its own log: a relative default would land in the checkout (the runs' cwd).
            "logging": {"storage": f"file://{run_dir / 'logs'}"},
            "watchdog": {"poll_interval_s": 0.1, "heartbeat_timeout_s": 10.0, "op_timeout_s": 60.0},
            # A digest every iteration (a few ms on the tiny GPT): every recovery is verified at
            # the exact iteration it reaches, a replay too.
            "verify": {"digest_interval": 1},
        },
    }
    if run.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif run.precision == "fp16":
        # hysteresis 1: every overflow halves the scale at once, so a too-large first scale costs
        # a few skipped steps at the start and no more.
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": run.initial_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 1,
            "min_loss_scale": 1,
        }
    checked(SwiftConfig.from_dict(config["swift"]))  # fail here, naming the field, not in eight workers
    return config


def launch_command(checkout: Path, work: Path, run: CpuRun | None = None, *, kill: bool = True) -> list[str]:
    """``ds-swift-launch`` for the tiny GPT: data in ``work``/data, the run in ``work``/kill (or ref),
    whose ``ds_config.json`` :func:`ds_config` makes. Run it from the checkout with ``LOCAL_SIZE``
    set to the ranks per machine."""
    run = run or CpuRun()
    run_dir = work / ("kill" if kill else "ref")
    argv = ["ds-swift-launch", "--nnodes", str(run.machines), "--nproc-per-node", str(run.ranks_per_machine)]
    argv += ["--spares", str(run.spares), "--run-dir", str(run_dir / "run")]
    if kill:
        argv += ["--inject", run.inject]
    if run.strategy == "elastic":  # the job goes on without a failed machine no spare takes over
        argv += ["--elastic"]
    if run.precision == "fp16":  # DeepSpeed refuses fp16 on a CPU without fp16 kernels: allowed, for this run
        argv += ["-m", "ds_swift.testing.cpu_fp16_script"]
    argv += [str(checkout / "pretrain_gpt.py"), *megatron_args(run)]
    argv += ["--data-path", str(work / "data" / "stdlib_text_document"), "--save", str(run_dir / "ckpt")]
    argv += ["--deepspeed", "--deepspeed_config", str(run_dir / "ds_config.json"), "--swift"]
    return argv


def describe(run: CpuRun) -> str:
    """One line: the shape, the precision and the failure."""
    return (
        f"tp {run.tp} x pp {run.pp} x dp {run.dp} over {run.machines} machines of {run.ranks_per_machine} "
        f"rank(s) (+{run.spares} spare), {run.precision}, ZeRO-{run.zero}, strategy {run.strategy}"
        f"{', untied embeddings' if run.untie_embeddings else ''}; "
        + (
            f"machines {run.kill_machine} and {run.kill_also} killed"
            if run.kill_also is not None
            else f"machine {run.kill_machine} killed"
        )
        + f" in the {run.kill_phase} phase of iteration {run.kill_iteration}"
    )


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The script's options, one per :class:`CpuRun` field, defaults as in the dataclass."""
    default = CpuRun()
    parser.add_argument("--tp", type=int, default=default.tp, help="tensor-parallel size (default %(default)s)")
    parser.add_argument("--pp", type=int, default=default.pp, help="pipeline stages (default %(default)s)")
    parser.add_argument("--dp", type=int, default=default.dp, help="data-parallel replicas (default %(default)s)")
    parser.add_argument(
        "--machines",
        type=int,
        default=default.machines,
        help="simulated machines; tp*pp*dp/machines ranks each (default %(default)s)",
    )
    parser.add_argument("--spares", type=int, default=default.spares, help="spare machines (default %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, default=default.precision, help="(default %(default)s)")
    parser.add_argument(
        "--zero", type=int, choices=(0, 1), default=default.zero, help="ZeRO stage (default %(default)s)"
    )
    parser.add_argument(
        "--strategy",
        choices=strategy_names(),
        default=default.strategy,
        help="ds-swift's recovery strategy (default %(default)s)",
    )
    parser.add_argument("--kill-machine", type=int, default=-1, help="(default: the last machine)")
    parser.add_argument(
        "--kill-also", type=int, default=None, help="a second machine killed at the same instant (default: none)"
    )
    parser.add_argument("--kill-iteration", type=int, default=default.kill_iteration, help="(default %(default)s)")
    parser.add_argument("--kill-phase", choices=PHASES, default=default.kill_phase, help="(default %(default)s)")
    parser.add_argument("--iters", type=int, default=default.iters, help="training iterations (default %(default)s)")
    parser.add_argument(
        "--save-interval",
        type=int,
        default=default.save_interval,
        help="Megatron's --save-interval, ds-swift's global checkpoints (default %(default)s)",
    )
    parser.add_argument(
        "--untie-embeddings",
        action="store_true",
        help="Megatron's --untie-embeddings-and-output-weights (tied embeddings rule out a "
        "message-log replay of a first or last stage alone)",
    )
    parser.add_argument(
        "--initial-scale-power",
        type=int,
        default=default.initial_scale_power,
        help="fp16: the first loss scale is 2**N; too large, the first steps overflow and are "
        "skipped (20: iterations 1-3 of the tiny GPT; default %(default)s)",
    )


def _parse(argv: list[str]) -> tuple[argparse.Namespace, CpuRun]:
    parser = argparse.ArgumentParser(
        prog="megatron_deepspeed_cpu.sh",
        description="Train the tiny GPT in the real Megatron-DeepSpeed twice on CPU, failure-free and with a "
        "machine killed, and compare the final checkpoints bit for bit.",
    )
    parser.add_argument("checkout", metavar="PATH_TO_CHECKOUT")
    parser.add_argument("work", metavar="WORK_DIR", nargs="?", default="megatron-swift-run")
    parser.add_argument("--dry-run", action="store_true", help="print the two launch commands and stop")
    parser.add_argument(
        "--reference",
        default=None,
        metavar="REF_WORK",
        help="a WORK_DIR of an earlier run of the same shape, precision and length: its failure-free run is "
        "compared with, not run again (a strategy or a kill does not change the failure-free arithmetic)",
    )
    add_run_options(parser)
    ns = parser.parse_args(argv)
    fields = {k: v for k, v in vars(ns).items() if k in CpuRun.__dataclass_fields__}
    try:
        run = CpuRun(**fields)
    except ConfigError as exc:
        parser.error(str(exc))
    if ns.reference is not None:
        ns.reference = Path(ns.reference).resolve()
        ref = ns.reference / "ref" / "ckpt" / f"global_step{run.iters}"
        if not ref.is_dir() and not ns.dry_run:
            parser.error(f"--reference {ns.reference}: no failure-free checkpoint {ref} there")
    return ns, run


def parse_run(argv: list[str]) -> tuple[Path, Path, CpuRun, bool]:
    """``(checkout, work, run, dry_run)`` from the script's command line; exits 2 naming a bad option."""
    ns, run = _parse(argv)
    return Path(ns.checkout).resolve(), Path(ns.work).resolve(), run, ns.dry_run


def prepare(argv: list[str]) -> int:
    """Parse the script's options, write each run's DeepSpeed config, print shell assignments
    (``REF_WORK``: where the failure-free run is, this WORK_DIR unless ``--reference`` names another)."""
    ns, run = _parse(argv)
    checkout, work, dry_run = Path(ns.checkout).resolve(), Path(ns.work).resolve(), ns.dry_run
    out = {
        "CHECKOUT": str(checkout),
        "WORK": str(work),
        "LOCAL_SIZE": str(run.ranks_per_machine),
        "FINAL_TAG": f"global_step{run.iters}",
        "DESCRIBE": describe(run),
        "DRY_RUN": "1" if dry_run else "",
        "REF_WORK": str(ns.reference or ""),
    }
    for name, kill in (("ref", False), ("kill", True)):
        run_dir = work / name
        config = ds_config(run, run_dir)
        if not dry_run:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "ds_config.json").write_text(json.dumps(config, indent=1) + "\n")
            (run_dir / "run.json").write_text(json.dumps(asdict(run)) + "\n")
        out[f"{name.upper()}_CMD"] = shlex.join(launch_command(checkout, work, run, kill=kill))
    print("\n".join(f"{key}={shlex.quote(value)}" for key, value in out.items()))
    return 0


_ITERATION = re.compile(r"^\s*iteration\s+(\d+)/\s*(\d+) \|(.*)$")
_FIELD = re.compile(r"\s*([a-z ]+): ([^|]+)\|")


def summary_lines(log: str) -> list[str]:
    """From a run's log: one line per iteration (loss, loss scale, grad norm, or the skipped step),
    ds-swift's recovery lines and the launcher's end of the job."""
    out = []
    for line in log.splitlines():
        m = _ITERATION.match(line)
        if m:
            fields = {k.strip(): v.strip() for k, v in _FIELD.findall(m.group(3))}
            parts = [f"iteration {int(m.group(1))}/{int(m.group(2))}"]
            parts.append(f"lm loss: {fields['lm loss']}" if "lm loss" in fields else "lm loss: none (step skipped)")
            parts += [f"{k}: {fields[k]}" for k in ("consumed samples", "loss scale", "grad norm") if k in fields]
            if fields.get("number of skipped iterations", "0") != "0":
                parts.append("skipped")
            out.append(" | ".join(parts))
        elif "[ds-swift] recovery of" in line or "job finished" in line or "POST-RECOVERY GUARD" in line:
            out.append(line.strip())
    return out


def compare(ref: Path, kill: Path, tag: str) -> int:
    """Print the bitwise verdict on ``tag`` of both runs' checkpoints; 0 when bitwise equal."""
    from ds_swift.testing.checkpoints import compare_checkpoints

    diff = compare_checkpoints(ref / tag, kill / tag)
    print(f"{tag}: {diff.tensors} tensors compared, {len(diff.differing)} differ, {len(diff.only_in_one)} in one only")
    if not diff.bitwise_equal:
        print(f"NOT BITWISE EQUAL: {diff.describe()}")
    return 0 if diff.bitwise_equal else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "prepare":
        return prepare(rest)
    if command == "summary" and len(rest) == 1:
        print("\n".join(summary_lines(Path(rest[0]).read_text(errors="replace"))))
        return 0
    if command == "compare" and len(rest) == 3:
        return compare(Path(rest[0]), Path(rest[1]), rest[2])
    print(
        "usage: python -m ds_swift.megatron.cpu prepare CHECKOUT [WORK] [options] | summary LOG | "
        "compare REF_CKPT KILL_CKPT TAG",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
