"""The Megatron-DeepSpeed patch series: headers, commit check, and a clean apply at the pinned commit."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from ds_swift.megatron import swift_section
from ds_swift.megatron.data import MegatronSamples, SamplerPosition, sample_indices
from ds_swift.megatron.patch import (
    REPOSITORY,
    SERIES_DIR,
    MegatronPatchError,
    apply_series,
    launch_command,
    load_series,
)

PINNED = "4efb479d5317ce9b86096b9d8e3e8030b0b5263b"
DATA = Path(__file__).resolve().parents[1] / "data" / "megatron_deepspeed" / f"{PINNED[:8]}-touched-files.tar.gz"
MIRROR = Path("/work/.mirror/deepspeedai+Megatron-DeepSpeed/repo")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *argv: str) -> str:
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    env = {**os.environ, **who}
    done = subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


def pinned_files(tmp: Path) -> Path:
    """A git repository holding the pinned commit's versions of the files the series touches."""
    repo = tmp / "megatron-deepspeed"
    repo.mkdir()
    with tarfile.open(DATA) as tar:
        tar.extractall(repo, filter="data")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pinned files")
    return repo


def test_every_patch_header_names_the_pinned_commit() -> None:
    series = load_series()
    assert [p.name[:4] for p in series] == ["0001", "0002", "0003", "0004"]
    for patch in series:
        text = patch.path.read_text()
        assert patch.commit == PINNED
        assert f"Megatron-DeepSpeed-Commit: {PINNED}" in text.split("\ndiff --git", 1)[0]
        assert f"Repository: {REPOSITORY}" in text


def test_refuses_a_checkout_of_another_commit_with_one_line(tmp_path: Path) -> None:
    repo = tmp_path / "other"
    repo.mkdir()
    (repo / "README.md").write_text("not megatron\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "x")
    with pytest.raises(MegatronPatchError) as err:
        apply_series(repo)
    message = str(err.value)
    assert "\n" not in message
    assert git(repo, "rev-parse", "HEAD")[:12] in message and PINNED in message
    assert git(repo, "status", "--porcelain") == ""  # nothing touched


def test_series_applies_cleanly_to_the_pinned_files_and_only_once(tmp_path: Path) -> None:
    repo = pinned_files(tmp_path)
    assert apply_series(repo, force=True).startswith("applied 4 patches")
    training = (repo / "megatron" / "training.py").read_text()
    assert "model[0] = _SWIFT.wrap(model[0], args)" in training
    assert "train_batch(data_iter=None if args.swift else data_iterator)" in training
    assert "ds_swift.megatron.init_distributed(args)" in (repo / "megatron" / "initialize.py").read_text()
    compile(training, "training.py", "exec")
    assert apply_series(repo, force=True).startswith("already applied")


def test_a_hunk_that_does_not_apply_is_named_and_nothing_stays_applied(tmp_path: Path) -> None:
    repo = pinned_files(tmp_path)
    training = repo / "megatron" / "training.py"
    training.write_text(
        training.read_text().replace("    if found_kill_switch():", "    if found_kill_switch():  # x", 1)
    )
    before = git(repo, "diff")
    with pytest.raises(MegatronPatchError) as err:
        apply_series(repo, force=True)
    message = str(err.value)
    assert "\n" not in message
    assert "0002-swift-init-and-wrap.patch does not apply" in message
    assert "hunk '@@ -130,6 +133,12 @@ def pretrain(" in message and "megatron/training.py" in message
    assert PINNED in message
    assert git(repo, "diff") == before  # 0001 was rolled back


def test_launch_command_trains_the_tiny_gpt_with_a_kill(tmp_path: Path) -> None:
    argv = launch_command(tmp_path / "mds", tmp_path / "w")
    assert argv[0] == "ds-swift-launch" and "--swift" in argv
    assert argv[argv.index("--inject") + 1] == "machine=3,iteration=5,phase=backward"
    assert "--inject" not in launch_command(tmp_path / "mds", tmp_path / "w", kill=False)


@pytest.mark.skipif(not (MIRROR / "HEAD").exists(), reason="no local mirror of deepspeedai/Megatron-DeepSpeed")
def test_series_applies_to_a_real_checkout_of_the_pinned_commit(tmp_path: Path) -> None:
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(MIRROR), str(tmp_path / "mds")], check=True)
    git(tmp_path / "mds", "checkout", "-q", PINNED)
    assert apply_series(tmp_path / "mds").startswith("applied 4 patches")
    assert SERIES_DIR.is_dir()


