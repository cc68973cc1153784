from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from gateway.config import ConfigError, describe, load_config, parse_cli


@dataclass
class Inner:
    kind: Literal["local", "sglang"] = "local"
    """Which engine."""
    urls: list[str] = field(default_factory=list)
    """Server URLs."""


@dataclass
class Outer:
    port: int = 8000
    """TCP port."""
    lr: float = 1e-6
    """Learning rate."""
    name: str | None = None
    """Optional name."""
    engine: Inner = field(default_factory=Inner)
    """Engine settings."""


def test_defaults_recipe_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("port: 9000\nengine:\n  kind: sglang\n")
    cfg = load_config(Outer, recipe, ["engine.urls=[http://a, http://b]", "lr=1", "name=x"])
    assert cfg.port == 9000 and cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert load_config(Outer, None, ["lr=1e-4"]).lr == 1e-4
    assert cfg.engine == Inner(kind="sglang", urls=["http://a", "http://b"])
    assert cfg.name == "x"


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown key engine\.kin.*did you mean engine\.kind"):
        load_config(Outer, None, ["engine.kin=local"])
    with pytest.raises(ConfigError, match="did you mean port"):
        load_config(Outer, None, ["prot=1"])


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="port: expected int"):
        load_config(Outer, None, ["port=abc"])
    with pytest.raises(ConfigError, match="engine.kind: 'gpu' is not one of"):
        load_config(Outer, None, ["engine.kind=gpu"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Outer, None, ["port"])


def test_recipe_lookup_and_help(tmp_path, capsys):
    (tmp_path / "quick.yaml").write_text("port: 1\n")
    assert parse_cli(Outer, ["recipe=quick"], recipe_dir=tmp_path).port == 1
    with pytest.raises(ConfigError, match="did you mean recipe=quick"):
        parse_cli(Outer, ["recipe=quik"], recipe_dir=tmp_path)
    with pytest.raises(SystemExit):
        parse_cli(Outer, ["--help"])
    out = capsys.readouterr().out
    assert "engine.kind = 'local'  # Which engine." in out
    assert describe(Outer)[0] == "port = 8000  # TCP port."


def test_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(Outer, bad)


@dataclass
class Agent:
    files: dict[str, str] = field(default_factory=dict)
    """Work path -> host file."""


@dataclass
class WithMapping:
    agent: Agent = field(default_factory=Agent)
    """A nested config with a mapping."""


def test_nested_mapping_errors_name_the_key_and_the_value():
    cfg = load_config(WithMapping, None, ["agent.files={agent.py: /path, n: 3}"])
    assert cfg.agent.files == {"agent.py": "/path", "n": "3"}
    # YAML reads `{a:b}` (no space) as the key "a:b" with no value
    with pytest.raises(
        ConfigError, match=r"agent\.files\.agent\.py:/path: expected str, got None;"
    ):
        load_config(WithMapping, None, ["agent.files={agent.py:/path}"])
    with pytest.raises(ConfigError, match=r"agent\.files\.x: expected str, got \[1, 2\]"):
        load_config(WithMapping, None, ["agent.files.x=[1, 2]"])
    with pytest.raises(ConfigError, match=r"agent\.files: expected a mapping, got 'a'"):
        load_config(WithMapping, None, ["agent.files=a"])
