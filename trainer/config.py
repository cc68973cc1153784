"""The trainer's configuration: one dataclass per component, read from a recipe and overrides.

`python -m trainer.run recipe=quickstart rollout.max_staleness=2` builds a `TrainerConfig` with
`gateway.config.parse_cli`: defaults here, then `recipes/quickstart.yaml` (or any YAML path), then
`key.sub=value` overrides. A field's docstring is its only help text (`--help` prints them all);
unknown keys are an error that names the closest valid key. Cross-field checks live in
`__post_init__` and raise ValueError naming the field, which the loader reports as a ConfigError.

Units, decided once: `rollout.batch_size` counts *prompts* (GRPO groups) per train step, so a step
trains on `batch_size * num_samples_per_prompt` trajectories (fewer when samples abort). The
staleness gate counts groups in the same unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.config import parse_cli
from gateway.engines import EngineConfig
from sandbox import SandboxConfig
from trainer.agents import AGENTS
from trainer.backends import TRAIN_BACKENDS
from trainer.teachers import DistillConfig
from trainer.transfer import TransferConfig

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@dataclass
class ModelConfig:
    name: str = "smollm2"
    """Model to train: `smollm2` (embedded SmolLM2-135M-Instruct), `tiny` (random test model) or
    the path of a Hugging Face model folder."""


@dataclass
class EnvSpec:
    env: str = ""
    """Registered Gymnasium env id."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `gymnasium.make(env, ...)`."""
    weight: int = 1
    """Its share of the groups: groups take the envs in turn, in proportion to their weights."""

    def __post_init__(self) -> None:
        if not self.env:
            raise ValueError("env: the registered env id, e.g. loongsage/Calc-v0")
        _positive("weight", self.weight)


DEFAULT_ENV = "loongsage/Calc-v0"


@dataclass
class RolloutConfig:
    env: str = DEFAULT_ENV
    """Registered Gymnasium env id: its tasks are the prompts, its verifier gives the reward."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `gymnasium.make(env, ...)`, e.g. {difficulty: 0}."""
    envs: dict[str, EnvSpec] = field(default_factory=dict)
    """Several envs in one run, by tag, instead of `env`: e.g. {calc: {env: loongsage/Calc-v0},
    words: {env: loongsage/ReasoningGym-v0, env_kwargs: {dataset: spell_backward}}}. Groups
    take the envs in turn by `weight`, every sample carries its tag (metadata `env_tag`), and
    evaluation plays each env's eval split (eval/<tag>/success_rate, ...; eval/success_rate is
    their mean)."""
    num_samples_per_prompt: int = 8
    """Samples per prompt: one GRPO group; advantages are normalized within it."""
    batch_size: int = 4
    """Prompts (groups) per train step; a step sees batch_size * num_samples_per_prompt samples."""
    max_staleness: int = 0
    """How many weight versions a trajectory may lag the policy it trains; 0 = synchronous RL."""
    partial_rollout: Literal["continue", "abort_resubmit"] = "continue"
    """On a weight update, in-flight requests `continue` on the new weights (per-token versions)
    or are `abort_resubmit`-ted: retracted and re-run as prefix + partial output."""
    filter_zero_variance: bool = True
    """Drop groups whose samples all got the same reward (zero advantage, no signal)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scales its logits by the same value."""
    max_tokens: int = 256
    """Maximum tokens per model call: the session's cap, applied to every agent kind (a
    black-box agent asking for more, or for no limit, is cut here)."""
    max_turns: int = 4
    """Maximum model calls (turns) per episode."""

    def __post_init__(self) -> None:
        if self.num_samples_per_prompt < 2:
            raise ValueError(
                "num_samples_per_prompt must be >= 2 (group-normalized advantages need a group), "
                f"got {self.num_samples_per_prompt}"
            )
        _positive("batch_size", self.batch_size)
        _non_negative("max_staleness", self.max_staleness)
        _positive("temperature", self.temperature)
        _positive("max_tokens", self.max_tokens)
        _positive("max_turns", self.max_turns)
        if self.envs and (self.env != DEFAULT_ENV or self.env_kwargs):
            raise ValueError("set either env (with env_kwargs) or envs (a mix of envs), not both")

    def mix(self) -> dict[str, EnvSpec]:
        """Env tag -> env: `envs`, or the one `env` tagged by its id."""
        return self.envs or {self.env: EnvSpec(self.env, self.env_kwargs)}