def megatron_sampler(consumed: int, mbs: int, dp_rank: int, dp: int, total: int) -> list[list[int]]:
    """MegatronPretrainingSampler.__iter__ at the pinned commit (megatron/data/data_samplers.py)."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            out.append(batch[dp_rank * mbs : (dp_rank + 1) * mbs])
            batch = []
    return out


@pytest.mark.parametrize(("mbs", "dp", "gas", "start_iteration", "start_consumed"), [(1, 2, 2, 0, 0), (2, 3, 4, 5, 7)])
def test_samples_by_position_are_the_samplers(
    mbs: int, dp: int, gas: int, start_iteration: int, start_consumed: int
) -> None:
    pos = SamplerPosition(mbs, dp, gas, start_iteration, start_consumed)
    for d in range(dp):
        stream = megatron_sampler(start_consumed, mbs, d, dp, start_consumed + 6 * pos.global_batch_size)
        for t in range(start_iteration, start_iteration + 6):
            for k in range(gas):
                expect = stream[(t - start_iteration) * gas + k]  # what train_batch's k-th next() reads
                assert sample_indices(pos, t, d * gas + k) == expect


def test_samples_follow_the_engine_and_refuse_the_cyclic_loader() -> None:
    args = argparse.Namespace(
        dataloader_type="single", micro_batch_size=1, global_batch_size=4, iteration=0, consumed_train_samples=0
    )
    samples = MegatronSamples()
    samples.configure(args, 2, 2, iteration=5)  # a replacement recovered to iteration 5
    assert (args.iteration, args.consumed_train_samples, samples.consumed(8)) == (5, 20, 32)
    args.seq_length = 32
    samples.configure(args, 2, 2, iteration=5)
    assert args.consumed_train_tokens == 20 * 32  # Megatron's count, which a replacement started at 0
    with pytest.raises(Exception, match="dataloader-type"):
        samples.configure(argparse.Namespace(**{**vars(args), "dataloader_type": "cyclic"}), 2, 2, 0)


def test_swift_checkpoints_default_to_megatrons_save_directory() -> None:
    args = argparse.Namespace(swift=True, swift_config=None, save="/ckpt", save_interval=50)
    assert swift_section(args, {})["checkpoint"] == {"dir": "/ckpt", "interval": 50}
    kept = swift_section(args, {"swift": {"checkpoint": {"dir": "/mine"}}})
    assert kept["checkpoint"] == {"dir": "/mine"}


# ---------------------------------------------------------------------- --check: where a checkout stands
def check(repo: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`ds-swift megatron-patch --check REPO`: (exit code, what it printed); the checkout must not change."""
    from ds_swift.cli import main

    before = (git(repo, "status", "--porcelain"), git(repo, "diff"))
    code = main(["megatron-patch", "--check", str(repo)])
    assert (git(repo, "status", "--porcelain"), git(repo, "diff")) == before  # --check changes nothing
    return code, capsys.readouterr().out


def apply_by_hand(repo: Path, *names: str) -> None:
    for patch in load_series():
        if patch.name[:4] in names:
            git(repo, "apply", str(patch.path))


def test_check_says_the_series_applies_to_the_pinned_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = pinned_files(tmp_path)
    code, out = check(repo, capsys)
    assert code == 1 and f"{repo}: applies: none of the 4 patches is applied" in out


