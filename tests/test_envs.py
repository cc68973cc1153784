"""Tool environments: check_env on every registered env, rewards, seeding, bad tool calls."""

from __future__ import annotations

import json
import warnings
from typing import Literal

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

import envs
from envs.base import AnyText, Task, ToolEnv, check_arguments, extract_answer, tool_schema
from envs.calc import calculator

LOONGSAGE_IDS = sorted(i for i in gym.registry if i.startswith("loongsage/"))


def call(name: str, arguments, call_id: str = "c0") -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def message(*calls: dict, content: str | None = None) -> str:
    return json.dumps({"role": "assistant", "content": content, "tool_calls": list(calls)})


# ---- registration and check_env ---------------------------------------------------------
def test_builtin_ids_registered_under_namespace():
    assert set(envs.ENV_IDS) <= set(LOONGSAGE_IDS)
    assert {"loongsage/Calc-v0", "loongsage/Lookup-v0", "loongsage/Code-v0"} <= set(envs.ENV_IDS)
    assert gym.spec("loongsage/Code-v0").nondeterministic is True
    assert gym.spec("loongsage/Calc-v0").nondeterministic is False
    assert all(isinstance(gym.spec(i).entry_point, str) for i in envs.ENV_IDS)  # lazy


@pytest.mark.parametrize("env_id", LOONGSAGE_IDS)
def test_check_env_passes_without_warnings(env_id):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning (make's passive checker, check_env) fails
        env = gym.make(env_id)
        check_env(env.unwrapped)
        env.reset(seed=0)
        env.step("Answer: 0")  # through make's wrappers (order enforcing, passive checker)
        env.close()
        env.close()  # safe twice


@pytest.mark.parametrize("env_id", LOONGSAGE_IDS)
def test_reset_contract(env_id):
    env = gym.make(env_id)
    obs, info = env.reset(seed=3)
    assert isinstance(obs, str) and obs
    assert {"system", "tools", "messages", "task_id", "split", "max_turns"} <= info.keys()
    assert "Answer" in info["system"] or "```python" in info["system"]
    assert info["messages"] == [
        {"role": "system", "content": info["system"]},
        {"role": "user", "content": obs},
    ]
    for schema in info["tools"]:
        assert schema["type"] == "function"
        assert schema["function"]["parameters"]["type"] == "object"
        assert "tool" in info["system"]  # the prompt mentions tool calls when there are tools
    assert info["task_id"].startswith("train/") and info["split"] == "train"


def test_user_env_registers_like_builtin_ones():
    class WordLengthEnv(ToolEnv):
        answer_format = "End with a line `Answer: <number>`."

        def tools(self):
            return [self.count_letters]

        def count_letters(self, word: str) -> int:
            """Count the letters of a word.

            Args:
                word: The word to measure.
            """
            return sum(c.isalpha() for c in word)

        def sample_task(self, rng):
            word = "".join(rng.choice(list("abcdefgh"), size=int(rng.integers(3, 12))))
            return Task(prompt=f"How many letters does {word!r} have?", answer=len(word))

        def score(self, task, final_answer):
            return float(extract_answer(final_answer) == str(task.answer))

    gym.register(id="testpkg/WordLength-v0", entry_point=WordLengthEnv, kwargs={"max_turns": 3})
    try:
        env = gym.make("testpkg/WordLength-v0")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env.unwrapped)
        env.reset(seed=0)
        obs, *_ = env.step(message(call("count_letters", {"word": "abc"})))
        assert obs == "3"
        task = env.unwrapped.task
        _, reward, terminated, _, _ = env.step(f"Answer: {task.answer}")
        assert reward == 1.0 and terminated
    finally:
        del gym.registry["testpkg/WordLength-v0"]


