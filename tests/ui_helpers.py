"""Helpers of the UI tests (test_ui.py, test_ui_browser.py).

`tool_agent` is a scripted multi-turn tool-calling agent: the real `openai` SDK against a real
gateway and engine. Every turn but the last forces a call of `lookup` (`tool_choice` by name), so
even the tiny random model answers with tool calls; the agent sends a tool result for each call,
re-sending its whole history as agents do, and the last turn is free text. `make_run_dir` lays out
a run directory as `trainer.run` leaves it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from gateway.trajectory import Trajectory
from trainer.metrics import MetricsLogger, SamplesLog, plot_run

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up in the dictionary.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
]


async def tool_agent(
    client: Any,
    model: str,
    turns: int = 3,
    *,
    after_turn: Callable[[int], Awaitable[None]] | None = None,
    tool_result: Callable[[int], str] = lambda i: f"lookup result {i}: a long dragon",
    max_tokens: int = 16,
) -> tuple[list[Any], list[str]]:
    """Run `turns` calls; returns the tool calls the agent got and the tool results it sent."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. Use the tools."},
        {"role": "user", "content": "What does 'loong' mean? Look it up."},
    ]
    calls, results = [], []
    for i in range(turns):
        forced = i < turns - 1
        r = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "lookup"}} if forced else "none",
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            calls.append(call)
            results.append(tool_result(i))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": results[-1]})
        if after_turn is not None:
            await after_turn(i)
    return calls, results


def perturbed_norm(model_path: Path, scale: float = 1.5) -> dict[str, torch.Tensor]:
    """A subset of the weights, changed: enough for a weight swap with a new version."""
    weight = load_file(str(Path(model_path) / "model.safetensors"))["model.norm.weight"]
    return {"model.norm.weight": weight * scale}


def make_run_dir(
    run_dir: Path,
    samples: dict[int, list[Trajectory]],
    decode: Callable[[list[int]], str] | None = None,
) -> None:
    """A run directory as trainer.run leaves it: config.yaml, 21 steps of metrics.jsonl,
    samples.jsonl (the trajectories of each step given) and the plots."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"name": "tiny"},
        "rollout": {"env": "Lookup-v0"},
        "agent": {"kind": "tool_loop"},
    }
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = MetricsLogger(run_dir)
    for step in range(21):
        rows = {"reward/mean": step / 20, "mismatch/k3_kl": 1e-6 * step, "time/train_s": 0.5}
        metrics.log(step, rows)
    metrics.close()
    log = SamplesLog(run_dir, 4, decode)
    for step, trajectories in sorted(samples.items()):
        log.write(step, trajectories)
    plot_run(run_dir)
