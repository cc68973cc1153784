"""metrics.jsonl, resume truncation, missing optional loggers, and the PNG plots."""

from __future__ import annotations

import importlib.util
import json

import pytest

from trainer.metrics import MetricsLogger, plot_run, read_metrics


def fake_step(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step,
        "time/generation_wait_s": 0.5,
        "time/train_s": 1.0,
        "time/weight_sync_s": 0.1,
        "mismatch/logprob_abs_diff": 0.01,
        "mismatch/k3_kl": 0.001,
        "mismatch/ratio_max": 1.2,
        "mismatch/ratio_min": 0.8,
        "mismatch/clip_frac": 0.0,
    }


def test_one_line_per_step_and_plots(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(0, {"eval/success_rate": 0.25})
    for step in range(1, 4):
        log.log(step, fake_step(step) | {"bad": float("nan")})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["reward/mean"] == pytest.approx(0.2) and rows[2]["bad"] is None
    assert all(r["time_s"] >= 0 for r in rows)
    paths = plot_run(tmp_path)
    assert {p.name for p in paths} == {"reward.png", "mismatch.png", "timeline.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_drops_the_steps_to_redo(tmp_path):
    log = MetricsLogger(tmp_path)
    for step in range(5):
        log.log(step, {"x": step})
    log.close()
    log = MetricsLogger(tmp_path, resume_step=2)
    log.log(3, {"x": 30})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 30)]
    assert rows[3]["time_s"] >= rows[2]["time_s"]  # wall time continues across a resume


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_missing_wandb_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="logging.wandb=true"):
        MetricsLogger(tmp_path, wandb=True)


def test_tensorboard_writes_events(tmp_path):
    """tensorboard is in the `test` extra, so this runs in CI; the events read back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"reward/mean": 0.5})
    log.log(2, {"reward/mean": 0.75})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.5), (2, 0.75)]
