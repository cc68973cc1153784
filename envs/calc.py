"""`loongsage/Calc-v0`: arithmetic word problems with a `calculator` tool.

Tasks are generated (no download): a person starts with some items and a few events change the
count ("gets 7 more", "splits them into 4 equal groups and keeps one"). Every intermediate value is
a non-negative integer. `difficulty` (0-3, or "easy"/"medium"/"hard"/"expert") sets the number
of steps, the operations and the size of the numbers:

    0  one step, + or -, numbers up to 10       (the CPU quickstart trains on this)
    1  one step, + - x /, numbers up to 100
    2  two steps, + - x /, numbers up to 500
    3  three steps, + - x /, numbers up to 5000 (the calculator pays off)

`calculator=False` removes the tool (and the tool text from the system prompt): a 135M model
given the tool schemas tends to echo them instead of answering.

SmolLM2-135M-Instruct before training, on 48 eval tasks (HF transformers, gateway rendering,
128 new tokens): difficulty 0 without the calculator 23% greedy, 8% at temperature 0.7, 6% at
0.5, 0% at 1.0; with the calculator 0% (it never emits a tool call); difficulty 1 and 3: 0%.

The task text ends by asking for `Answer: <number>`. The reward is 1.0 when the final message's
last `Answer:` (rest of its line; else the last `\\boxed{...}`) is the right number (whitespace,
`**`, thousands commas and a trailing period are forgiven; "42.0" equals 42; "42 apples" and
"The answer is 42" do not count), else 0.0.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

import numpy as np

from envs.base import Task, ToolEnv, extract_answer

LEVELS = {"easy": 0, "medium": 1, "hard": 2, "expert": 3}
# level -> (steps, operations, start range, add/sub operand range, factor range)
_PARAMS = {
    0: (1, "+-", (1, 10), (1, 5), (2, 5)),
    1: (1, "+-*/", (10, 100), (2, 50), (2, 9)),
    2: (2, "+-*/", (10, 500), (2, 200), (2, 12)),
    3: (3, "+-*/", (100, 5000), (10, 2000), (2, 25)),
}
_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira"]
_ITEMS = ["apples", "stickers", "marbles", "books", "coins", "pencils", "cards", "shells"]


class CalcEnv(ToolEnv):
    """Arithmetic word problems; answer with `Answer: <number>`; a calculator tool helps."""

    answer_format = "End your final answer with a line of the form `Answer: <number>`."

    def __init__(
        self,
        *,
        difficulty: int | str = 0,
        calculator: bool = True,
        max_turns: int = 4,
        **kwargs: Any,
    ) -> None:
        level = LEVELS.get(difficulty, difficulty) if isinstance(difficulty, str) else difficulty
        if level not in _PARAMS:
            raise ValueError(
                f"difficulty={difficulty!r}: pass 0, 1, 2, 3 or one of {sorted(LEVELS)}"
            )
        self.difficulty = level
        self.use_calculator = calculator
        super().__init__(max_turns=max_turns, **kwargs)

    def tools(self):
        return [calculator] if self.use_calculator else []

    def sample_task(self, rng: np.random.Generator) -> Task:
        steps, ops, (lo, hi), (alo, ahi), (flo, fhi) = _PARAMS[self.difficulty]
        name = _NAMES[rng.integers(len(_NAMES))]
        item = _ITEMS[rng.integers(len(_ITEMS))]
        value = int(rng.integers(lo, hi + 1))
        sentences = [f"{name} has {value} {item}."]
        for step in range(steps):
            op = ops[rng.integers(len(ops))]
            if op == "-" and value < 2:
                op = "+"
            if op == "/" and value < 2:
                op = "*"
            then = "Then " if step else ""
            if op == "+":
                n = int(rng.integers(alo, ahi + 1))
                value += n
                sentences.append(f"{then}{name} gets {n} more {item}.")
            elif op == "-":
                n = int(rng.integers(1, min(ahi, value) + 1))
                value -= n
                sentences.append(f"{then}{name} gives away {n} {item}.")
            elif op == "*":
                n = int(rng.integers(flo, fhi + 1))
                value *= n
                sentences.append(f"{then}{name} ends up with {n} times as many {item}.")
            else:
                # Pick a divisor of the current value so the answer stays an integer.
                divisors = [d for d in range(flo, fhi + 1) if value % d == 0]
                if not divisors:
                    n = int(rng.integers(alo, ahi + 1))
                    value += n
                    sentences.append(f"{then}{name} gets {n} more {item}.")
                    continue
                n = divisors[rng.integers(len(divisors))]
                value //= n
                sentences.append(
                    f"{then}{name} splits the {item} into {n} equal groups and keeps "
                    "only one group."
                )
        sentences.append(f"How many {item} does {name} have now?")
        # Small models follow a format asked for in the user turn far more often than one in
        # the system prompt (SmolLM2-135M: 21% vs 0% on difficulty 0), so it is repeated here.
        sentences.append("Put your final answer on its own line as: Answer: <number>")
        return Task(prompt=" ".join(sentences), answer=value)

    def score(self, task: Task, final_answer: str) -> float:
        return float(parse_number(extract_answer(final_answer)) == task.answer)


def parse_number(text: str | None) -> float | None:
    """The number `text` is (thousands commas allowed), or None if it is anything else."""
    if text is None:
        return None
    text = text.replace(",", "").strip()
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# ---- the calculator: a safe evaluator over Python's arithmetic AST ------------------------
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_MAGNITUDE = 1e100


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % ** ^ and parentheses, e.g. "(12 + 30) * 4".
    """
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    if len(text) > 500:
        raise ValueError("expression too long (500 characters at most)")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 10) if isinstance(value, float) else value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: use numbers and + - * / ( )")