@dataclass
class AgentConfig:
    kind: str = "tool_loop"
    """`tool_loop`: the built-in white-box agent steps the env; `command`: a black-box program
    runs in a sandbox and the env's verifier scores the `answer.txt` it leaves (trainer/agents)."""
    command: list[str] = field(default_factory=list)
    """kind=command: the program to run, e.g. [python3, agent.py]; `{task}` and `{instructions}`
    are replaced by the task text and the env's instructions (also in task.txt and
    instructions.txt)."""
    files: dict[str, str] = field(default_factory=dict)
    """kind=command: sandbox path -> host file copied in, e.g. {agent.py: examples/agents/openai_tool_agent.py}."""
    timeout_s: float = 300.0
    """kind=command: wall-time limit of one agent run."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """kind=command: the sandbox each rollout runs in (a fresh one per rollout)."""

    def __post_init__(self) -> None:
        AGENTS.check(self.kind)
        if self.kind == "command" and not self.command:
            raise ValueError(
                "command: kind=command needs the program to run, e.g. [python3, agent.py]"
            )
        for inside, host in self.files.items():
            if not Path(host).is_file():
                raise ValueError(f"files: {host!r} (for {inside!r}) is not a file")
        _positive("timeout_s", self.timeout_s)


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "drgrpo", "opd"] = "grpo"
    """`grpo`: (r - group mean) / group std; `drgrpo`: r - group mean (Dr. GRPO, no std); `opd`:
    none from rewards, only the teachers' per-token signal (`distill`; on-policy distillation)."""
    clip_eps_low: float = 0.2
    """PPO clip: the ratio current/proximal is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO clip: the ratio current/proximal is clipped above at 1 + clip_eps_high."""
    importance_sampling: Literal["none", "tis", "mis"] = "tis"
    """Correction for the engine/trainer mismatch, ratio = proximal/behaviour: `tis` truncates it
    at is_threshold, `mis` masks tokens whose ratio is outside [1/is_threshold, is_threshold]."""
    is_threshold: float = 2.0
    """C for TIS/MIS (> 1)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the initial (reference) model; 0 loads no reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    """`token_mean`: mean over all loss tokens of the batch; `seq_mean`: mean over sequences of
    each sequence's token mean."""
    overlong_buffer: int = 0
    """Soft overlong punishment (DAPO): a reply within this many tokens of its cap
    (`rollout.max_tokens`) loses up to `overlong_penalty` of advantage, linearly, all of it at
    the cap; under every `advantage` kind, the same for RL and distillation. 0: off."""
    overlong_penalty: float = 1.0
    """The advantage a reply at its cap loses (see overlong_buffer)."""
    num_minibatches: int = 1
    """Optimizer steps per train step (the batch is split); proximal log-probs are taken once at
    the start of the step, so PPO clipping bites from the second minibatch on."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: teachers score the student's sampled tokens, and coef x the
    negated reverse KL joins each token's advantage (trainer/teachers)."""

    def __post_init__(self) -> None:
        _non_negative("clip_eps_low", self.clip_eps_low)
        _non_negative("clip_eps_high", self.clip_eps_high)
        if self.clip_eps_low >= 1:
            raise ValueError(f"clip_eps_low must be < 1, got {self.clip_eps_low}")
        if self.is_threshold <= 1:
            raise ValueError(f"is_threshold must be > 1, got {self.is_threshold}")
        _non_negative("kl_coef", self.kl_coef)
        _non_negative("entropy_coef", self.entropy_coef)
        _positive("num_minibatches", self.num_minibatches)
        _non_negative("overlong_buffer", self.overlong_buffer)
        _non_negative("overlong_penalty", self.overlong_penalty)
        if self.advantage == "opd" and not (self.distill.teachers and self.distill.coef):
            raise ValueError(
                "advantage=opd learns from teachers alone: set algorithm.distill.teachers and a "
                "coef > 0"
            )


