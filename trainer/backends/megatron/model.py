"""A megatron-core `GPTModel` built from a Hugging Face config: Llama, Qwen2 and Qwen3 families.

`Arch.from_hf(config)` reads the few numbers both sides agree on and refuses what this backend
does not convert (other model types, biases where the family has none, RoPE scalings other than
Llama 3's), naming the field. `build_model` makes this rank's stage of the model: its share of
the layers under pipeline parallelism, its shards under tensor parallelism.

Decisions:
- The layer spec is Transformer Engine's where TE is importable on a CUDA machine (fused
  attention and norms) and Megatron's local one otherwise (CPU, or GPUs without TE). The
  converter (`convert.py`) knows both naming schemes.
- The vocabulary is padded only to a multiple of the tensor-parallel size (Megatron's shards
  must be equal); the padded rows are zero and their logits are masked out (`logprobs.py`), so
  log-probs are over the HF vocabulary exactly.
- The embedding keeps HF's `padding_idx` rule (no gradient to the pad token's row from its
  lookups), so both backends train the same model: in SmolLM2 the pad token is `<|im_end|>`.
- Dropout is off (the families trained here have none) and `calculate_per_token_loss` is off:
  the backend scales its micro-batch losses itself (see backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class Arch:
    """The shape of an HF causal LM, as far as the conversion needs it."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_llama3_factor: float | None = None
    """Llama 3.x RoPE scaling factor (Megatron's `rope_scaling`), None when unscaled."""
    padding_idx: int | None = None
    """HF's `nn.Embedding(..., padding_idx=pad_token_id)`: no gradient reaches that embedding
    row through lookups (the backend does the same; with tied weights the output layer still
    trains it)."""

    @classmethod
    def from_hf(cls, config: Any) -> Arch:
        family = config.model_type
        if family not in FAMILIES:
            raise ValueError(
                f"train.kind=megatron: model_type {family!r} is not converted; supported: "
                f"{', '.join(FAMILIES)} (use train.kind=torch for other models)"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"train.kind=megatron: hidden_act {config.hidden_act!r}; needs silu")
        if getattr(config, "mlp_bias", False):
            raise ValueError("train.kind=megatron: mlp_bias=True is not converted")
        qkv_bias = family == "qwen2" or bool(getattr(config, "attention_bias", False))
        if family == "llama" and qkv_bias:
            # Llama's attention_bias also puts a bias on o_proj, which Megatron ties to the MLP's.
            raise ValueError("train.kind=megatron: Llama with attention_bias=True is not converted")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope or {})
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
            expected["original_max_position_embeddings"] = 8192
            for key, value in expected.items():
                if float(rope.get(key, value)) != float(value):
                    raise ValueError(
                        f"train.kind=megatron: rope {key}={rope[key]} (Megatron's Llama 3 "
                        f"scaling has {value})"
                    )
            llama3 = float(rope["factor"])
        elif rope_type != "default":
            raise ValueError(f"train.kind=megatron: rope_type {rope_type!r} is not converted")
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_heads=heads,
            num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family == "qwen3",
            rope_llama3_factor=llama3,
            padding_idx=getattr(config, "pad_token_id", None),
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def check_parallel(self, tp: int, pp: int) -> None:
        """ValueError naming the train field when the model does not split that way."""
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_query_groups)):
            if n % tp:
                raise ValueError(
                    f"train.tensor_parallel={tp} does not divide the model's {n} {what}"
                )
        if self.ffn_hidden_size % tp:
            raise ValueError(
                f"train.tensor_parallel={tp} does not divide intermediate_size "
                f"{self.ffn_hidden_size}"
            )
        if self.num_layers % pp:
            raise ValueError(
                f"train.pipeline_parallel={pp} does not divide the model's {self.num_layers} layers"
            )


def use_transformer_engine() -> bool:
    """TE's layer spec on CUDA machines that have it; Megatron's local spec otherwise."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(arch: Arch, *, tp: int, pp: int, bf16: bool, cuda: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        variable_seq_lengths=True,  # micro-batches differ in shape (pipeline shape exchange)
        moe_token_dispatcher_type="alltoall",  # dense models; the default refuses the above
        use_cpu_initialization=not cuda,
        # Every weight is loaded from the HF folder, but initialization is also where Megatron
        # marks its tensor-parallel parameters (`tensor_model_parallel`), which the gradient
        # norm and the optimizer read: skipping it silently double-counts or drops shards.
        perform_initialization=True,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def build_model(arch: Arch, config: Any, *, te: bool, pre_process: bool, post_process: bool):
    """This rank's stage of the GPTModel (layers, TP shards), weights not yet loaded."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab(config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_llama3_factor is not None,
        rope_scaling_factor=arch.rope_llama3_factor or 8.0,
    )
