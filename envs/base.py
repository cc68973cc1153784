"""`ToolEnv`: the Gymnasium base class of every LoongSage tool environment, and its contract.

A tool environment is a `gymnasium.Env` whose observations and actions are text. One episode is
one task: `reset` draws a task and returns the user message; each `step` takes one assistant
message, runs the tool calls in it, and returns the tool results; a message without tool calls
is the final answer, which the env's reward function scores.

The contract with the agent loop (`trainer/agentflow.py`, `python -m envs.eval`)
--------------------------------------------------------------------------------
`obs, info = env.reset(seed=None, options=None)`
    `obs` is the task text: the first user message. `info` holds
    - `system` (str): the system prompt. It says that tools are called through the chat API's
      tool interface (OpenAI chat-completions `tools` / `tool_calls`; the gateway renders them
      for the model's template), and in which format to give the final answer.
    - `tools` (list[dict]): the OpenAI tool schemas, `{"type": "function", "function":
      {"name", "description", "parameters"}}`, ready to pass as `tools=` to chat completions.
      May be empty (an env without tools).
    - `messages` (list[dict]): `[{"role": "system", ...}, {"role": "user", ...}]`, the same
      two texts as chat messages, for convenience.
    - `task_id` (str): `"eval/<index>"` for eval tasks, `"train/<hash of the prompt>"` else.
    - `split` (`"train"` | `"eval"`), `max_turns` (int).

    Task choice: `reset(seed=s)` draws a training task from the env's own generator, seeded,
    so the same seed gives the same task (a GRPO group is N envs reset with one seed);
    `reset()` without a seed draws the next task from the env's RNG. Training tasks never
    equal a held-out eval task (they are re-drawn when they do).

    Eval split: a fixed, held-out list per env configuration (same kwargs, same list, on every
    machine). `env.unwrapped.eval_tasks()` returns it (list of `Task`, of length `eval_size`);
    `reset(options={"split": "eval", "index": i})` plays eval task `i`.

`obs, reward, terminated, truncated, info = env.step(action)`
    `action` (str) is one assistant message: either the JSON of an OpenAI assistant message,
    `{"content": str | null, "tool_calls": [{"id", "type": "function", "function": {"name",
    "arguments"}}]}` (`arguments` a JSON string as OpenAI sends it, or an object), or plain
    text, which is that message's content with no tool calls.
    - With tool calls: each call is run and `obs` is the tool results' text (joined by blank
      lines). `info["tool_messages"]` holds one OpenAI tool message per call, `{"role": "tool",
      "tool_call_id", "name", "content"}`, in order, for the agent to append to its history.
      `reward` is 0.0, `terminated` False; once `max_turns` assistant messages have been taken
      without a final answer, `truncated` is True (reward 0.0, `info["reason"] ==
      "max_turns"`).
    - Without tool calls: this is the final answer. `terminated` is True, `reward` is the env's
      score of the content (in [0, 1]), `obs` is "", and `info` adds `final_answer`,
      `reference` (the expected answer, as text), `correct` (reward == 1) and `reason`
      (`"answered"`).
    - Every step's `info` has `turn` (assistant messages taken so far), `tool_messages`
      (empty when none) and `errors` (list of str: what was wrong with the message).
    A bad tool call (unknown tool, arguments that are not a JSON object, missing or unknown
    arguments, wrong argument types, a tool that raises) becomes that call's tool message,
    starting with "Error:", which the model sees; it is never an exception out of `step`.
    Unparseable model output (e.g. the gateway could not parse a tool call, so the text comes
    as content) is a final answer that scores 0. Passing a non-str action, stepping before
    `reset` or after the episode ended is a bug in the caller: `ValueError`/`RuntimeError`.
    `EnvError` is raised only when the environment itself fails (e.g. its sandbox cannot start);
    the agent loop records such an episode as an `error` rollout.

Registering an env (LoongSage's own are registered on `import envs`; a user's the same way)
------------------------------------------------------------------------------------------
Subclass `ToolEnv` in your own package, implement `sample_task` and `score`, add tools as
plain functions or methods with type hints and a Google-style docstring, and register it with
a versioned id and a lazy string entry point::

    # mypkg/envs.py
    import numpy as np
    from envs import Task, ToolEnv, extract_answer

    class WordLengthEnv(ToolEnv):
        answer_format = "End with a line `Answer: <number>`."

        def tools(self):
            return [self.count_letters]

        def count_letters(self, word: str) -> int:
            '''Count the letters of a word.

            Args:
                word: The word to measure.
            '''
            return sum(c.isalpha() for c in word)

        def sample_task(self, rng: np.random.Generator) -> Task:
            word = "".join(rng.choice(list("abcdefgh"), size=int(rng.integers(3, 12))))
            return Task(prompt=f"How many letters does {word!r} have?", answer=len(word))

        def score(self, task: Task, final_answer: str) -> float:
            return float(extract_answer(final_answer) == str(task.answer))

    # mypkg/__init__.py -- runs on `import mypkg`
    import gymnasium
    gymnasium.register(id="mypkg/WordLength-v0", entry_point="mypkg.envs:WordLengthEnv")

Then `gymnasium.make("mypkg:mypkg/WordLength-v0")` (the `module:` prefix imports `mypkg`
first) works anywhere an env id is accepted, e.g. `env=mypkg:mypkg/WordLength-v0` in a recipe.
Pass constructor arguments with `gymnasium.make(id, max_turns=4, ...)` or `kwargs=` in
`register`; set `nondeterministic=True` in `register` when the same seed and actions can give
different results (timeouts, external services).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium
import numpy as np
from gymnasium import spaces

MAX_TEXT_CHARS = 1 << 17
"""Longest action or observation in characters (131072): longer than any context we train on."""

# Surrogates are not characters; everything else in the Basic Multilingual Plane is sampled.
_BMP = "".join(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)


class EnvError(RuntimeError):
    """The environment itself failed (not the model): the rollout is an `error`, not a 0."""


class AnyText(spaces.Text):
    """A `spaces.Text` that contains every string up to `max_length` characters.

    Model output may hold any Unicode character (emoji live outside the BMP), and a charset of
    all 1.1M code points would cost ~100 MB per space, so `contains` accepts any `str` of
    allowed length, and `sample` draws from the whole Basic Multilingual Plane. The charset's
    tables are built once and shared by every space (read-only): building them took 33 ms, two
    per env, on the event loop of the run that makes an env per rollout.
    """

    def __init__(self, max_length: int = MAX_TEXT_CHARS, *, min_length: int = 0, seed=None):
        super().__init__(max_length, min_length=min_length, charset="a", seed=seed)
        self.__dict__.update(_bmp_tables())

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.min_length}, {self.max_length})"


@functools.cache
def _bmp_tables() -> dict[str, Any]:
    """`spaces.Text`'s charset attributes for the whole BMP."""
    text = spaces.Text(1, charset=_BMP)
    return {k: v for k, v in vars(text).items() if k.startswith("_char")}