def test_check_says_the_series_is_applied(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = pinned_files(tmp_path)
    apply_series(repo, force=True)
    code, out = check(repo, capsys)
    assert code == 0 and f"{repo}: applied: all 4 patches are in place" in out


def test_check_names_the_patches_of_a_half_applied_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = pinned_files(tmp_path)
    apply_by_hand(repo, "0001", "0002")
    code, out = check(repo, capsys)
    assert code == 3
    assert (
        "half applied: 0001-swift-arguments.patch, 0002-swift-init-and-wrap.patch applied; "
        "0003-swift-data-after-recovery.patch, 0004-cpu-gloo.patch not"
    ) in out
    before = git(repo, "diff")
    with pytest.raises(MegatronPatchError, match="is half applied .*nothing changed"):
        apply_series(repo, force=True)
    assert git(repo, "diff") == before


def test_a_half_applied_checkout_is_reported_hunk_by_hunk_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0001, 0002 and 0004 in place, 0003 not: the first version reverse-applied 0004 to probe, failed on
    0003, left 0004 reversed and said that 0001 'does not apply'."""
    repo = pinned_files(tmp_path)
    apply_by_hand(repo, "0001", "0002")
    training = repo / "megatron" / "training.py"
    pinned_training = training.read_text()
    apply_by_hand(repo, "0003", "0004")
    git(repo, "apply", "-R", str(load_series()[2].path))  # take 0003 back out, 0004 stays
    assert training.read_text() != pinned_training
    before = git(repo, "diff")
    with pytest.raises(MegatronPatchError) as err:
        apply_series(repo, force=True)
    assert git(repo, "diff") == before  # the first version left 0004 reversed here
    assert re.search(
        r"is half applied \(0001-swift-arguments.patch applied; .*0003-swift-data-after-recovery.patch "
        r"not applied; 0004-cpu-gloo.patch applied\)",
        str(err.value),
    ), str(err.value)
    code, out = check(repo, capsys)
    assert code == 3
    assert (
        "0003-swift-data-after-recovery.patch megatron/training.py @@ -715,7 +715,8 @@ def train_step("
        "forward_step_func, data_iterator,: not applied"
    ) in out
    assert "0004-cpu-gloo.patch megatron/tokenizer/tokenizer.py @@ -6,7 +6,6 @@: applied" in out
    assert ": conflicts" not in out


def test_check_names_the_hunk_that_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = pinned_files(tmp_path)
    training = repo / "megatron" / "training.py"
    training.write_text(
        training.read_text().replace("    if found_kill_switch():", "    if found_kill_switch():  # x", 1)
    )
    code, out = check(repo, capsys)
    assert code == 4 and f"{repo}: does not apply: 0002-swift-init-and-wrap.patch conflicts" in out
    assert "0002-swift-init-and-wrap.patch megatron/training.py @@ -130,6 +133,12 @@ def pretrain(" in out
    assert out.count(": conflicts") == 1


def test_a_folder_inside_another_repository_is_really_patched(tmp_path: Path) -> None:
    """git apply run in a folder of a bigger repository skips every file and exits 0: the first version
    said 'applied 4 patches' and changed nothing."""
    outer = tmp_path / "project"
    outer.mkdir()
    vendored = pinned_files(outer)
    shutil.rmtree(vendored / ".git")
    git(outer, "init", "-q")
    git(outer, "add", "-A")
    git(outer, "commit", "-qm", "vendored Megatron-DeepSpeed")
    assert apply_series(vendored, force=True).startswith("applied 4 patches")
    assert "model[0] = _SWIFT.wrap(model[0], args)" in (vendored / "megatron" / "training.py").read_text()
    assert apply_series(vendored, force=True).startswith("already applied")
    with pytest.raises(MegatronPatchError, match="not a git checkout .*--force"):
        apply_series(vendored)  # without --force: not a checkout of its own
