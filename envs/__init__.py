"""Gymnasium tool environments: the `ToolEnv` base, LoongSage's built-in envs, registration.

`import envs` registers the built-in envs under the `loongsage/` namespace with lazy string
entry points (nothing heavy is imported until `gymnasium.make`):

    loongsage/Calc-v0          arithmetic word problems, `calculator` tool, `difficulty=0..3`
    loongsage/Lookup-v0        multi-hop questions over a generated knowledge base (chained lookups)
    loongsage/Code-v0          write a Python function that passes hidden tests (run in a sandbox)
    loongsage/ReasoningGym-v0  any `reasoning-gym` task family as a ToolEnv (`dataset=...`)

The agent-loop contract (reset/step/info, the eval split, the tool-call format) and how to
register your own env are in `envs/base.py`'s docstring.
"""

from gymnasium.envs.registration import register, registry

from envs.base import AnyText, EnvError, Task, ToolEnv, extract_answer, tool_schema

__all__ = [
    "AnyText",
    "EnvError",
    "Task",
    "ToolEnv",
    "extract_answer",
    "find_spec",
    "tool_schema",
    "ENV_IDS",
]

_BUILTIN = {
    "loongsage/Calc-v0": ("envs.calc:CalcEnv", False),
    "loongsage/Lookup-v0": ("envs.lookup:LookupEnv", False),
    "loongsage/Code-v0": ("envs.code:CodeEnv", True),  # sandboxed runs can time out
    "loongsage/ReasoningGym-v0": ("envs.rgym:ReasoningGymEnv", False),
}
ENV_IDS = tuple(_BUILTIN)
"""The ids of LoongSage's built-in envs."""

for _id, (_entry_point, _nondeterministic) in _BUILTIN.items():
    if _id not in registry:  # importing twice (e.g. reload) must not warn about re-registration
        register(id=_id, entry_point=_entry_point, nondeterministic=_nondeterministic)


def find_spec(env_id: str):
    """`gymnasium.spec`, also for `module:`-prefixed ids (imports the module first, like `make`).

    Raises gymnasium's own error, with its closest-id suggestion, for an unknown id."""
    import importlib

    import gymnasium

    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise gymnasium.error.Error(f"env {env_id!r}: cannot import {module!r}: {e}") from None
    return gymnasium.spec(name)
