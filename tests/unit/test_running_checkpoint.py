"""SCAR's prioritized running checkpoint (ds_swift.checkpoint.running), without processes."""

from __future__ import annotations

import errno
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ds_swift.checkpoint.running as rc_mod
from ds_swift.checkpoint.running import (
    MANIFEST,
    CorruptCheckpointError,
    RunningCheckpoint,
    RunningCheckpointError,
    load_running_checkpoint,
)

ADAM = {"masters": ["exp_avg", "exp_avg_sq"]}


def zero1_state(numel: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ZeRO-1 partition's masters and Adam moments, plus a shaped bf16 tensor of its own group."""
    g = torch.Generator().manual_seed(seed)
    return {
        "masters": torch.randn(numel, generator=g),
        "exp_avg": torch.randn(numel, generator=g),
        "exp_avg_sq": torch.rand(numel, generator=g),
        "norm": torch.randn(5, 7, generator=g).bfloat16(),
    }


def manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST).read_text())


def block_norms(cur: torch.Tensor, saved: torch.Tensor, block: int) -> list[float]:
    d = (cur.reshape(-1).double() - saved.reshape(-1).double()).tolist()
    return [math.sqrt(sum(x * x for x in d[s : s + block])) for s in range(0, len(d), block)]


def test_bad_arguments_name_the_field() -> None:
    with tempfile.TemporaryDirectory() as d:
        for kwargs, field in [
            ({"fraction": 0.0, "interval": 8}, "fraction=0.0"),
            ({"fraction": 1.5, "interval": 8}, "fraction=1.5"),
            ({"fraction": 0.5, "interval": 0}, "interval=0"),
            ({"fraction": 0.5, "interval": 8, "block_elements": 0}, "block_elements=0"),
            ({"fraction": 0.5, "interval": 8, "groups": {"a": ["b"], "c": ["b"]}}, "'b' twice"),
            ({"fraction": 0.5, "interval": 8, "groups": {"a": "b"}}, "groups['a']"),
        ]:
            with pytest.raises(ValueError, match=re.escape(field)):
                RunningCheckpoint(d, background=False, **kwargs)  # type: ignore[arg-type]


def test_groups_must_name_tensors_of_the_state_with_as_many_elements(tmp_path: Path) -> None:
    state = zero1_state(16)
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=4, groups={"masters": ["nope"]}) as rc:
        with pytest.raises(RunningCheckpointError, match="'nope'"):
            rc.save(0, state)
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=4, groups={"masters": ["norm"]}) as rc:
        with pytest.raises(RunningCheckpointError, match="companion 'norm' has 35 elements"):
            rc.save(0, state)
        with pytest.raises(RunningCheckpointError, match="companion 'norm'"):  # still checked on a retry
            rc.save(0, state)


def test_every_is_r_times_c() -> None:
    with tempfile.TemporaryDirectory() as d:
        assert RunningCheckpoint(d, fraction=0.25, interval=8).every == 2
        assert RunningCheckpoint(d, fraction=0.3, interval=10).every == 3
        assert RunningCheckpoint(d, fraction=0.01, interval=10).every == 1
        rc = RunningCheckpoint(d, fraction=0.25, interval=8)
        assert [i for i in range(1, 9) if rc.due(i)] == [2, 4, 6, 8]
        rc.close()


def test_the_most_changed_blocks_are_saved_with_their_companions(tmp_path: Path) -> None:
    state = {k: v for k, v in zero1_state(32).items() if k != "norm"}  # 8 blocks of 4
    rc = RunningCheckpoint(tmp_path, fraction=0.25, interval=8, groups=ADAM, block_elements=4, background=False)
    assert rc.save(0, state, full=True) == {"masters": tuple(range(8))}
    state["masters"][20:24] += 3.0  # block 5: the largest change
    state["masters"][9] += 2.0  # block 2: second
    state["masters"][28:32] += 0.5  # block 7: a wider but smaller change (norm 1.0 < 2.0)
    state["exp_avg"][0:4] += 100.0  # companions do not decide
    assert rc.save(2, state) == {"masters": (2, 5)}  # 8 blocks * 1/4
    blocks = manifest(tmp_path)["blocks"]
    for name in ("masters", "exp_avg", "exp_avg_sq"):
        assert [e[0] for e in blocks[name]] == [0, 0, 2, 0, 0, 2, 0, 0], name
        assert blocks[name][2][1] == blocks["masters"][2][1]  # same round file as their key
    assert rc.save(4, state) == {"masters": (0, 7)}  # 7 changed; the others tie: saved longest ago, then lowest
    rc.close()


