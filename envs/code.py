"""`loongsage/Code-v0`: write a Python function that passes hidden tests, run in a sandbox.

Each task is drawn from a family of small function specs with random parameters ("sum the
elements divisible by 7", "shift letters by 3", ...), with one worked example in the prompt and
hidden test cases computed by a reference implementation. The model may try code with the
`run_python` tool; its final message must hold the function in a ```python block (a bare
`def` without a fence is accepted too). The reward is 1.0 when every hidden test passes
(`partial_credit=True`: the fraction that pass), else 0.0.

All model code runs through `sandbox` (`SandboxConfig(kind=sandbox_kind)`: bubblewrap or a
process group locally, or Docker), one fresh sandbox per run, with wall-time and memory limits,
so the env is `nondeterministic` (a run near its time limit may pass once and time out once).
The test cases and a per-run nonce reach the harness through environment variables that it
removes before importing the solution, so the solution cannot read them from files; this hides
the tests from the model's view, not from a program that inspects its caller's frames.

SmolLM2-135M-Instruct before training, 48 eval tasks, 256 new tokens: 25% greedy (with or
without `run_python` offered; it never calls it), 10% at temperature 0.7.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import EnvError, Task, ToolEnv

_HARNESS = """\
import json, os, sys
nonce = os.environ.pop("LOONGSAGE_NONCE")
cases = json.loads(os.environ.pop("LOONGSAGE_CASES"))
name = os.environ.pop("LOONGSAGE_FUNCTION")
passed, first_failure = 0, ""
try:
    import solution
    fn = getattr(solution, name)
except BaseException as e:
    fn, first_failure = None, f"importing solution.py failed: {type(e).__name__}: {e}"
for args, expected in cases if fn else []:
    try:
        got = fn(*args)
    except BaseException as e:
        got = f"<raised {type(e).__name__}>"
    if got == expected and type(got) is type(expected):
        passed += 1
    elif not first_failure:
        first_failure = f"{name}(*{args!r}) returned {got!r}"
