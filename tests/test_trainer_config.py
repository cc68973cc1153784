"""The trainer's config: recipes load, overrides apply, bad input names the field."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError
from trainer.config import RECIPE_DIR, TrainerConfig, load


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
def test_every_recipe_loads(recipe):
    assert isinstance(load([f"recipe={recipe}"]), TrainerConfig)


def test_recipe_then_overrides():
    cfg = load(["recipe=quickstart", "rollout.max_staleness=2", "train.lr=1.0e-4", "run.steps=3"])
    assert cfg.rollout.max_staleness == 2 and cfg.train.lr == 1e-4 and cfg.run.steps == 3
    assert cfg.model.name == "smollm2"  # from the recipe


def test_recipe_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("rollout:\n  batch_size: 3\n")
    assert load([f"recipe={path}"]).rollout.batch_size == 3


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean rollout.max_staleness"):
        load(["rollout.max_stalenes=1"])


def test_unknown_recipe_suggests_one():
    with pytest.raises(ConfigError, match="did you mean recipe=quickstart"):
        load(["recipe=quikstart"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.num_samples_per_prompt=1", "num_samples_per_prompt must be >= 2"),
        ("rollout.max_staleness=-1", "max_staleness must be >= 0"),
        ("algorithm.is_threshold=0.5", "is_threshold must be > 1"),
        ("algorithm.importance_sampling=foo", "importance_sampling"),
        ("train.dtype=fp16", "train.dtype"),
        ("train.lr=0", "lr must be > 0"),
        ("run.steps=0", "steps must be > 0"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load([override])