@settings(max_examples=20, deadline=None)
@given(
    nblocks=st.integers(1, 12),
    tail=st.integers(0, 3),
    fraction=st.sampled_from([1.0, 0.5, 0.3, 0.25, 0.125]),
    interval=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_each_round_saves_the_blocks_that_changed_most_since_their_last_save(
    nblocks: int, tail: int, fraction: float, interval: int, seed: int
) -> None:
    """A model of SCAR's rule: keep what each block was when last saved, rank by L2 distance."""
    block = 4
    numel = (nblocks - 1) * block + (tail or block)
    g = torch.Generator().manual_seed(seed)
    state = {"masters": torch.randn(numel, generator=g), "exp_avg": torch.randn(numel, generator=g)}
    with tempfile.TemporaryDirectory() as d:
        rc = RunningCheckpoint(
            d,
            fraction=fraction,
            interval=interval,
            groups={"masters": ["exp_avg"]},
            block_elements=block,
            background=False,
        )
        rc.save(0, state, full=True)
        saved = state["masters"].clone()
        total = 0
        for n in range(1, 7):
            scale = torch.rand(nblocks, generator=g).repeat_interleave(block)[:numel]
            state["masters"] += torch.randn(numel, generator=g) * scale
            state["exp_avg"] += 1.0
            expect = (n * nblocks * rc.every) // interval - ((n - 1) * nblocks * rc.every) // interval
            norms = block_norms(state["masters"], saved, block)
            top = sorted(range(nblocks), key=lambda b: -norms[b])[:expect]
            chosen = rc.save(n * rc.every, state)["masters"]
            assert len(chosen) == expect
            assert sorted(chosen) == sorted(top)
            for b in chosen:
                saved[b * block : (b + 1) * block] = state["masters"][b * block : (b + 1) * block]
            total += len(chosen)
            assert total == (n * nblocks * rc.every) // interval  # one full checkpoint's worth per C, to a block
        rc.close()


@pytest.mark.parametrize(
    ("nblocks", "fraction", "interval", "counts"),
    [
        (12, 0.25, 8, [3, 3, 3, 3]),
        (10, 0.25, 8, [2, 3, 2, 3]),  # r*B = 2.5: floor/ceil in turn
        (3, 0.125, 8, [0, 0, 1, 0, 0, 1, 0, 1]),  # r*B < 1: some rounds write nothing
        (10, 1.0, 4, [10]),
    ],
)
def test_over_c_iterations_the_bytes_equal_a_full_checkpoint(
    tmp_path: Path, nblocks: int, fraction: float, interval: int, counts: list[int]
) -> None:
    state = {k: v for k, v in zero1_state(nblocks * 16).items() if k != "norm"}
    rc = RunningCheckpoint(tmp_path, fraction=fraction, interval=interval, groups=ADAM, block_elements=16)
    got = []
    for it in range(1, 2 * interval + 1):
        state["masters"] += 0.01 * it
        if rc.due(it):
            got.append(len(rc.save(it, state)["masters"]))
        if it == interval:
            rc.wait()
            assert rc.bytes_written == rc.full_bytes == 3 * nblocks * 16 * 4
    rc.close()
    assert got == counts * 2
    assert rc.bytes_written == 2 * rc.full_bytes
    assert rc.manifest_bytes_written > 0


def check_load(directory: Path, state: dict[str, torch.Tensor], ref: dict, block: int) -> None:
    """Each block as it was when last saved (``ref``: name -> block -> (iteration, values)), else the template's."""
    template = {n: torch.full_like(t, -7.0) for n, t in state.items()}
    loaded, ages = load_running_checkpoint(directory, template)
    for name, t in loaded.items():
        assert t.shape == state[name].shape and t.dtype == state[name].dtype
        flat = t.reshape(-1)
        for b in range(-(-t.numel() // block)):
            got = flat[b * block : (b + 1) * block]
            if b in ref[name]:
                assert torch.equal(got, ref[name][b][1]), (name, b)
            else:
                assert bool((got == -7.0).all()), (name, b)
        its = [it for it, _ in ref[name].values()]
        age = ages[name]
        assert (age.oldest, age.newest, age.saved_blocks) == (min(its, default=None), max(its, default=None), len(its))
        assert age.blocks == -(-t.numel() // block)


def test_every_saved_block_loads_as_it_was_when_saved_the_others_stay_as_the_template(tmp_path: Path) -> None:
    block = 4
    state = zero1_state(10 * block + 3)  # 11 key blocks (the last 3 long) + 9 bf16 blocks: 5 a round
    rc = RunningCheckpoint(tmp_path, fraction=0.25, interval=8, groups=ADAM, block_elements=block)
    ref: dict[str, dict[int, tuple[int, torch.Tensor]]] = {n: {} for n in state}
    g = torch.Generator().manual_seed(1)
    for it in (2, 4, 6, 8, 10, 12):
        for t in state.values():
            t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
        chosen = rc.save(it, state)
        assert sum(map(len, chosen.values())) == 5
        for key, blocks in chosen.items():
            for name in [key, *ADAM.get(key, [])]:
                flat = state[name].reshape(-1)
                for b in blocks:
                    ref[name][b] = (it, flat[b * block : (b + 1) * block].clone())
        if it == 6:  # 15 of 20 blocks saved once: 4 of the bf16 tensor's 9
            rc.wait()
            assert len(ref["masters"]) == 11 and len(ref["norm"]) == 4
            check_load(tmp_path, state, ref, block)
    rc.close()
    assert len(ref["norm"]) == 9 and min(it for it, _ in ref["masters"].values()) < 12  # re-saved, not all
    check_load(tmp_path, state, ref, block)
    template = {n: torch.zeros_like(t) for n, t in state.items()}
    loaded, _ = load_running_checkpoint(tmp_path, template)
    only, _ = load_running_checkpoint(tmp_path, {"norm": template["norm"]})  # a subset may be asked for
    assert list(only) == ["norm"] and torch.equal(only["norm"], loaded["norm"])


def test_float32_and_bfloat16_round_trip_bitwise(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    bits32 = torch.randint(-(2**31), 2**31 - 1, (300,), generator=g, dtype=torch.int64).to(torch.int32)
    bits16 = torch.randint(-(2**15), 2**15 - 1, (7, 30), generator=g, dtype=torch.int64).to(torch.int16)
    state = {"f32": bits32.view(torch.float32), "bf16": bits16.view(torch.bfloat16)}  # NaN payloads, -0, inf...
    state["f32"][:3] = torch.tensor([-0.0, float("inf"), 1e-45])
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=2, block_elements=64) as rc:
        rc.save(0, state, full=True)
    loaded, _ = load_running_checkpoint(tmp_path, {n: torch.zeros_like(t) for n, t in state.items()})
    assert torch.equal(loaded["f32"].view(torch.int32), bits32)
    assert torch.equal(loaded["bf16"].view(torch.int16), bits16)


def saved_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    state = zero1_state(40)
    with RunningCheckpoint(directory, fraction=0.5, interval=4, groups=ADAM, block_elements=8) as rc:
        rc.save(0, state, full=True)
        state["masters"][:8] += 1.0
        rc.save(2, state)
    return state


def masters_block0_file(directory: Path) -> tuple[Path, int]:
    entry = manifest(directory)["blocks"]["masters"][0]
    return directory / entry[1], entry[2]


def test_a_corrupt_byte_names_the_file(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path)
    path, offset = masters_block0_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[offset + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is corrupt: 'masters' block 0"):
        load_running_checkpoint(tmp_path, state)


def test_a_truncated_file_names_the_file(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path)
    path = tmp_path / manifest(tmp_path)["blocks"]["exp_avg_sq"][-1][1]
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is truncated"):
        load_running_checkpoint(tmp_path, state)


def test_a_missing_file_names_the_file(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path)
    path, _ = masters_block0_file(tmp_path)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is missing"):
        load_running_checkpoint(tmp_path, state)


def test_a_corrupt_or_missing_manifest_names_it(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path)
    path = tmp_path / MANIFEST
    doc = manifest(tmp_path)
    doc["blocks"]["masters"][1][0] += 1  # a flipped digit is still JSON: the manifest's own crc32c catches it
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is corrupt"):
        load_running_checkpoint(tmp_path, state)
    path.write_text(path.read_text()[:-10])
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is corrupt or truncated"):
        load_running_checkpoint(tmp_path, state)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match=rf"{path} is missing"):
        load_running_checkpoint(tmp_path, state)


def test_a_template_that_does_not_match_names_the_tensor(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path)
    with pytest.raises(RunningCheckpointError, match="template tensor 'exp_avg' is torch.bfloat16"):
        load_running_checkpoint(tmp_path, {**state, "exp_avg": state["exp_avg"].bfloat16()})
    with pytest.raises(RunningCheckpointError, match="template tensor 'masters' is torch.float32 with 41 elements"):
        load_running_checkpoint(tmp_path, {**state, "masters": torch.zeros(41)})
    with pytest.raises(RunningCheckpointError, match="template tensor 'extra' is not in the running checkpoint"):
        load_running_checkpoint(tmp_path, {**state, "extra": torch.zeros(3)})


def test_the_layout_is_fixed_by_the_first_save(tmp_path: Path) -> None:
    state = zero1_state(16)
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=4, groups=ADAM, block_elements=8) as rc:
        rc.save(0, state)
        with pytest.raises(RunningCheckpointError, match=r"tensor 'norm' is torch.bfloat16\[35\]"):
            rc.save(2, {**state, "norm": state["norm"].reshape(-1)})
        with pytest.raises(RunningCheckpointError, match="differ from the first save's"):
            rc.save(2, {k: v for k, v in state.items() if k != "norm"})


def failing_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(path: Path, buffers: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rc_mod, "write_atomic", full)


def test_a_write_error_surfaces_at_wait_and_its_blocks_are_written_first_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {k: v for k, v in zero1_state(32).items() if k != "norm"}  # 4 blocks of 8
    rc = RunningCheckpoint(tmp_path, fraction=0.25, interval=4, groups=ADAM, block_elements=8)
    rc.save(0, state, full=True)
    rc.wait()
    with monkeypatch.context() as m:
        failing_disk(m)
        state["masters"][8:16] += 1.0
        assert rc.save(1, state) == {"masters": (1,)}  # returns: the write is in the background
        with pytest.raises(RunningCheckpointError, match=rf"running checkpoint {tmp_path}: .*No space left on device"):
            rc.wait()
        rc.wait()  # said once
    assert [e[0] for e in manifest(tmp_path)["blocks"]["masters"]] == [0, 0, 0, 0]  # the disk is as it was
    state["masters"][24:32] += 5.0  # changed more, yet the block that was lost goes first
    assert rc.save(2, state) == {"masters": (1,)}
    assert rc.save(3, state) == {"masters": (3,)}
    rc.close()
    loaded, ages = load_running_checkpoint(tmp_path, state)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    assert (ages["masters"].oldest, ages["masters"].newest) == (0, 3)


def test_a_write_error_surfaces_at_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = zero1_state(16)
    rc = RunningCheckpoint(tmp_path, fraction=0.5, interval=2, groups=ADAM, block_elements=8)
    failing_disk(monkeypatch)
    rc.save(0, state, full=True)
    with pytest.raises(RunningCheckpointError, match=rf"{tmp_path}.*iteration 0 failed.*not saved"):
        rc.save(1, state)
    monkeypatch.undo()
    assert rc.save(1, state) == {"masters": (0, 1), "norm": (0,)}  # never on disk: first, in order
    rc.close()


def test_a_synchronous_write_error_is_raised_by_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rc = RunningCheckpoint(tmp_path, fraction=0.5, interval=2, block_elements=8, background=False)
    failing_disk(monkeypatch)
    with pytest.raises(RunningCheckpointError, match=str(tmp_path)):
        rc.save(0, zero1_state(16), full=True)
    rc.close()


def test_only_the_files_the_manifest_names_are_kept(tmp_path: Path) -> None:
    saved_checkpoint(tmp_path)  # an earlier run's checkpoint in the same directory
    (tmp_path / "0123456789ab-000009.bin.tmp").write_bytes(b"torn")
    old = {p.name for p in tmp_path.glob("*.bin")}
    state = zero1_state(40, seed=5)
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=4, groups=ADAM, block_elements=8) as rc:
        for it in range(0, 8, 2):
            rc.save(it, state)
            state["masters"] += 1.0
    named = {e[1] for es in manifest(tmp_path)["blocks"].values() for e in es if e is not None}
    assert {p.name for p in tmp_path.iterdir()} == named | {MANIFEST}
    assert not named & old


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_state_on_the_gpu_round_trips(tmp_path: Path) -> None:
    state = {n: t.cuda() for n, t in zero1_state(100).items()}
    with RunningCheckpoint(tmp_path, fraction=0.5, interval=4, groups=ADAM, block_elements=16) as rc:
        rc.save(0, state, full=True)
        state["masters"][:16] += 1.0
        assert rc.save(2, state)["masters"][0] == 0
    loaded, _ = load_running_checkpoint(tmp_path, {n: torch.zeros_like(t) for n, t in state.items()})
    assert all(loaded[n].is_cuda and torch.equal(loaded[n], state[n]) for n in state)
