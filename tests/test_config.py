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
