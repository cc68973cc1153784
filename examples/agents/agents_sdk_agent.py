"""An agent written with the `openai-agents` SDK: a calculator tool. Knows nothing of LoongSage.

It uses the SDK's chat-completions model class with the default `AsyncOpenAI` client, which reads
only `OPENAI_BASE_URL` and `OPENAI_API_KEY`; tracing is off (a sandbox has no network). The task
comes from argv or `task.txt`, the agent's instructions from `instructions.txt` when there is one;
the final answer goes to `answer.txt` and stdout.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python3 agents_sdk_agent.py "17*23"
"""

import asyncio
import sys
from pathlib import Path

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

INSTRUCTIONS = "Use the calculate tool, then reply with the final number."


@function_tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. 17*23."""
    allowed = set("0123456789+-*/(). ")
    if not expression or not set(expression) <= allowed or "**" in expression:
        return "error: only digits, + - * / ( ) are allowed"
    try:
        value = eval(expression, {"__builtins__": {}}, {})  # characters checked above
    except (SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


async def main() -> None:
    set_tracing_disabled(True)
    task = " ".join(sys.argv[1:]) or Path("task.txt").read_text().strip()
    instructions = Path("instructions.txt")
    client = AsyncOpenAI()
    model_name = (await client.models.list()).data[0].id
    agent = Agent(
        name="calculator",
        instructions=instructions.read_text() if instructions.exists() else INSTRUCTIONS,
        tools=[calculate],
        model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
        model_settings=ModelSettings(max_tokens=128),
    )
    try:
        result = await Runner.run(agent, task, max_turns=6)
        answer = str(result.final_output).strip()
    except MaxTurnsExceeded:
        answer = ""
    Path("answer.txt").write_text(answer + "\n")
    print(answer)


if __name__ == "__main__":
    asyncio.run(main())