# ---- seeding and the eval split ---------------------------------------------------------
@pytest.mark.parametrize("env_id", LOONGSAGE_IDS)
def test_seeded_task_generation_is_deterministic(env_id):
    a, b = gym.make(env_id), gym.make(env_id)
    prompts_a = [a.reset(seed=s)[0] for s in range(8)]
    prompts_b = [b.reset(seed=s)[0] for s in range(8)]
    assert prompts_a == prompts_b
    assert len(set(prompts_a)) >= 6  # different seeds give different tasks
    # Unseeded resets continue the RNG: the sequence after one seed is reproducible too.
    a.reset(seed=11)
    b.reset(seed=11)
    assert [a.reset()[0] for _ in range(3)] == [b.reset()[0] for _ in range(3)]
    assert [t.prompt for t in a.unwrapped.eval_tasks()] == [
        t.prompt for t in b.unwrapped.eval_tasks()
    ]


def test_eval_split_is_fixed_and_held_out():
    env = gym.make("loongsage/Calc-v0", eval_size=50)
    tasks = env.unwrapped.eval_tasks()
    assert len(tasks) == 50 and len({t.prompt for t in tasks}) == 50
    obs, info = env.reset(options={"split": "eval", "index": 7})
    assert obs == tasks[7].prompt and info["task_id"] == "eval/7" and info["split"] == "eval"
    eval_prompts = {t.prompt for t in tasks}
    # Difficulty 0 has a small task space, so collisions would happen without the re-draw.
    train = [env.reset(seed=s)[0] for s in range(300)]
    assert not eval_prompts & set(train)


@pytest.mark.parametrize(
    "options",
    [{"split": "eval"}, {"split": "eval", "index": 100}, {"split": "test"}, {"index": 1}, {"x": 1}],
)
def test_bad_reset_options_are_value_errors(options):
    env = gym.make("loongsage/Calc-v0")
    with pytest.raises(ValueError):
        env.reset(options=options)


def test_constructor_arguments_are_checked():
    assert gym.make("loongsage/Calc-v0", difficulty="hard").unwrapped.difficulty == 2
    for kwargs in ({"difficulty": 9}, {"max_turns": 0}, {"eval_size": 0}):
        with pytest.raises(ValueError):
            gym.make("loongsage/Calc-v0", **kwargs)
    with pytest.raises(ValueError, match="hops"):
        gym.make("loongsage/Lookup-v0", hops=5)
    with pytest.raises(ValueError, match="families"):
        gym.make("loongsage/Code-v0", families=["nope"])


# ---- rewards ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, reward",
    [
        ("15 + 4 = 19.\nAnswer: 19", 1.0),
        ("answer :   19  ", 1.0),
        ("Answer: **19**.", 1.0),
        ("Answer: 19.0", 1.0),
        ("The total is \\boxed{19}.", 1.0),
        ("Answer: 1,9", 1.0),  # thousands commas are dropped: "19"
        ("Answer: 20", 0.0),
        ("Answer: 19 apples", 0.0),
        ("19", 0.0),  # no answer line
        ("Answer:", 0.0),
        ("Answer: nineteen", 0.0),
        ("Answer: 19\nAnswer: 18", 0.0),  # the last answer line counts
        ('{"content": null}', 0.0),
        ("", 0.0),
    ],
)
def test_calc_reward(text, reward):
    env = gym.make("loongsage/Calc-v0").unwrapped
    assert env.score(Task(prompt="p", answer=19), text) == reward


def test_calc_episode_reward_through_step():
    env = gym.make("loongsage/Calc-v0", difficulty=3)
    env.reset(seed=5)
    answer = env.unwrapped.task.answer
    obs, reward, terminated, truncated, info = env.step(f"Answer: {answer}")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert info["correct"] and info["reference"] == str(answer) and info["reason"] == "answered"
    env.reset(seed=5)
    assert env.step(f"Answer: {answer + 1}")[1] == 0.0


def test_lookup_needs_chained_calls_and_scores_names():
    env = gym.make("loongsage/Lookup-v0", hops=3)
    obs, info = env.reset(seed=2)
    assert {t["function"]["name"] for t in info["tools"]} == {"get_person", "get_office"}
    subject = obs.removeprefix("In which country does ").split("'s manager work?")[0]
    person = json.loads(env.step(message(call("get_person", {"name": subject})))[0])
    manager = json.loads(env.step(message(call("get_person", {"name": person["manager"]})))[0])
    office = json.loads(env.step(message(call("get_office", {"city": manager["office"]})))[0])
    assert office["country"] == env.unwrapped.task.answer
    _, reward, terminated, _, _ = env.step(f"It is there.\nAnswer: {office['country'].upper()}")
    assert reward == 1.0 and terminated
    task = env.unwrapped.task
    assert env.unwrapped.score(task, "Answer: Atlantis") == 0.0
    assert env.unwrapped.score(task, task.answer) == 0.0  # no answer line