@dataclass(frozen=True)
class Task:
    """One task: the user message, the reference answer, and what the env's tools/score need."""

    prompt: str
    answer: Any
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Short stable hash of the prompt (the identity used for the held-out check)."""
        return hashlib.sha1(self.prompt.encode()).hexdigest()[:12]


SYSTEM_PROMPT = (
    "You solve the user's task. {tool_text}When you are done, reply with a message that makes "
    "no tool call: that message is your final answer and ends the episode. {answer_format}"
)
_TOOL_TEXT = (
    "You have tools; call them through the function-calling interface (tool calls), one or "
    "more per message, and each result comes back to you as a tool message. "
)


class ToolEnv(gymnasium.Env[str, str]):
    """Base class of text tool environments; see the module docstring for the full contract.

    Subclasses implement `sample_task(rng)` and `score(task, final_answer)`, and may override
    `tools()` (default: none), `answer_format` (final-answer instructions for the system
    prompt), `instructions` (extra system-prompt text) and `make_eval_tasks()`.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    answer_format: str = "End your final answer with a line `Answer: <your answer>`."
    instructions: str = ""
    eval_seed: int = 20_261_202
    """Seed of the held-out eval split; fixed so every machine sees the same eval tasks."""

    def __init__(
        self,
        *,
        max_turns: int = 8,
        eval_size: int = 100,
        max_tool_output_chars: int = 4000,
        render_mode: str | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r}: pass a positive int (assistant messages)")
        if not isinstance(eval_size, int) or eval_size < 1:
            raise ValueError(f"eval_size={eval_size!r}: pass a positive int")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode={render_mode!r}: pass None or 'ansi'")
        self.max_turns = max_turns
        self.eval_size = eval_size
        self.max_tool_output_chars = max_tool_output_chars
        self.render_mode = render_mode
        self.observation_space = AnyText()
        self.action_space = AnyText()
        self._tools = {fn.__name__: fn for fn in self.tools()}
        self._schemas = [tool_schema(fn) for fn in self._tools.values()]
        self._eval: list[Task] | None = None
        self._eval_keys: frozenset[str] = frozenset()
        self.task: Task | None = None
        self._task_id = ""
        self._turn = 0
        self._done = True
        self._transcript: list[str] = []

    # ---- what a subclass provides -------------------------------------------------------
    def tools(self) -> list[Callable[..., Any]]:
        """The env's tools: functions (or bound methods) with type hints and docstrings."""
        return []

    def sample_task(self, rng: np.random.Generator) -> Task:
        """Draw one task using only `rng` (so a seed fixes the task)."""
        raise NotImplementedError

    def score(self, task: Task, final_answer: str) -> float:
        """Reward in [0, 1] for the final message's content; must not raise on any text."""
        raise NotImplementedError

    def make_eval_tasks(self) -> list[Task]:
        """The held-out split: `eval_size` distinct tasks drawn with the fixed `eval_seed`."""
        rng = np.random.default_rng(self.eval_seed)
        tasks: dict[str, Task] = {}
        for _ in range(self.eval_size * 20):
            task = self.sample_task(rng)
            tasks.setdefault(task.key, task)
            if len(tasks) == self.eval_size:
                break
        return list(tasks.values())

    # ---- the public surface -------------------------------------------------------------
    def eval_tasks(self) -> list[Task]:
        """The fixed held-out eval split (computed once per env instance)."""
        if self._eval is None:
            self._eval = self.make_eval_tasks()
            self._eval_keys = frozenset(t.key for t in self._eval)
        return list(self._eval)

    @property
    def system_prompt(self) -> str:
        text = SYSTEM_PROMPT.format(
            tool_text=_TOOL_TEXT if self._tools else "", answer_format=self.answer_format
        )
        return f"{text} {self.instructions}".strip()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = set(options) - {"split", "index"}
        if unknown:
            raise ValueError(f"reset options {sorted(unknown)} unknown; use 'split' and 'index'")
        split = options.get("split", "train")
        eval_tasks = self.eval_tasks()
        if split == "eval":
            index = options.get("index")
            if not isinstance(index, int) or not 0 <= index < len(eval_tasks):
                raise ValueError(
                    f"options['index']={index!r}: pass an int in [0, {len(eval_tasks)}) "
                    "to play that eval task"
                )
            self.task, self._task_id = eval_tasks[index], f"eval/{index}"
        elif split == "train":
            if "index" in options:
                raise ValueError("options['index'] selects an eval task; add 'split': 'eval'")
            self.task = self._draw_train_task()
            self._task_id = f"train/{self.task.key}"
        else:
            raise ValueError(f"options['split']={split!r}: pass 'train' or 'eval'")
        self._turn, self._done = 0, False
        self._transcript = [f"[system] {self.system_prompt}", f"[user] {self.task.prompt}"]
        info = {
            "system": self.system_prompt,
            "tools": copy.deepcopy(self._schemas),
            "messages": [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.task.prompt},
            ],
            "task_id": self._task_id,
            "split": split,
            "max_turns": self.max_turns,
        }
        return self.task.prompt, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise ValueError(f"action must be a str (an assistant message), got {type(action)}")
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended; call reset() to start a new one")
        self._turn += 1
        content, calls, errors = parse_assistant_message(action)
        info: dict[str, Any] = {"turn": self._turn, "tool_messages": [], "errors": errors}
        self._transcript.append(f"[assistant] {action}")
        if not calls and not errors:
            reward = float(self.score(self.task, content))
            self._done = True
            info.update(
                final_answer=content,
                reference=str(self.task.answer),
                correct=reward == 1.0,
                reason="answered",
            )
            self._transcript.append(f"[reward] {reward}")
            return "", reward, True, False, info

        for call in calls:
            text = self._run_tool_call(call)
            if text.startswith("Error:"):
                errors.append(text)
            info["tool_messages"].append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": call["name"],
                    "content": text,
                }
            )
        if not calls:  # tool_calls present but not a list: the model must still see why
            info["tool_messages"].append(
                {"role": "tool", "tool_call_id": "call_invalid", "name": "", "content": errors[0]}
            )
        obs = "\n\n".join(m["content"] for m in info["tool_messages"])[:MAX_TEXT_CHARS]
        self._transcript.append(f"[tool] {obs}")
        truncated = self._turn >= self.max_turns
        if truncated:
            self._done = True
            info["reason"] = "max_turns"
        return obs, 0.0, False, truncated, info

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return "\n".join(self._transcript) + "\n"
        return None

    def close(self) -> None:
        """Release what the env holds; safe to call any number of times."""
        self.task = None
        self._done = True

    # ---- internals ----------------------------------------------------------------------
    def _draw_train_task(self) -> Task:
        # Re-draw the (rare) training task that equals a held-out eval task.
        for _ in range(100):
            task = self.sample_task(self.np_random)
            if task.key not in self._eval_keys:
                return task
        return task

    def _run_tool_call(self, call: dict[str, Any]) -> str:
        if call["error"]:
            return call["error"]
        fn = self._tools.get(call["name"])
        if fn is None:
            names = ", ".join(self._tools) or "(none)"
            return f"Error: unknown tool {call['name']!r}; available tools: {names}."
        problem = check_arguments(fn, call["arguments"])
        if problem:
            return f"Error: {call['name']}: {problem}"
        try:
            result = fn(**call["arguments"])
        except EnvError:
            raise
        except Exception as e:  # a tool failing on the model's input is an observation
            return f"Error: {call['name']} raised {type(e).__name__}: {e}"
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        if len(text) > self.max_tool_output_chars:
            cut = len(text) - self.max_tool_output_chars
            text = text[: self.max_tool_output_chars] + f"\n... [{cut} more characters cut]"
        return text


