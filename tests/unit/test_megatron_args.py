"""--swift / --swift-config merge into the swift section, validated before training."""

from __future__ import annotations

import argparse
import json

import pytest

from ds_swift.config import ConfigError
from ds_swift.megatron import add_arguments, swift_section


def parse(argv: list[str]) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_flags_default_to_off_and_leave_the_section_alone() -> None:
    args = parse([])
    assert args.swift is False and args.swift_config is None
    assert swift_section(args, {"swift": {"strategy": "logging"}}) == {"strategy": "logging"}


def test_swift_flag_enables() -> None:
    assert swift_section(parse(["--swift"]), {})["enabled"] is True


def test_swift_config_file_replaces_section(tmp_path) -> None:
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"swift": {"checkpoint": {"interval": 7}}}))
    sec = swift_section(parse(["--swift", "--swift-config", str(f)]), {"swift": {"strategy": "logging"}})
    assert sec == {"checkpoint": {"interval": 7}, "enabled": True}


def test_bad_values_fail_before_training(tmp_path) -> None:
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"swift": {"checkpoint": {"interval": 0}}}))
    with pytest.raises(ConfigError, match="checkpoint.interval"):
        swift_section(parse(["--swift-config", str(f)]), {})
    g = tmp_path / "t.json"
    g.write_text(json.dumps({"train_batch_size": 4}))
    with pytest.raises(ConfigError, match="no 'swift' key"):
        swift_section(parse(["--swift-config", str(g)]), {})


@pytest.mark.parametrize("section", ["on", 1, [1], [["enabled", True]]])
def test_a_swift_section_that_is_not_an_object_is_named(tmp_path, section) -> None:
    # It was a TypeError / ValueError from dict() deep in the launcher's preflight.
    with pytest.raises(ConfigError, match="the DeepSpeed config's swift must be a JSON object"):
        swift_section(parse(["--swift"]), {"swift": section})
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"swift": section}))
    with pytest.raises(ConfigError, match=f"--swift-config '{f}': swift must be a JSON object"):
        swift_section(parse(["--swift", "--swift-config", str(f)]), {})
    with pytest.raises(ConfigError, match="--swift-config: DeepSpeed config .* cannot be read"):
        swift_section(parse(["--swift", "--swift-config", str(tmp_path / "none.json")]), {})


@pytest.mark.parametrize(("checkpoint", "allowed"), [(None, "checkpoint must be a JSON object"), (["a"], "checkpoint")])
def test_a_checkpoint_section_that_is_not_an_object_is_named_beside_save(checkpoint, allowed) -> None:
    args = parse(["--swift"])
    args.save = "/ckpt"  # Megatron's --save (its own parser's flag)
    with pytest.raises(ConfigError, match=allowed):
        swift_section(args, {"swift": {"checkpoint": checkpoint}})
    assert swift_section(args, {"swift": {}})["checkpoint"] == {"dir": "/ckpt"}
