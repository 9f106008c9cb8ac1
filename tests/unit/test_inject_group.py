"""``--inject machine=1+2,...`` kills several machines at one instant (issue 30, item 8): one spec,
fired by the first rank of the group to reach the point; every machine of the group is killed by
its agent on the spec's key, and none declares until all are down, so the failure is one, in the
generation the spec fired in (two separate specs fire as each machine reaches the point: under
load, two failures in two generations)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from ds_swift.jobstore.membership import JobStore, fate_key
from ds_swift.launch.agent import JobSpec, MachineAgent
from ds_swift.launch.args import Command, LaunchUsageError, parse_args
from ds_swift.launch.control import EventLog, JobControl
from ds_swift.testing.faults import FaultSpec, FaultSpecError, Injector


def test_a_group_spec_parses_prints_and_is_checked() -> None:
    (spec,) = FaultSpec.parse("machine=1+2,iteration=8,phase=backward")
    assert spec.machines == (1, 2) and spec.machine == 1 and spec.group
    assert str(spec) == "machine=1+2,iteration=8,phase=backward" and FaultSpec.parse(str(spec)) == [spec]
    (one,) = FaultSpec.parse("machine=3,iteration=1")
    assert one.machines == (3,) and not one.group and str(one) == "machine=3,iteration=1,phase=forward"
    with pytest.raises(FaultSpecError, match=r"machine=1\+1 names a machine twice"):
        FaultSpec.parse("machine=1+1,iteration=8")
    with pytest.raises(FaultSpecError, match=r"machine='1\+x' is invalid"):
        FaultSpec.parse("machine=1+x,iteration=8")
    with pytest.raises(LaunchUsageError, match=r"machine=4 does not exist: the job has machines 0\.\.3"):
        parse_args(["--nnodes", "4", "--inject", "machine=1+4,iteration=8", "t.py"], environ={})


class Store:
    """A dict-backed stand-in for the job store's counters and keys (the injector's side)."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def add(self, key: str, amount: int) -> int:
        self.kv[key] = str(int(self.kv.get(key, "0")) + amount)
        return int(self.kv[key])

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value

    def generation(self) -> int:
        return 4


def test_the_first_rank_of_the_group_fires_for_every_machine_of_it() -> None:
    from ds_swift.testing.faults import group_kill_key

    specs = FaultSpec.parse("machine=1+2,iteration=8,phase=backward")
    store, kills = Store(), []
    second = Injector(specs, store, machine=2, rank=2, kill=lambda: kills.append(2))
    first = Injector(specs, store, machine=1, rank=1, kill=lambda: kills.append(1))
    second.maybe_fire("backward", 8)  # machine 2's rank reached the point first
    first.maybe_fire("backward", 8)
    assert kills == [2] and store.kv[group_kill_key(0)] == "4"  # the generation it fired in


class Worker:
    def __init__(self, rank: int) -> None:
        self.pid, self.rank, self.generation = 1000 + rank, rank, 0
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def signal_group(self, sig: int) -> None:
        if sig == signal.SIGKILL and self.code is None:
            self.code = -signal.SIGKILL


def test_the_agents_kill_the_group_together_and_declare_one_failure(tmp_path: Path) -> None:
    from ds_swift.testing.faults import group_kill_key

    store = JobStore.host("unit-inject-group")
    specs = tuple(FaultSpec.parse("machine=1+2,iteration=8,phase=backward"))
    job = JobSpec(
        Command("t.py"), 3, 1, 2, 3, None, "127.0.0.1", store.port, "unit-inject-group", str(tmp_path), inject=specs
    )
    workers: dict[int, Worker] = {}

    def spawn(command: Any, wenv: Any, n: int, t: Any) -> Worker:
        workers[wenv.machine] = Worker(wenv.rank)
        return workers[wenv.machine]

    agents = [MachineAgent(n, job, store, EventLog(str(tmp_path)), spawn=spawn) for n in range(3)]
    for agent in agents:
        agent.start()
    # Machine 1's rank fires: it sets the group's key and SIGKILLs itself.
    store.set(group_kill_key(0), "0")
    workers[1].code = -signal.SIGKILL
    agents[1].tick()
    assert store.failure(0) is None, "declared before machine 2 was down"
    agents[2].tick()  # sees the key: kills its machine, now the group is down
    assert workers[2].code == -signal.SIGKILL and workers[0].code is None
    for agent in agents:
        agent.tick()
    assert store.failure(0) is not None and store.generation() == 1
    assert store.failure(1) is None  # one failure: the second machine did not fail generation 1
    assert store.get(fate_key(0, 1)) == "spare" and store.get(fate_key(0, 2)) == "spare"
    assert JobControl(store).failures() == 2