@dataclass
class TrainBackendConfig:
    kind: str = "torch"
    """Train backend: `torch` (CPU or one GPU) or `megatron` (megatron-core: tensor, pipeline and
    data parallel; GPUs, or fp32 on CPU for tests and small runs; needs the megatron extra)."""
    device: str = "auto"
    """`auto` (cuda when available, else cpu), `cpu`, `cuda` or `cuda:N`."""
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup, over run.steps train steps (linear and cosine decay to 0)."""
    warmup_steps: int = 0
    """Train steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward/backward (packed rows, padding included); bounds memory."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """`bf16` runs forward/backward under bf16 autocast with fp32 master weights and optimizer;
    `auto` picks bf16 only where it is native and measured faster (CUDA, AVX512-BF16/AMX CPUs),
    fp32 otherwise, and a local engine left at float32 follows it (decision in the run header)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora_rank: int = 0
    """LoRA: > 0 trains rank-r adapters on every decoder linear instead of the whole model
    (frozen; no weight gradients for it, AdamW state for ~1% of the parameters); the engines
    and the saved model get the merged weights (trainer/backends/lora.py). 0: full training.
    LoRA usually wants ~10x the learning rate of full training."""
    lora_alpha: float = 32.0
    """LoRA: the adapters' output is scaled by lora_alpha / lora_rank."""
    tensor_parallel: int = 1
    """kind=megatron: ranks each layer is split across (must divide the heads, KV heads and
    intermediate size); keep it within one node."""
    pipeline_parallel: int = 1
    """kind=megatron: stages the layers are split into (must divide the number of layers)."""
    data_parallel: int = 1
    """kind=megatron: model replicas, each training on its share of the batch. The backend runs
    tensor_parallel * pipeline_parallel * data_parallel ranks (Ray actors, one per GPU)."""

    @property
    def world_size(self) -> int:
        """Ranks the backend runs as."""
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def __post_init__(self) -> None:
        TRAIN_BACKENDS.check(self.kind)
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel"):
            _positive(name, getattr(self, name))
        if self.world_size > 1 and not TRAIN_BACKENDS.attrs(self.kind)["parallel"]:
            raise ValueError(
                f"train.kind={self.kind} runs one rank; tensor_parallel, pipeline_parallel and "
                "data_parallel > 1 need train.kind=megatron"
            )
        _positive("lr", self.lr)
        _non_negative("warmup_steps", self.warmup_steps)
        _non_negative("weight_decay", self.weight_decay)
        _non_negative("grad_clip", self.grad_clip)
        _positive("micro_batch_tokens", self.micro_batch_tokens)
        _non_negative("lora_rank", self.lora_rank)
        if self.lora_rank and not TRAIN_BACKENDS.attrs(self.kind).get("lora", False):
            raise ValueError(f"train.lora_rank needs train.kind=torch (not {self.kind}); or 0")


@dataclass
class EvalConfig:
    every: int = 5
    """Evaluate every N train steps (also at step 0 and at the end); 0 = only start and end."""
    n: int = 64
    """Held-out prompts per evaluation."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0 = greedy)."""
    max_tokens: int | None = None
    """Most tokens per model call in evaluation; None = `rollout.max_tokens`."""
    concurrency: int = 16
    """Evaluation episodes in flight at once."""

    def __post_init__(self) -> None:
        _non_negative("every", self.every)
        _non_negative("n", self.n)
        _non_negative("temperature", self.temperature)
        if self.max_tokens is not None:
            _positive("max_tokens", self.max_tokens)
        _positive("concurrency", self.concurrency)


@dataclass
class RunConfig:
    dir: str = ""
    """Run directory; empty = runs/<date>-<time>."""
    seed: int = 0
    """Seeds the prompt order, sampling seeds and the trainer's RNG."""
    steps: int = 20
    """Train steps (weight versions) to run."""
    checkpoint_every: int = 10
    """Save a resumable checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Keep only the newest N checkpoints (each holds the model and optimizer); 0 keeps all."""
    resume: str = ""
    """Resume from a checkpoint folder, or `auto` (the latest one in the run directory, if any)."""
    samples_per_step: int = 2
    """Readable trajectories written to samples.jsonl per step."""

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        _non_negative("checkpoint_every", self.checkpoint_every)
        _non_negative("samples_per_step", self.samples_per_step)
        _non_negative("keep_checkpoints", self.keep_checkpoints)


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    """Also write TensorBoard event files to <run dir>/tensorboard (needs `tensorboard`)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `wandb` and a login or WANDB_MODE=offline)."""
    wandb_project: str = "loongsage"
    """W&B project name."""
    progress: bool = True
    """Show a progress bar with reward and ETA."""


