"""A plain OpenAI-SDK tool-calling agent: a calculator loop. Knows nothing of LoongSage.

It reads only `OPENAI_BASE_URL` and `OPENAI_API_KEY` (the SDK's defaults), its task from argv
or `task.txt` and its system prompt from `instructions.txt` when there is one, asks the first model the server lists, runs the `calculate` tool whenever the model
calls it, and writes the model's final answer to `answer.txt` (and stdout) for a verifier.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=... python3 openai_tool_agent.py "17*23"
"""

import ast
import json
import operator
import sys
from pathlib import Path

from openai import OpenAI

MAX_TURNS = 6
SYSTEM = "You are a careful calculator. Use the calculate tool, then reply with the final number."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 17*23"}},
                "required": ["expression"],
            },
        },
    }
]
OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Arithmetic only (no names, no calls), so the model cannot run code through the tool."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 100:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


def main() -> None:
    task = " ".join(sys.argv[1:]) or Path("task.txt").read_text().strip()
    client = OpenAI()
    model = client.models.list().data[0].id
    system = Path("instructions.txt")
    messages = [
        {"role": "system", "content": system.read_text() if system.exists() else SYSTEM},
        {"role": "user", "content": task},
    ]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=128
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            answer = (msg.content or "").strip()
            break
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
                result = calculate(str(args.get("expression", "")))
            except (json.JSONDecodeError, AttributeError) as e:
                result = f"error: bad arguments: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    Path("answer.txt").write_text(answer + "\n")
    print(answer)


if __name__ == "__main__":
    main()