sys.stdout.flush()
print("\\n" + nonce + json.dumps({"passed": passed, "total": len(cases), "failure": first_failure}))
"""


@dataclass(frozen=True)
class _Family:
    signature: str  # with {name}
    description: str  # with {p0}, {p1}, ...
    params: Callable[[np.random.Generator], tuple]
    reference: Callable[..., Callable[..., Any]]  # params -> function
    inputs: Callable[[np.random.Generator], tuple]  # one argument tuple


def _ints(rng: np.random.Generator, lo=-20, hi=50, n=(0, 9)) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi, size=int(rng.integers(*n)))]


def _word(rng: np.random.Generator, n=(0, 12), alphabet="abcdexyz ") -> str:
    return "".join(rng.choice(list(alphabet), size=int(rng.integers(*n))))


_FAMILIES = {
    "sum_multiples": _Family(
        "def sum_multiples(xs: list[int]) -> int",
        "returns the sum of the elements of `xs` that are divisible by {p0} (0 for none)",
        lambda rng: (int(rng.integers(2, 10)),),
        lambda k: lambda xs: sum(x for x in xs if x % k == 0),
        lambda rng: (_ints(rng),),
    ),
    "count_char": _Family(
        "def count_char(s: str) -> int",
        "returns how many times the character {p0!r} occurs in `s`",
        lambda rng: (str(rng.choice(list("abcdexyz"))),),
        lambda c: lambda s: s.count(c),
        lambda rng: (_word(rng),),
    ),
    "clip_values": _Family(
        "def clip_values(xs: list[int]) -> list[int]",
        "returns a new list where each element of `xs` below {p0} becomes {p0} and each "
        "element above {p1} becomes {p1}",
        lambda rng: (int(rng.integers(-10, 10)), int(rng.integers(11, 40))),
        lambda lo, hi: lambda xs: [min(max(x, lo), hi) for x in xs],
        lambda rng: (_ints(rng),),
    ),
    "shift_letters": _Family(
        "def shift_letters(s: str) -> str",
        "returns `s` with every lowercase letter a-z moved {p0} places forward in the alphabet "
        "(wrapping from z to a) and every other character unchanged",
        lambda rng: (int(rng.integers(1, 26)),),
        lambda k: (
            lambda s: "".join(chr((ord(c) - 97 + k) % 26 + 97) if "a" <= c <= "z" else c for c in s)
        ),
        lambda rng: (_word(rng, alphabet="abcmnxyz A!"),),
    ),
    "count_above": _Family(
        "def count_above(xs: list[int]) -> int",
        "returns how many elements of `xs` are strictly greater than {p0}",
        lambda rng: (int(rng.integers(-5, 30)),),
        lambda t: lambda xs: sum(1 for x in xs if x > t),
        lambda rng: (_ints(rng),),
    ),
    "run_lengths": _Family(
        "def run_lengths(s: str) -> list[int]",
        "returns the lengths of the maximal runs of equal consecutive characters in `s`, in "
        "order (for example 'aabccc' gives [2, 1, 3]; '' gives [])",
        lambda rng: (),
        lambda: lambda s: [len(m.group(0)) for m in re.finditer(r"(.)\1*", s, re.S)],
        lambda rng: (_word(rng, alphabet="aab"),),
    ),
    "nth_term": _Family(
        "def nth_term(n: int) -> int",
        "returns term `n` (n >= 0) of the sequence t(0) = {p0}, t(1) = {p1}, "
        "t(n) = t(n-1) + t(n-2)",
        lambda rng: (int(rng.integers(0, 5)), int(rng.integers(1, 6))),
        lambda a, b: lambda n: _linear_recurrence(a, b, n),
        lambda rng: (int(rng.integers(0, 25)),),
    ),
    "every_kth": _Family(
        "def every_kth(xs: list[int]) -> list[int]",
        "returns every {p0}th element of `xs`, starting with the first (index 0)",
        lambda rng: (int(rng.integers(2, 5)),),
        lambda k: lambda xs: xs[::k],
        lambda rng: (_ints(rng),),
    ),
}


def _linear_recurrence(a: int, b: int, n: int) -> int:
    for _ in range(n):
        a, b = b, a + b
    return a


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S | re.I)


def extract_code(text: str, function: str) -> str | None:
    """The last fenced code block that defines `function`, else the whole text if it does."""
    blocks = [b for b in _FENCE.findall(text) if f"def {function}" in b]
    if blocks:
        return blocks[-1]
    return text if re.search(rf"^\s*def {function}\s*\(", text, re.M) else None


class CodeEnv(ToolEnv):
    """Write one Python function; hidden tests in a sandbox score it."""

    answer_format = (
        "Your final answer must contain the complete function in a ```python code block."
    )

    def __init__(
        self,
        *,
        families: list[str] | None = None,
        num_tests: int = 10,
        partial_credit: bool = False,
        sandbox_kind: str = "local",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_turns: int = 4,
        **kwargs: Any,
    ) -> None:
        families = list(families or _FAMILIES)
        unknown = [f for f in families if f not in _FAMILIES]
        if unknown:
            raise ValueError(f"families {unknown} unknown; choose from {sorted(_FAMILIES)}")
        if not isinstance(num_tests, int) or num_tests < 1:
            raise ValueError(f"num_tests={num_tests!r}: pass a positive int")
        self.families, self.num_tests, self.partial_credit = families, num_tests, partial_credit
        self.sandbox_kind, self.timeout_s, self.memory_mb = sandbox_kind, timeout_s, memory_mb
        super().__init__(max_turns=max_turns, **kwargs)

    def tools(self):
        return [self.run_python]

    def run_python(self, code: str) -> str:
        """Run a Python script in a fresh sandbox and return its exit status, stdout and stderr.

        Args:
            code: The complete script, e.g. your function followed by print() calls that try it.
        """
        res = self._run({"main.py": code}, ["python3", "main.py"], {})
        return f"status: {res.status} (exit code {res.exit_code})\nstdout:\n{res.stdout[-1500:]}\nstderr:\n{res.stderr[-1500:]}"

    def sample_task(self, rng: np.random.Generator) -> Task:
        family_name = self.families[rng.integers(len(self.families))]
        family = _FAMILIES[family_name]
        params = family.params(rng)
        reference = family.reference(*params)
        signature = family.signature
        function = signature.split("(")[0].removeprefix("def ")
        description = family.description.format(**{f"p{i}": p for i, p in enumerate(params)})
        example = family.inputs(rng)
        while not example or example == ([],) or example == ("",):  # an informative example
            example = family.inputs(rng)
        cases = [[list(args), reference(*args)] for args in (example,)]
        seen = {json.dumps(cases[0][0])}
        for _ in range(self.num_tests * 10):
            if len(cases) == self.num_tests:
                break
            args = family.inputs(rng)
            if json.dumps(args) not in seen:
                seen.add(json.dumps(args))
                cases.append([list(args), reference(*args)])
        call = f"{function}({', '.join(repr(a) for a in example)})"
        prompt = (
            f"Write a Python function `{signature}` that {description}.\n"
            f"Example: `{call}` returns `{cases[0][1]!r}`.\n"
            "Reply with the complete function in a ```python code block."
        )
        answer = f"a {function} that passes {len(cases)} hidden tests"  # no single reference
        return Task(prompt=prompt, answer=answer, data={"function": function, "cases": cases})

    def score(self, task: Task, final_answer: str) -> float:
        passed, total, _ = self.run_tests(task, final_answer)
        if self.partial_credit:
            return passed / total
        return float(passed == total)

    def run_tests(self, task: Task, final_answer: str) -> tuple[int, int, str]:
        """(passed, total, first failure or why nothing ran) of the hidden tests on an answer."""
        function, cases = task.data["function"], task.data["cases"]
        code = extract_code(final_answer, function)
        if code is None:
            return 0, len(cases), f"no ```python block defining {function}"
        nonce = secrets.token_hex(16)
        env = {
            "LOONGSAGE_NONCE": nonce,
            "LOONGSAGE_CASES": json.dumps(cases),
            "LOONGSAGE_FUNCTION": function,
        }
        files = {"solution.py": code, "test.py": _HARNESS}
        res = self._run(files, ["python3", "test.py"], env)
        for line in reversed(res.stdout.splitlines()):
            if line.startswith(nonce):
                report = json.loads(line[len(nonce) :])
                return report["passed"], report["total"], report["failure"]
        return 0, len(cases), f"tests did not finish: {res.status} {res.reason}".strip()

    def _run(self, files: dict[str, str], cmd: list[str], env: dict[str, str]):
        from sandbox import SandboxConfig, SandboxError, open_sandbox

        cfg = SandboxConfig(
            kind=self.sandbox_kind,  # type: ignore[arg-type]
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_limit_bytes=64 * 1024,
        )
        try:
            with open_sandbox(cfg) as sb:
                sb.put_files(files)
                return sb.run(cmd, timeout_s=self.timeout_s, env=env)
        except SandboxError as e:  # the env's own infrastructure, not the model, failed
            raise EnvError(f"Code env: sandbox {self.sandbox_kind!r} failed: {e}") from e
