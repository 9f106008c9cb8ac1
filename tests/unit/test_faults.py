"""Fault specs (parsing, errors) and the once-only injector, without processes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_swift.jobstore.membership import WorkerEnv
from ds_swift.testing.faults import PHASES, FaultSpec, FaultSpecError, Injector, format_specs, unfired


class FakeStore:
    """The two calls the injector makes, on a dict; counts them."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.calls = 0

    def add(self, key: str, amount: int) -> int:
        self.calls += 1
        value = int(self.data.get(key, "0")) + amount
        self.data[key] = str(value)
        return value

    def set(self, key: str, value: str) -> None:
        self.calls += 1
        self.data[key] = value

    def get(self, key: str) -> str | None:
        return self.data.get(key)


class Kills:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


# ---------------------------------------------------------------------- parsing
def test_parse_one_spec_with_default_phase() -> None:
    assert FaultSpec.parse("machine=1,iteration=7") == [FaultSpec(1, 7, "forward")]


def test_parse_several_specs_whitespace_and_case() -> None:
    specs = FaultSpec.parse(" machine=1, iteration=7 ,Phase=BACKWARD ; machine=0,iteration=2,phase=recv;")
    assert specs == [FaultSpec(1, 7, "backward"), FaultSpec(0, 2, "recv")]


