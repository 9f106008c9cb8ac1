"""PipeChurn's partial recomputation after a failure in the middle of an iteration: which passes each
rank keeps and which it redoes, where each message of the redo comes from, and that the sends and
receives left in DeepSpeed's own 1F1B schedule still pair up without a deadlock (pure: no processes)."""

from __future__ import annotations

import itertools

import pytest
from deepspeed.runtime.pipe import schedule

from ds_swift.recovery.consensus import RankReport, RecoveryInputs
from ds_swift.recovery.holdings import InflightHeld, holdings_of
from ds_swift.recovery.strategies.pipechurn_passes import (
    RankPasses,
    Transfer,
    kept_passes,
    rank_passes,
    redo_summary,
    transfers,
)


def reports(
    lost: set[int],
    passes: dict[int, int],
    pp: int = 2,
    dp: int = 2,
    tp: int = 1,
    last: int = 7,
    forwards: dict[int, int] | None = None,
) -> list[RankReport]:
    """Rank order tp-pp-dp (rank = tp + tp * (stage + pp * dp)); a survivor's copy is of ``last + 1``."""
    out = []
    for rank in range(pp * dp * tp):
        t, s, d = rank % tp, (rank // tp) % pp, rank // (tp * pp)
        survivor = rank not in lost
        n = passes.get(rank, 4)
        out.append(
            RankReport(
                rank=rank,
                survivor=survivor,
                stage=s,
                dp=d,
                tp=t,
                machine=rank,
                last_stepped=last if survivor else -1,
                holdings=holdings_of(
                    InflightHeld(
                        iteration=last + 1 if survivor else -1,
                        passes=n if survivor else -1,
                        forwards=(forwards or {}).get(rank, n) if survivor else 0,
                    )
                ),
            )
        )
    return out


def agree(rep: list[RankReport]) -> RecoveryInputs:
    return RecoveryInputs.agree(rep, forced="pipechurn")


def test_a_failure_at_stage_0s_first_backward_keeps_the_last_stages_two_finished_passes() -> None:
    """The dist test's case: rank 0 (stage 0 of replica 0) dies at its first backward pass; rank 1
    (its stage 1) had finished micro-batches 0 and 1; replica 1 had run every pass."""
    inputs = agree(reports({0}, {1: 2}))
    assert kept_passes(inputs, 4) == {0: 0, 1: 2, 2: 4, 3: 4}
    lost, survivor = rank_passes(inputs, 0, 4), rank_passes(inputs, 1, 4)
    assert list(lost.redo) == [0, 1, 2, 3] and list(survivor.redo) == [2, 3]
    # Rank 1 sends rank 0 the gradients of micro-batches 0 and 1 from its copy; 2 and 3 go live.
    assert transfers(inputs, 4) == [Transfer(1, 0, "grad", range(0, 2))]
    assert [lost.recv("grad", k) for k in range(4)] == ["kept", "kept", "live", "live"]
    assert [survivor.send("grad", k) for k in range(4)] == ["skip", "skip", "live", "live"]
    # Rank 1 needs activations 2 and 3 only, both computed again by rank 0.
    assert [lost.send("act", k) for k in range(4)] == ["skip", "skip", "live", "live"]
    assert [survivor.recv("act", k) for k in range(4)] == ["skip", "skip", "live", "live"]
    got = redo_summary(inputs, 4)
    assert got["micro_batch_passes"] == 6 and got["full_retrain_passes"] == 16
    assert got["passes_by_rank"] == {"0": 4, "1": 2, "2": 0, "3": 0} and got["forwards_dropped"] == 0


def test_forward_passes_whose_backward_had_not_run_are_redone_and_counted() -> None:
    # Rank 1 (stage 1) dies at its first backward: rank 0 ran forwards 0 and 1, no backward.
    inputs = agree(reports({1}, {0: 0}, forwards={0: 2}))
    assert kept_passes(inputs, 4) == {0: 0, 1: 0, 2: 4, 3: 4}
    got = redo_summary(inputs, 4)
    assert got["micro_batch_passes"] == 8 and got["forwards_dropped"] == 2
    assert transfers(inputs, 4) == []  # everything between ranks 0 and 1 goes live


def test_a_survivor_ahead_of_a_lost_next_stage_serves_it_its_kept_activations() -> None:
    # pp 3: rank 1 (stage 1) lost; stage 0 (rank 0) had finished 3 backward passes, stage 2 (rank 2) 3.
    inputs = agree(reports({1}, {0: 3, 2: 3}, pp=3, dp=1))
    assert transfers(inputs, 4) == [Transfer(0, 1, "act", range(0, 3)), Transfer(2, 1, "grad", range(0, 3))]
    mid = rank_passes(inputs, 1, 4)
    assert mid.served("act") == range(0, 3) and mid.served("grad") == range(0, 3)


def test_tensor_parallel_peers_that_kept_different_passes_redo_all_of_them() -> None:
    inputs = agree(reports({0}, {1: 2, 3: 1}, pp=2, dp=1, tp=2))  # ranks 2 and 3: stage 1, tp 0 and 1
    assert kept_passes(inputs, 4) == {0: 0, 1: 0, 2: 0, 3: 0}
    inputs = agree(reports({0}, {1: 3, 2: 2, 3: 2}, pp=2, dp=1, tp=2))
    assert kept_passes(inputs, 4) == {0: 0, 1: 0, 2: 2, 3: 2}


def test_a_copy_of_another_iteration_keeps_nothing() -> None:
    rep = reports({0}, {1: 2})
    inputs = agree(rep).rebased(6)  # a lagging chunk: the in-flight iteration is 7, the copy is of 8
    assert kept_passes(inputs, 4)[1] == 0


# ----------------------------------------------------------------------------- against DeepSpeed's schedule
def program(p: RankPasses, stage: int, stages: int, m: int) -> list[tuple[str, ...]]:
    """What rank ``p`` does in the redo, from DeepSpeed's own TrainSchedule: ("send"|"recv", kind, k)
    for live messages, ("F"|"B", k) for passes run; checks each pass has its inputs."""
    ops: list[tuple[str, ...]] = []
    count: dict[type, int] = {}
    have = {"act": set(p.served("act")), "grad": set(p.served("grad"))}
    for step in schedule.TrainSchedule(micro_batches=m, stages=stages, stage_id=stage):
        for cmd in step:
            k = count.get(type(cmd), 0)
            count[type(cmd)] = k + 1
            if isinstance(cmd, schedule.RecvActivation | schedule.RecvGrad):
                kind = "act" if isinstance(cmd, schedule.RecvActivation) else "grad"
                if p.recv(kind, k) == "live":
                    ops.append(("recv", kind, str(k)))
                    have[kind].add(k)
            elif isinstance(cmd, schedule.SendActivation | schedule.SendGrad):
                kind = "act" if isinstance(cmd, schedule.SendActivation) else "grad"
                if p.send(kind, k) == "live":
                    ops.append(("send", kind, str(k)))
            elif isinstance(cmd, schedule.ForwardPass | schedule.BackwardPass) and p.runs(k):
                fwd = isinstance(cmd, schedule.ForwardPass)
                if fwd and stage > 0:
                    assert k in have["act"], (p, k)
                if not fwd and stage < stages - 1:
                    assert k in have["grad"], (p, k)
                ops.append(("F" if fwd else "B", str(k)))
    return ops


def run_blocking(programs: list[list[tuple[str, ...]]]) -> None:
    """Execute the ranks' programs with rendezvous sends and receives (the strictest semantics);
    a state where nobody can move is a deadlock."""
    pos = [0] * len(programs)
    while any(pos[s] < len(programs[s]) for s in range(len(programs))):
        moved = False
        for s, prog in enumerate(programs):
            if pos[s] >= len(prog):
                continue
            op = prog[pos[s]]
            if op[0] in ("F", "B"):
                pos[s] += 1
                moved = True
                continue
            peer = s + 1 if (op[0], op[1]) in (("send", "act"), ("recv", "grad")) else s - 1
            want = ("recv" if op[0] == "send" else "send", op[1], op[2])
            if 0 <= peer < len(programs) and pos[peer] < len(programs[peer]) and programs[peer][pos[peer]] == want:
                pos[s] += 1
                pos[peer] += 1
                moved = True
        assert moved, f"deadlock at {[p[i] if i < len(p) else None for p, i in zip(programs, pos)]}"


@pytest.mark.parametrize("stages", [2, 3])
def test_every_redo_pairs_its_messages_in_order_and_runs_each_lost_pass_once(stages: int) -> None:
    """For every way a failure can leave one pipeline (survivors' finished passes: non-decreasing
    towards the last stage; any set of lost stages), the redo's live sends and receives pair up on
    each edge, nobody waits forever, every pass not kept runs once, and no kept pass runs again."""
    m = 4
    for lost_mask in range(1, 2**stages):
        lost = {s for s in range(stages) if lost_mask >> s & 1}
        for counts in itertools.product(range(m + 1), repeat=stages):
            alive = [counts[s] for s in range(stages) if s not in lost]
            if alive != sorted(alive):
                continue  # a stage cannot finish a backward pass before the stage after it
            inputs = agree(reports(lost, dict(enumerate(counts)), pp=stages, dp=1))
            ps = [rank_passes(inputs, s, m) for s in range(stages)]
            progs = [program(ps[s], s, stages, m) for s in range(stages)]
            run_blocking(progs)
            for s in range(stages):
                kept = 0 if s in lost else counts[s]
                assert [op for op in progs[s] if op[0] == "F"] == [("F", str(k)) for k in range(kept, m)]
                assert [op for op in progs[s] if op[0] == "B"] == [("B", str(k)) for k in range(kept, m)]
