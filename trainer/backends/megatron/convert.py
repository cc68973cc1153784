"""HF <-> Megatron weights for the Llama, Qwen2 and Qwen3 families, tensor-parallel shard by shard.

The model is a list of `Param`s: one Megatron parameter (named with its *global* layer index),
the HF tensors it is made of, and how tensor parallelism splits it. Three functions move
weights: `shard` (HF tensors -> this TP rank's Megatron shard), `unshard` (every TP rank's shard
-> the HF tensors) and `megatron_name` (the name a pipeline stage knows it by, with its local
layer index). Both directions only slice and concatenate, so HF -> Megatron -> HF is bit-exact.

How the layouts differ:
- attention: Megatron fuses q, k and v into `linear_qkv`, grouped by KV head: for each query
  group, its query heads, then its key head, then its value head. Tensor parallelism splits
  whole groups. Qwen2's q/k/v biases fuse the same way; Qwen3's q_norm/k_norm are
  `q_layernorm`/`k_layernorm`.
- MLP: `linear_fc1` is gate and up stacked; each TP rank holds its slice of gate on top of its
  slice of up (Megatron chunks the local output in two for SwiGLU).
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) are split along their input dimension.
- norms: `input_layernorm` and `pre_mlp_layernorm` (post_attention_layernorm in HF) are their own
  modules in Megatron's local spec and fused into the next linear (`layer_norm_weight`) in
  Transformer Engine's spec.
- vocabulary: the embedding (and an untied output layer) are padded with zero rows to a multiple
  of the TP size and split by rows; the padding is dropped on the way back.
- tied embeddings: Megatron keeps the embedding on the first pipeline stage and a copy as
  `output_layer.weight` on the last when they differ; HF names both `lm_head.weight` and
  `model.embed_tokens.weight` in a state dict (one tensor).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.backends.megatron.model import Arch

Split = Literal["replicated", "vocab", "row", "qkv", "fc1"]


@dataclass(frozen=True)
class Param:
    megatron: str
    """Megatron name, with the global layer index (`decoder.layers.{i}.` for layer i)."""
    hf: tuple[str, ...]
    """The HF tensors it is made of, in order."""
    split: Split
    layer: int | None = None
    """Global layer index; None for the embedding, final norm and output layer."""


def params(arch: Arch, te: bool) -> list[Param]:
    """Every Megatron parameter of the full model, embedding first, output layer last."""
    out = [Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    qkv_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    fc1_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        layer = [
            Param(m + qkv_norm, (h + "input_layernorm.weight",), "replicated", i),
            Param(
                m + "self_attention.linear_qkv.weight",
                tuple(attn + f"{p}_proj.weight" for p in "qkv"),
                "qkv",
                i,
            ),
        ]
        if arch.qkv_bias:
            names = tuple(attn + f"{p}_proj.bias" for p in "qkv")
            layer.append(Param(m + "self_attention.linear_qkv.bias", names, "qkv", i))
        if arch.qk_norm:
            for p in "qk":
                layer.append(
                    Param(
                        m + f"self_attention.{p}_layernorm.weight",
                        (attn + f"{p}_norm.weight",),
                        "replicated",
                        i,
                    )
                )
        layer += [
            Param(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row", i),
            Param(m + fc1_norm, (h + "post_attention_layernorm.weight",), "replicated", i),
            Param(
                m + "mlp.linear_fc1.weight",
                (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                "fc1",
                i,
            ),
            Param(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", i),
        ]
        out += layer
    out.append(Param("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    out.append(Param("output_layer.weight", (head,), "vocab"))
    return out


def hf_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the model has, from its config alone."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_heads * d, arch.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}."
        shapes |= {
            m + "input_layernorm.weight": (h,),
            m + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h),
            a + "k_proj.weight": (kv, h),
            a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q),
            m + "mlp.gate_proj.weight": (f, h),
            m + "mlp.up_proj.weight": (f, h),
            m + "mlp.down_proj.weight": (h, f),
        }
        if arch.qkv_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if arch.qk_norm:
            shapes |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
    return shapes


def stage_of(param: Param, arch: Arch, pp: int) -> int:
    """The pipeline stage that holds `param` (the embedding's on the first, the final norm and
    output layer on the last)."""
    if param.layer is not None:
        return param.layer // (arch.num_layers // pp)
    return 0 if param.megatron.startswith("embedding.") else pp - 1


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def megatron_name(param: Param, layer_offset: int) -> str:
    """The name in the state dict of the pipeline stage whose first layer is `layer_offset`."""
    if param.layer is None:
        return param.megatron
    return _LAYER.sub(f"decoder.layers.{param.layer - layer_offset}.", param.megatron, count=1)


def _qkv_groups(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] (HF, by head) -> [groups, (heads_per_group + 2) * head_dim, ...] (Megatron)."""
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )


def shard(arch: Arch, param: Param, hf: list[torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's Megatron shard of `param`, from its HF tensors (`param.hf` order)."""
    if param.split == "replicated":
        return hf[0]
    if param.split == "vocab":
        full = hf[0]
        pad = arch.padded_vocab(tp) - full.shape[0]
        if pad:
            full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
        return full.chunk(tp, dim=0)[tp_rank]
    if param.split == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    if param.split == "qkv":
        groups = _qkv_groups(arch, *hf).chunk(tp, dim=0)[tp_rank]
        return groups.reshape(-1, *groups.shape[2:])
    gate, up = hf
    return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])


def unshard(arch: Arch, param: Param, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The HF tensors of `param` (`param.hf` order) from every TP rank's shard, in rank order."""
    if param.split == "replicated":
        return [shards[0]]
    if param.split == "vocab":
        return [torch.cat(shards)[: arch.vocab_size]]
    if param.split == "row":
        return [torch.cat(shards, dim=1)]
    if param.split == "qkv":
        g, d = arch.num_query_groups, arch.head_dim
        full = torch.cat(shards)
        rest = full.shape[1:]
        groups = full.reshape(g, -1, *rest)
        q, k, v = groups.split([groups.shape[1] - 2 * d, d, d], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    halves = [s.chunk(2) for s in shards]
    return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