def test_parse_empty_is_no_spec() -> None:
    assert FaultSpec.parse("") == [] and FaultSpec.parse(" ; ") == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("machine=1", "lacks iteration="),
        ("iteration=3", "lacks machine="),
        ("machine=1,iteration=3,phase=sideways", "forward|backward|step|send|recv"),
        ("machine=x,iteration=3", "machine='x' is invalid: a non-negative integer"),
        ("machine=1,iteration=-2", "iteration=-2 is invalid"),
        ("machine=1,iteration=3,rank=2", "unknown field 'rank'; the fields are machine, iteration, phase"),
        ("machine=1,machine=2,iteration=3", "field 'machine' is given twice"),
        ("machine=1,iteration", "'iteration' is not field=value"),
        ("machine=1,iteration=", "is not field=value"),
    ],
)
def test_parse_errors_name_the_field(text: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.parse(text)
    assert fragment in str(info.value)
    assert text in str(info.value)  # the user sees which spec was wrong


def test_constructor_validates() -> None:
    with pytest.raises(FaultSpecError, match="phase"):
        FaultSpec(0, 1, "bwd")
    with pytest.raises(FaultSpecError, match="machine"):
        FaultSpec(True, 1)  # type: ignore[arg-type]


specs_strategy = st.lists(
    st.builds(FaultSpec, machine=st.integers(0, 512), iteration=st.integers(0, 10**6), phase=st.sampled_from(PHASES)),
    max_size=6,
)


@given(specs_strategy)
def test_format_then_parse_round_trips(specs: list[FaultSpec]) -> None:
    assert FaultSpec.parse(format_specs(specs)) == specs


# ---------------------------------------------------------------------- injector
def test_fires_once_at_the_matching_point_only() -> None:
    store, kills = FakeStore(), Kills()
    inj = Injector(FaultSpec.parse("machine=1,iteration=3,phase=backward"), store, machine=1, rank=2, kill=kills)
    inj.maybe_fire("forward", 3)
    inj.maybe_fire("backward", 2)
    assert kills.count == 0 and store.calls == 0  # non-matching calls never touch the store
    inj.maybe_fire("backward", 3)
    assert kills.count == 1 and inj.fired == 1
    assert store.data["inject/0/fired"] == "1" and store.data["inject/0/rank"] == "2"
    assert float(store.data["inject/0/t_fire"]) > 0
    inj.maybe_fire("backward", 3)  # the same process again (e.g. the iteration is replayed)
    assert kills.count == 1 and not inj.armed


def test_other_machines_never_fire() -> None:
    store, kills = FakeStore(), Kills()
    inj = Injector(FaultSpec.parse("machine=1,iteration=3"), store, machine=0, kill=kills)
    inj.maybe_fire("forward", 3)
    assert kills.count == 0 and store.calls == 0 and not inj.armed


def test_sibling_ranks_and_replacements_do_not_fire_again() -> None:
    store = FakeStore()
    specs = FaultSpec.parse("machine=1,iteration=3")
    first, sibling, replacement = Kills(), Kills(), Kills()
    Injector(specs, store, machine=1, rank=2, kill=first).maybe_fire("forward", 3)
    Injector(specs, store, machine=1, rank=3, kill=sibling).maybe_fire("forward", 3)
    # A replacement of machine 1 re-runs iteration 3 after recovery: the spec must not kill it too.
    Injector(specs, store, machine=1, rank=2, kill=replacement).maybe_fire("forward", 3)
    assert (first.count, sibling.count, replacement.count) == (1, 0, 0)
    assert store.data["inject/0/rank"] == "2"


def test_chained_specs_fire_each_once() -> None:
    store, kills = FakeStore(), Kills()
    specs = FaultSpec.parse("machine=0,iteration=1,phase=step;machine=1,iteration=1;machine=0,iteration=4,phase=send")
    inj = Injector(specs, store, machine=0, kill=kills)
    for it in range(6):
        for phase in PHASES:
            inj.maybe_fire(phase, it)
    assert inj.fired_specs == [specs[0], specs[2]]
    assert "inject/1/fired" not in store.data  # machine 1's spec is keyed by its own index, untouched


def test_unknown_phase_is_an_error() -> None:
    inj = Injector([], FakeStore(), machine=0, kill=Kills())
    with pytest.raises(ValueError, match="phase='fwd'"):
        inj.maybe_fire("fwd", 0)


def test_from_env_reads_swift_inject() -> None:
    env = WorkerEnv(
        rank=3,
        local_rank=1,
        world_size=4,
        machine=1,
        num_machines=2,
        generation=0,
        replacement=False,
        store_addr="127.0.0.1",
        store_port=1,
        token="t",
        run_dir="/tmp",
        inject="machine=1,iteration=2;machine=0,iteration=1",
    )
    inj = Injector.from_env(FakeStore(), env)
    assert inj.machine == 1 and inj.rank == 3 and len(inj.specs) == 2 and inj.armed


def test_a_settled_spec_fires_only_once_the_copies_of_the_iteration_before_landed() -> None:
    """``settled=1``: the buddy round of iteration 6 must have landed (its verdict key, generation 2)
    before a kill at iteration 7: a kill early in the iteration otherwise races those copies."""
    (spec,) = FaultSpec.parse("machine=1,iteration=7,phase=forward,settled=1")
    assert spec.settled and FaultSpec.parse(format_specs([spec])) == [spec]
    with pytest.raises(FaultSpecError, match="settled='yes' is invalid: 0 or 1"):
        FaultSpec.parse("machine=1,iteration=7,settled=yes")

    class Landing(FakeStore):
        asked = 0

        def generation(self) -> int:
            return 2

        def get(self, key: str) -> str | None:
            assert key == "buddy/2/6/verdict"
            self.asked += 1
            return "1" if self.asked >= 3 else None

        def wait_value(self, key: str, timeout_s: float) -> str | None:
            # as JobStore.wait_value: read until the key is set; nothing was killed meanwhile
            assert kills.count == 0 and timeout_s > 0
            while (value := self.get(key)) is None:
                pass
            return value

    store, kills = Landing(), Kills()
    Injector([spec], store, machine=1, rank=1, kill=kills).maybe_fire("forward", 7)
    assert store.asked == 3 and kills.count == 1


def test_the_launcher_names_a_spec_that_never_fired() -> None:
    # --inject machine=1,iteration=50 with --train-iters 2 ended "0 machine failure(s)", exit 0, no word.
    store, kills = FakeStore(), Kills()
    specs = FaultSpec.parse("machine=1,iteration=1,phase=backward;machine=0,iteration=50")
    Injector(specs, store, machine=1, kill=kills).maybe_fire("backward", 1)
    said = unfired(specs, store)
    assert said is not None and said.startswith("--inject #1 (machine=0,iteration=50") and "#0" not in said
    Injector(specs, store, machine=0, kill=kills).maybe_fire("forward", 50)
    assert unfired(specs, store) is None and kills.count == 2


def test_fields_separated_by_spaces_are_named_as_such() -> None:
    with pytest.raises(FaultSpecError, match="separate its fields with commas, not spaces"):
        FaultSpec.parse("machine=1 iteration=1")  # it said "lacks iteration="