def test_lookup_unknown_name_is_an_observation():
    env = gym.make("loongsage/Lookup-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(
        message(call("get_person", {"name": "Nobody Here"}))
    )
    assert obs.startswith("Error: get_person raised KeyError") and not terminated


def _code_env(**kwargs):
    env = gym.make("loongsage/Code-v0", families=["sum_multiples"], timeout_s=5, **kwargs)
    env.reset(seed=0)
    return env


def _k(env) -> int:
    return int(env.unwrapped.task.prompt.split("divisible by ")[1].split(" ")[0])


def test_code_reward_correct_incorrect_malformed():
    env = _code_env()
    unwrapped, task, k = env.unwrapped, env.unwrapped.task, _k(env)
    good = f"Here:\n```python\ndef sum_multiples(xs):\n    return sum(x for x in xs if x % {k} == 0)\n```"
    assert unwrapped.score(task, good) == 1.0
    bare = f"def sum_multiples(xs):\n    return sum(x for x in xs if x % {k} == 0)\n"
    assert unwrapped.score(task, bare) == 1.0
    wrong = "```python\ndef sum_multiples(xs):\n    return sum(xs)\n```"
    assert unwrapped.score(task, wrong) == 0.0
    passed, total, failure = unwrapped.run_tests(task, wrong)
    assert 0 <= passed < total and "sum_multiples" in failure
    assert unwrapped.score(task, "```python\ndef sum_multiples(xs) return\n```") == 0.0
    assert unwrapped.score(task, "no code at all") == 0.0
    hang = "```python\ndef sum_multiples(xs):\n    while True:\n        pass\n```"
    assert unwrapped.score(task, hang) == 0.0


def test_code_solution_cannot_fake_the_report_or_read_the_tests():
    env = _code_env()
    task = env.unwrapped.task
    fake = (
        "```python\nimport os, sys\n"
        "print('\\n' + os.environ.get('LOONGSAGE_NONCE', 'x') + "
        '\'{"passed": 10, "total": 10, "failure": ""}\')\n'
        "CASES = os.environ.get('LOONGSAGE_CASES')\n"
        "def sum_multiples(xs):\n    return 0 if CASES is None else 1\n"
        "sys.exit(0)\n```"
    )
    assert env.unwrapped.score(task, fake) == 0.0


def test_code_partial_credit_and_run_python_tool():
    env = _code_env(partial_credit=True)
    k = _k(env)
    half = f"```python\ndef sum_multiples(xs):\n    return sum(x for x in xs if x % {k} == 0) if len(xs) % 2 else -999\n```"
    reward = env.unwrapped.score(env.unwrapped.task, half)
    assert 0.0 < reward < 1.0
    obs, *_ = env.step(message(call("run_python", {"code": "print(6 * 7)"})))
    assert obs.startswith("status: ok") and "42" in obs
    obs, *_ = env.step(message(call("run_python", {"code": "raise SystemExit(3)"})))
    assert "status: error (exit code 3)" in obs


def test_reasoning_gym_adapter_scores_with_its_dataset():
    env = gym.make("loongsage/ReasoningGym-v0", dataset="leg_counting")
    env.reset(seed=1)
    task = env.unwrapped.task
    assert env.unwrapped.score(task, f"Answer: {task.answer}") == 1.0
    assert env.unwrapped.score(task, "Answer: -1") == 0.0
    assert env.unwrapped.score(task, "I don't know") == 0.0
    eval_tasks = env.unwrapped.eval_tasks()
    assert eval_tasks[0].prompt == env.unwrapped.dataset[0]["question"]
    with pytest.raises(ValueError, match="reasoning-gym dataset"):
        gym.make("loongsage/ReasoningGym-v0", dataset="no_such_dataset")


