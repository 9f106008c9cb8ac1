"""The test scaffolding in ds_swift.testing: job configs and checkpoint comparison (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ds_swift.testing.checkpoints import compare_tensors, relative_distance, tensors_of
from ds_swift.testing.jobs import JobRun, JobSpec, job_config, launcher_argv

ROOT = Path(__file__).resolve().parents[2]
PP4 = ROOT / "configs" / "gpt_tiny_pp4.json"


def test_job_config_keeps_everything_in_the_job_directory(tmp_path: Path) -> None:
    spec = JobSpec(
        ROOT / "examples" / "pretrain_gpt.py", PP4, 12, swift={"checkpoint": {"interval": 1}, "strategy": "checkpoint"}
    )
    job = JobRun(tmp_path / "job", spec.iterations)
    cfg = job_config(spec, job)
    swift = cfg["swift"]
    assert swift["checkpoint"] == {"dir": str(job.ckpt_dir), "interval": 1}  # merged one level deep
    assert swift["logging"]["storage"] == f"file://{job.dir / 'swift-logs'}"
    assert swift["logging"]["chunk_iterations"] == json.loads(PP4.read_text())["swift"]["logging"]["chunk_iterations"]
    assert swift["run_dir"] == str(job.run_dir) and swift["strategy"] == "checkpoint" and swift["enabled"]


def test_launcher_argv_passes_save_loss_log_and_script_args_last(tmp_path: Path) -> None:
    spec = JobSpec(
        Path("train.py"), PP4, 5, ["--spares", "1"], ["--dropout", "0.1"], loss_log=True, nnodes=4, nproc_per_node=1
    )
    job = JobRun(tmp_path, 5)
    argv = launcher_argv(spec, job, tmp_path / "ds_config.json")
    i = argv.index("train.py")
    assert argv[i - 2 : i] == ["--spares", "1"] and argv[argv.index("--nnodes") + 1] == "4"
    assert argv[argv.index("--save") + 1] == str(job.save_dir) and argv[argv.index("--loss-log") + 1] == str(
        job.loss_log
    )
    assert argv[-2:] == ["--dropout", "0.1"]
    assert "--save" not in launcher_argv(JobSpec(Path("t.py"), PP4, 5, save=False), job, tmp_path / "c.json")
    # --fork-server where the spec asks (its default: SWIFT_TEST_FORK_SERVER=1, set by tests/dist/conftest.py)
    assert "--fork-server" in launcher_argv(JobSpec(Path("t.py"), PP4, 5, fork_server=True), job, tmp_path / "c.json")
    assert "--fork-server" not in launcher_argv(
        JobSpec(Path("t.py"), PP4, 5, fork_server=False), job, tmp_path / "c.json"
    )
    assert job.final_tag == tmp_path / "final" / "global_step5"


def test_compare_tensors_reports_what_differs() -> None:
    a = tensors_of({"module": {"w": torch.ones(3), "b": torch.zeros(2)}, "steps": [torch.tensor(4)]}, "m.pt")
    assert sorted(a) == ["m.pt/module/b", "m.pt/module/w", "m.pt/steps[0]"]
    same = compare_tensors(a, {k: v.clone() for k, v in a.items()})
    assert same.bitwise_equal and same.max_gap == 0.0 and "bitwise equal (3 tensors)" in same.describe()
    b = dict(a, **{"m.pt/module/w": torch.tensor([1.0, 1.5, 1.0]), "m.pt/module/b": -torch.zeros(2)})
    diff = compare_tensors(a, b)
    assert [n for n, _ in diff.differing] == ["m.pt/module/b", "m.pt/module/w"]  # -0.0 differs from 0.0 in bits
    assert diff.max_gap == 0.5 and "2 of 3 tensors differ" in diff.describe()
    assert not compare_tensors({}, {}).bitwise_equal  # nothing compared proves nothing


def test_relative_distance_is_over_the_layer_files_floating_tensors() -> None:
    layer = "layer_03-model_00-model_states.pt/"
    a = {layer + "w": torch.tensor([3.0, 4.0]), layer + "steps": torch.tensor([7]), "optim.pt/m": torch.tensor([1.0])}
    b = {layer + "w": torch.tensor([3.0, 5.0]), layer + "steps": torch.tensor([9]), "optim.pt/m": torch.tensor([9.0])}
    assert relative_distance(a, b) == 0.2  # |(0, 1)| / |(3, 4)|: the optimizer file and the integers left out
    assert relative_distance(a, a) == 0.0
    assert relative_distance(a, b, r"^optim") == 8.0
    assert relative_distance(a, b, r"nothing") is None


def test_a_run_on_another_loss_scale_or_step_count_is_not_bitwise_equal() -> None:
    """fp16: DeepSpeed keeps the loss scaler as an object and the counters as numbers; the bitwise
    comparisons of the recovery tests compare them too."""
    from types import SimpleNamespace

    def ckpt(scale: float, skipped: int) -> dict[str, torch.Tensor]:
        scaler = SimpleNamespace(cur_scale=scale, cur_iter=12, last_overflow_iter=9, cur_hysteresis=1)
        state = {"global_steps": 12, "skipped_steps": skipped, "optimizer_state_dict": {"loss_scaler": scaler}}
        return tensors_of({**state, "module": {"w": torch.ones(2)}}, "m.pt")

    ref = ckpt(32768.0, 2)
    assert set(ref) == {
        "m.pt/global_steps",
        "m.pt/skipped_steps",
        "m.pt/optimizer_state_dict/loss_scaler",
        "m.pt/module/w",
    }
    assert compare_tensors(ref, ckpt(32768.0, 2)).bitwise_equal
    assert [n for n, _ in compare_tensors(ref, ckpt(16384.0, 2)).differing] == ["m.pt/optimizer_state_dict/loss_scaler"]
    assert [n for n, _ in compare_tensors(ref, ckpt(32768.0, 3)).differing] == ["m.pt/skipped_steps"]
