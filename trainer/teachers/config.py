"""The recipe side of on-policy distillation: `algorithm.distill` and its teachers.

    algorithm:
      advantage: opd            # or grpo/drgrpo: the task advantage plus coef x the teacher's
      distill:
        teachers:
          calc: {recipe: [recipe=teacher_calc]}           # made by an RL run once, then cached
          words: {model: /models/words, engine: {kind: sglang, urls: [http://h:30000]},
                  memory_bytes: 20GB}
        route: {calc: calc, words: words}                 # env tag or env id -> teacher
        coef: 1.0
        memory_budget: 600MB

Each teacher is a model on an engine of the engine registry (`engine.kind`), so anything the
gateway can serve can teach. Sizes are bytes, written as an integer or with a unit (`600MB`,
`1.5GiB`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.engines import EngineConfig

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(name: str, text: str | int) -> int:
    """`600MB`, `1.5GiB`, `123456` -> bytes; ValueError naming `name` otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(
            f"{name}: {text!r} is not a size; write bytes as an integer or with a unit "
            "(600MB, 1.5GiB)"
        )
    return int(float(match.group(1)) * unit)


@dataclass
class TeacherConfig:
    model: str = ""
    """The teacher: an embedded model name (`smollm2`) or a Hugging Face folder; leave it empty
    and set `recipe` to have the run make it."""
    recipe: list[str] = field(default_factory=list)
    """With no `model`: the `trainer.run` arguments of the RL run that makes this teacher, e.g.
    [recipe=teacher_calc]. It runs once, before training starts; its final model is cached
    under $LOONGSAGE_HOME/teachers/ by a hash of the resolved config and reused after that."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine the teacher scores on: `local` (in the trainer's process, weights from disk
    on each swap-in) or `sglang` (its servers, released and resumed on swaps)."""
    memory_bytes: str = ""
    """What the teacher holds while resident; empty = its weights at `engine.dtype`, read from
    the model folder. Required for `sglang` teachers: the servers' weights plus KV cache."""

    def __post_init__(self) -> None:
        if bool(self.model) == bool(self.recipe):
            raise ValueError("set exactly one of model (a model) and recipe (a run that makes it)")
        if self.memory_bytes:
            parse_bytes("memory_bytes", self.memory_bytes)


@dataclass
class DistillConfig:
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    """Named teachers; none = no distillation."""
    route: dict[str, str] = field(default_factory=dict)
    """Env tag (a key of rollout.envs) or env id -> the teacher that scores its samples."""
    coef: float = 1.0
    """Weight of the reverse-KL advantage -(logp_student - logp_teacher) added to every sampled
    token's advantage (the task advantage; 0 with advantage=opd). 0: the teachers only measure
    (`distill/reverse_kl`), e.g. for an RL-alone baseline on the same run."""
    memory_budget: str = ""
    """Bytes the resident teachers may hold together (e.g. 600MB, 1.5GiB); the others wait on
    disk (local) or released (sglang) and are swapped in on demand, least recently used out
    first. Empty = no limit: every teacher stays resident once loaded."""
    max_batch_sequences: int = 64
    """Most sequences in one scoring call to a teacher."""
    linger_s: float = 2.0
    """How long requests for a teacher that is not resident wait for more requests before it is
    swapped in: fewer swaps, later scores."""

    def __post_init__(self) -> None:
        for name, teacher in self.route.items():
            if teacher not in self.teachers:
                known = ", ".join(sorted(self.teachers)) or "none"
                raise ValueError(f"route.{name}: {teacher!r} is not a teacher (teachers: {known})")
        if self.teachers and not self.route:
            raise ValueError("route: say which env tag or env id each teacher scores")
        if self.coef < 0:
            raise ValueError(f"coef must be >= 0, got {self.coef}")
        if self.max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {self.max_batch_sequences}")
        if self.linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {self.linger_s}")
        budget = self.budget_bytes
        for name, teacher in self.teachers.items():
            if teacher.memory_bytes and budget and parse_bytes("", teacher.memory_bytes) > budget:
                raise ValueError(
                    f"teachers.{name}.memory_bytes ({teacher.memory_bytes}) is more than the "
                    f"whole memory_budget ({self.memory_budget}): raise the budget"
                )

    @property
    def budget_bytes(self) -> int | None:
        """The memory budget in bytes; None = no limit."""
        return parse_bytes("memory_budget", self.memory_budget) if self.memory_budget else None