# ---- tool calls: good, bad, and max turns -----------------------------------------------
def test_tool_call_results_and_tool_messages():
    env = gym.make("loongsage/Calc-v0")
    env.reset(seed=0)
    action = message(
        call("calculator", {"expression": "(3 + 4) * 2^3"}, "a"),
        call("calculator", {"expression": "7 / 2"}, "b"),
        content="Let me compute.",
    )
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs == "56\n\n3.5"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["tool_messages"] == [
        {"role": "tool", "tool_call_id": "a", "name": "calculator", "content": "56"},
        {"role": "tool", "tool_call_id": "b", "name": "calculator", "content": "3.5"},
    ]
    assert info["errors"] == [] and info["turn"] == 1


BAD_CALLS = [
    (call("calc", {"expression": "1"}), "unknown tool 'calc'"),
    (call("calculator", "{not json"), "not valid JSON"),
    (call("calculator", "[1, 2]"), "JSON object"),
    (call("calculator", {"expression": 5}), "must be a JSON string"),
    (call("calculator", {}), "missing required argument"),
    (call("calculator", {"expression": "1", "x": 2}), "unknown argument"),
    (call("calculator", {"expression": "1/0"}), "division by zero"),
    (call("calculator", {"expression": "__import__('os')"}), "unsupported element"),
    ({"id": "c0", "type": "function", "function": {"arguments": "{}"}}, "no function name"),
    ({"id": "c0", "function": "calculator"}, "no function name"),
    ("calculator(1)", "not an object"),
]


@pytest.mark.parametrize("bad_call, expected", BAD_CALLS)
def test_bad_tool_call_is_an_observation(bad_call, expected):
    env = gym.make("loongsage/Calc-v0")
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(message(bad_call))
    assert obs.startswith("Error:") and expected in obs
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert len(info["tool_messages"]) == 1 and info["errors"] == [obs]
    # The episode goes on, and the model can still answer.
    answer = env.unwrapped.task.answer
    assert env.step(f"Answer: {answer}")[1:3] == (1.0, True)


def test_tool_calls_not_a_list_is_an_observation():
    env = gym.make("loongsage/Calc-v0")
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step(json.dumps({"content": "", "tool_calls": "x"}))
    assert obs.startswith("Error:") and not terminated
    assert info["tool_messages"][0]["role"] == "tool"


def test_message_forms_without_tool_calls_are_final_answers():
    for action in (
        '{"content": "Answer: 7", "tool_calls": []}',
        '{"role": "assistant", "content": "Answer: 7"}',
        "Answer: 7",
        '{"answer": 7}',
    ):
        env = gym.make("loongsage/Calc-v0")
        env.reset(seed=0)
        _, _, terminated, _, info = env.step(action)
        assert terminated and info["reason"] == "answered"


def test_max_turns_truncates_with_zero_reward():
    env = gym.make("loongsage/Calc-v0", max_turns=2)
    env.reset(seed=0)
    act = message(call("calculator", {"expression": "1+1"}))
    assert env.step(act)[3] is False
    obs, reward, terminated, truncated, info = env.step(act)
    assert (reward, terminated, truncated, info["reason"]) == (0.0, False, True, "max_turns")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Answer: 2")


def test_calc_without_calculator_has_no_tools():
    env = gym.make("loongsage/Calc-v0", calculator=False)
    _, info = env.reset(seed=0)
    assert info["tools"] == [] and "function-calling" not in info["system"]
    obs, _, terminated, _, _ = env.step(message(call("calculator", {"expression": "1+1"})))
    assert "unknown tool 'calculator'" in obs and not terminated


def test_caller_mistakes_are_errors():
    env = gym.make("loongsage/Calc-v0").unwrapped
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Answer: 1")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="str"):
        env.step(42)