@dataclass
class RayConfig:
    enabled: bool = True
    """Run the train backend's ranks and the local engines as Ray actors (separate processes,
    placed by trainer/cluster.py; weights travel over TransferMesh's routes). False keeps
    everything in this process (one rank)."""
    address: str | None = None
    """Ray cluster to join, e.g. `10.0.0.1:6379` or `auto` (every node needs this package and
    the model at the same path); None starts a local Ray (dashboard off)."""
    num_cpus: int = 2
    """CPUs of a local Ray."""
    engine_cpus: float = 1.0
    """CPUs reserved for each engine actor (it runs that many torch threads)."""
    trainer_cpus: float = 1.0
    """CPUs reserved for each train-backend rank (it runs that many torch threads)."""
    engine_gpus: float = 0.0
    """GPUs reserved for each engine actor (the local engine on a GPU)."""
    trainer_gpus: float = 0.0
    """GPUs reserved for each train-backend rank (1 for train.kind=megatron on GPUs)."""
    engine_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each engine actor needs, e.g. {rollout_node: 1} to put it on a node
    started with `ray start --resources='{"rollout_node": 1}'`."""
    trainer_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each train-backend rank needs (pins the ranks to the nodes that
    offer them)."""
    lend_cpus: bool = True
    """On a local Ray (one machine) with local CPU engines and one torch-backend rank on CPU,
    the trainer computes with the engines' cores too while they have nothing to generate, and
    a single engine with the trainer's while it waits (`gateway.machine.CoreBoard`); a core
    goes back within a layer or a decode step of its owner having work."""
    trainer_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    """Placement of the ranks' bundles: PACK fills a node before the next (tensor-parallel peers
    share a node), STRICT_PACK all on one node, SPREAD across nodes."""

    def __post_init__(self) -> None:
        for name in ("engine_cpus", "trainer_cpus", "engine_gpus", "trainer_gpus"):
            _non_negative(name, getattr(self, name))
        for name in ("engine_resources", "trainer_resources"):
            for key, value in getattr(self, name).items():
                _non_negative(f"{name}.{key}", value)


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """What is rolled out, how much, and how stale it may be."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Which agent plays the env: the white-box tool loop or a black-box command."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The inference engine(s) behind the gateway."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and the policy loss."""
    train: TrainBackendConfig = field(default_factory=TrainBackendConfig)
    """The train backend and its optimizer."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation on the env's eval split."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory, length, seed, checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where metrics go besides metrics.jsonl."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where the engines and the train backend run."""
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """How each step's weights reach the engines (TransferMesh)."""

    def __post_init__(self) -> None:
        distill, mix = self.algorithm.distill, self.rollout.mix()
        envs = set(mix) | {spec.env for spec in mix.values()}
        for key in distill.route:
            if key not in envs:
                raise ValueError(
                    f"algorithm.distill.route.{key}: not an env tag or env id of this run "
                    f"(rollout: {', '.join(sorted(envs))})"
                )
        if self.algorithm.advantage == "opd":
            unrouted = [t for t, s in mix.items() if t not in distill.route and s.env not in
                        distill.route]  # fmt: skip
            if unrouted:
                raise ValueError(
                    f"algorithm.advantage=opd: env {unrouted[0]!r} has no teacher; add it to "
                    "algorithm.distill.route"
                )
            if self.rollout.filter_zero_variance:
                raise ValueError(
                    "algorithm.advantage=opd learns from every group (the signal is per token, "
                    "not the reward's spread): set rollout.filter_zero_variance=false"
                )


def load(argv: list[str]) -> TrainerConfig:
    """`[recipe=NAME|PATH] key.sub=value ...` -> TrainerConfig; NAME finds recipes/NAME.yaml."""
    return parse_cli(TrainerConfig, argv, RECIPE_DIR)