# ---- parsing model output ---------------------------------------------------------------
def parse_assistant_message(action: str) -> tuple[str, list[dict[str, Any]], list[str]]:
    """(content, tool calls, errors) of an action; see the contract in the module docstring.

    Each call is `{"id", "name", "arguments": dict, "error": str}`; a call with an `error` is
    reported to the model instead of run. Text that is not the JSON of an assistant message is
    plain content.
    """
    message = None
    if action.lstrip().startswith("{"):
        try:
            message = json.loads(action)
        except (json.JSONDecodeError, RecursionError):
            message = None
    if not isinstance(message, dict) or not {"content", "tool_calls", "role"} & message.keys():
        return action, [], []
    content = message.get("content")
    content = content if isinstance(content, str) else ""
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        return content, [], ["Error: `tool_calls` must be a list of tool calls."]
    calls = []
    for i, raw in enumerate(raw_calls):
        call = {"id": f"call_{i}", "name": "", "arguments": {}, "error": ""}
        if not isinstance(raw, dict):
            call["error"] = f"Error: tool call {i} is not an object."
            calls.append(call)
            continue
        if isinstance(raw.get("id"), str) and raw["id"]:
            call["id"] = raw["id"]
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            call["error"] = f"Error: tool call {i} has no function name."
            calls.append(call)
            continue
        call["name"] = name
        arguments = function.get("arguments", {})
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError) as e:
                call["error"] = f"Error: {name}: arguments are not valid JSON ({e})."
                calls.append(call)
                continue
        if not isinstance(arguments, dict):
            call["error"] = f"Error: {name}: arguments must be a JSON object of named arguments."
        else:
            call["arguments"] = arguments
        calls.append(call)
    return content, calls, []