@pytest.mark.parametrize("env_id", LOONGSAGE_IDS)
def test_random_actions_never_raise(env_id):
    env = gym.make(env_id, max_turns=3)
    rng = np.random.default_rng(0)
    env.action_space.seed(0)
    template = json.loads(message(call("calculator", {"expression": "1"})))
    junk = [None, 1, "x", [], {}, [1], {"name": 3}, "{", "\ud800"[:0], 1e308, True]
    for i in range(30):
        env.reset(seed=i)
        if i % 3 == 0:
            action = env.action_space.sample()
        else:  # structurally plausible messages with random holes
            msg = json.loads(json.dumps(template))
            fn = msg["tool_calls"][0]["function"]
            target = [msg, msg["tool_calls"][0], fn][int(rng.integers(3))]
            key = list(target)[int(rng.integers(len(target)))]
            target[key] = junk[int(rng.integers(len(junk)))]
            action = json.dumps(msg)[: int(rng.integers(1, 400))] if i % 5 == 0 else json.dumps(msg)
        for _ in range(3):
            obs, reward, terminated, truncated, info = env.step(action)
            assert env.observation_space.contains(obs) and 0.0 <= reward <= 1.0
            if terminated or truncated:
                break


def test_render_ansi_shows_the_transcript():
    env = gym.make("loongsage/Calc-v0", render_mode="ansi")
    obs, _ = env.reset(seed=0)
    env.step(message(call("calculator", {"expression": "2+2"})))
    text = env.render()
    assert obs in text and "[tool] 4" in text


# ---- schemas, argument checks, the calculator, answer extraction ------------------------
def _documented(
    query: str, limit: int = 5, tags: list[str] | None = None, mode: Literal["a", "b"] = "a"
) -> str:
    """Search the notes.

    Longer explanation that is not the summary.

    Args:
        query: What to look for,
            over two lines.
        limit (int): At most this many.
        tags: Only notes with these tags.

    Returns:
        The hits.
    """
    return query


def test_tool_schema_from_signature_and_docstring():
    assert tool_schema(_documented) == {
        "type": "function",
        "function": {
            "name": "_documented",
            "description": "Search the notes. Longer explanation that is not the summary.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for, over two lines."},
                    "limit": {"type": "integer", "description": "At most this many."},
                    "tags": {
                        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                        "description": "Only notes with these tags.",
                    },
                    "mode": {"enum": ["a", "b"]},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    }
    assert check_arguments(_documented, {"query": "x", "tags": None, "limit": 2}) == ""
    assert "limit" in check_arguments(_documented, {"query": "x", "limit": 2.5})
    assert "limit" in check_arguments(_documented, {"query": "x", "limit": True})
    assert "mode" in check_arguments(_documented, {"query": "x", "mode": "c"})
    assert "tags" in check_arguments(_documented, {"query": "x", "tags": [1]})


def test_tool_schema_rejects_what_a_model_cannot_call():
    def varargs(*xs: int) -> int:
        return 0

    def odd(x: complex) -> int:
        return 0

    with pytest.raises(TypeError):
        tool_schema(varargs)
    with pytest.raises(TypeError):
        tool_schema(odd)


@pytest.mark.parametrize(
    "expression, result",
    [("(12 + 30) * 4", "168"), ("7/2", "3.5"), ("2^10", "1024"), ("-3 + 5", "2"),
     ("1,000 * 3", "3000"), ("10 // 3", "3"), ("0.1 + 0.2", "0.3"), ("6 × 7", "42")],
)  # fmt: skip
def test_calculator(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "9**9**9", "x + 1", "1e308 * 1e308", "", "1" * 600],
)
def test_calculator_refuses(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_extract_answer():
    assert extract_answer("so\nAnswer: 12") == "12"
    assert extract_answer("ANSWER:12.") == "12"
    assert extract_answer("\\boxed{3} and \\boxed{4}") == "4"
    assert extract_answer("nothing") is None


def test_any_text_space():
    space = AnyText()
    assert space.contains("") and space.contains("emoji 😀 and \x00") and not space.contains(3)
    assert not space.contains("x" * (space.max_length + 1))
    space.seed(0)
    assert space.contains(space.sample())
    # the whole BMP's charset tables, built once and shared by every space (an env per rollout)
    full = spaces.Text(8, charset=envs.base._BMP)  # noqa: SLF001
    for name in ("_char_set", "_char_list", "_char_index", "_char_str"):
        assert getattr(space, name) == getattr(full, name)
        assert getattr(AnyText(8, min_length=2), name) is getattr(space, name)
    assert len(AnyText(8, min_length=2).sample()) in range(2, 9)
    with pytest.raises(ValueError, match="min_length"):
        AnyText(2, min_length=3)