_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.*)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(text: str) -> str | None:
    """The final answer in `text`: after the last `Answer:` (rest of that line), else the last
    `\\boxed{...}`; surrounding whitespace, `**`, `$` and a trailing period stripped. None if
    neither marker is there."""
    found = None
    for line in text.splitlines():
        for match in _ANSWER_LINE.finditer(line):
            found = match.group(1)
    if found is None:
        boxed = _BOXED.findall(text)
        if not boxed:
            return None
        found = boxed[-1]
    found = found.strip(" \t*$")
    return found[:-1].strip(" \t*$") if found.endswith(".") else found


# ---- tool schemas from signatures and docstrings ----------------------------------------
def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool schema of a function: name, docstring summary, parameters from hints.

    Parameter descriptions come from the docstring's Google-style `Args:` section; parameters
    without a default are required. Supported hints: str, int, float, bool, list[...], dict,
    Literal[...], Optional/`X | None`.
    """
    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
        prop = _json_schema(hints.get(name, Any), f"{fn.__name__}({name})")
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    sections = re.split(
        r"^(Args|Arguments|Parameters|Returns|Raises|Example|Examples):\s*$", doc, flags=re.M
    )
    summary = " ".join(sections[0].split())
    arg_docs: dict[str, str] = {}
    for title, body in zip(sections[1::2], sections[2::2], strict=False):
        if title not in ("Args", "Arguments", "Parameters"):
            continue
        current = None
        for line in body.splitlines():
            match = re.match(r"^\s{0,8}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if match and (current is None or _indent(line) <= _indent_of_first(body)):
                current = match.group(1)
                arg_docs[current] = match.group(3).strip()
            elif current and line.strip():
                arg_docs[current] = f"{arg_docs[current]} {line.strip()}".strip()
    return summary, arg_docs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _indent_of_first(body: str) -> int:
    return next((_indent(line) for line in body.splitlines() if line.strip()), 0)


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_schema(tp: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return {}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp in (list, dict):
        return {"type": "array" if tp is list else "object"}
    if origin is list:
        return {"type": "array", "items": _json_schema(args[0], where) if args else {}}
    if origin is dict:
        return {"type": "object"}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [_json_schema(a, where) for a in args if a is not type(None)]
        if type(None) in args:
            options.append({"type": "null"})
        return options[0] if len(options) == 1 else {"anyOf": options}
    raise TypeError(f"tool parameter {where}: type {tp!r} has no JSON-schema mapping")


def check_arguments(fn: Callable[..., Any], arguments: dict[str, Any]) -> str:
    """What is wrong with calling `fn(**arguments)` (missing, unknown, mistyped); "" if fine."""
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    unknown = sorted(set(arguments) - set(params))
    if unknown:
        return f"unknown argument(s) {unknown}; the arguments are {sorted(params)}."
    missing = [n for n, p in params.items() if p.default is p.empty and n not in arguments]
    if missing:
        return f"missing required argument(s) {missing}."
    for name, value in arguments.items():
        tp = hints.get(name, Any)
        if not _matches(value, tp):
            return (
                f"argument {name!r} must be {_type_name(tp)}, got "
                f"{type(value).__name__} {json.dumps(value, default=str)[:80]}."
            )
    return ""


def _matches(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # JSON has one number type; an integer is a fine float
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if origin is Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    schema = _json_schema(tp, "")
    if "enum" in schema:
        return f"one of {schema['enum']}"
    if "anyOf" in schema:
        return " or ".join(s.get("type", "any") for s in schema["anyOf"])
    return f"a JSON {schema.get('type', 'value')}"
