"""The local engine's lean forward for Llama-family models, over a slot KV cache.

transformers' generic forward costs more in Python than the model costs in arithmetic at
decode time (masks rebuilt per step, a `DynamicCache` padded, concatenated and index-selected
per step, three projections where one would do). This module runs the same maths with:

- fused weights: one `qkv` projection and one `gate_up` projection per layer (the HF tensors
  `q_proj/k_proj/v_proj` and `gate_proj/up_proj` are row-slices of them, so `weights()` hands
  out views and a weight swap is one `copy_` per tensor straight into the fused buffers). Every
  weight stays in HF's `[out, in]` layout, all of them in one buffer of huge pages
  (`machine.huge_page_zeros`; a one-row step 1.2-1.4x faster than over 4 KB pages, measured on
  a 2-core Zen 4 EPYC);
- on CPU in fp32, every matmul weight also has a copy prepacked by oneDNN
  (`machine.onednn_prepack`: the blocked layout its GEMM would otherwise pack the weight into on
  every call), rebuilt after each weight swap (`repack`, ~0.3 s for 135M parameters). On a
  2-core AVX2 EPYC a decode step of 32 rows takes 0.67x the time at 2 threads and 0.82x at one
  (64 rows: 0.81x, 0.92x). The price is a second copy of the layers' weights;
- the compiled CPU kernels (`machine.cpu_kernels`, fp32 or bf16; torch's ops where they did
  not build): a one-row step multiplies the plain weights by `gemv`, which streams each weight
  once across the threads and applies the RMSNorm or SwiGLU before the matmul itself (one call
  per matmul); steps of more rows run RMSNorm and SwiGLU as one `layer_input` call each (1.07x
  a 32-row step, against torch's several ops);
- RoPE tables precomputed once for every position;
- a slot KV cache: one tensor `[layers, 2 (k/v), rows, kv_heads, capacity, head_dim]`. Row i
  holds one sequence from position 0, never padded on the left: a decode step writes one
  position per row in place and attends over the prefix `[:max length]` of rows `[:batch]`
  (a view), masking each row beyond its own length; on CPU in fp32 or bf16 the compiled
  `decode_attention` does a layer's RoPE, cache write and attention in one call, each row over
  its own length. Rows stay packed at the front: when rows
  leave, rows from the end move into the holes (one copy of their cache each). Capacity grows by
  doubling (rows and positions), so an append never reallocates on the hot path;
- prefill packs the newcomers' tokens without padding for the matmuls and pads only inside
  attention; scoring uses the same path without touching the cache and computes logits only
  for the positions it scores.

Numerics follow transformers' `LlamaForCausalLM` (RMSNorm in fp32, rotate-half RoPE, SiLU MLP,
GQA); tests compare tokens and logprobs against it. `supported(config)` says which configs this
covers; the engine falls back to the HF forward for everything else.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gateway.machine import cpu_kernels, gemv, huge_page_zeros, onednn_linear, onednn_prepack


def unsupported(config) -> str | None:
    """Why the lean forward cannot run `config` (None: it can)."""
    rope = getattr(config, "rope_parameters", None) or {}
    checks = {
        "model_type is not llama": getattr(config, "model_type", None) != "llama",
        "hidden_act is not silu": getattr(config, "hidden_act", None) != "silu",
        "attention or MLP biases": bool(
            getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
        ),
        "RoPE scaling": rope.get("rope_type", "default") != "default",
        "pretraining_tp > 1": getattr(config, "pretraining_tp", 1) != 1,
    }
    reasons = [reason for reason, bad in checks.items() if bad]
    return ", ".join(reasons) or None


LAYER_WEIGHTS = {
    "ln1": ("input_layernorm",),
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "ln2": ("post_attention_layernorm",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
"""A layer's weights in the lean forward: each the HF modules' weights concatenated (rows)."""


def _one_block(groups: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each group's tensors concatenated along dim 0, all in one new buffer of huge pages
    (`machine.huge_page_zeros`: a one-row step streams every weight once)."""
    shapes = {key: (sum(len(t) for t in ts), *ts[0].shape[1:]) for key, ts in groups.items()}
    sizes = [math.prod(shape) for shape in shapes.values()]
    block = huge_page_zeros((sum(sizes),), next(iter(groups.values()))[0].dtype)
    out = {}
    for (key, shape), flat in zip(shapes.items(), block.split(sizes), strict=True):
        out[key] = torch.cat(groups[key], out=flat.view(shape))
    return out


class LeanLlama(nn.Module):
    """Llama forward over packed tokens and a slot KV cache. See the module docstring."""

    def __init__(self, hf_model: nn.Module, max_rows: int) -> None:
        super().__init__()
        config = hf_model.config
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        hf = dict(hf_model.state_dict(keep_vars=True))
        embed = hf["model.embed_tokens.weight"]
        dtype, tied = embed.dtype, hf.get("lm_head.weight", embed) is embed
        groups = {"embed": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
        if not tied:
            groups["lm_head"] = ["lm_head.weight"]
        for i in range(config.num_hidden_layers):
            for key, modules in LAYER_WEIGHTS.items():
                groups[f"{i}.{key}"] = [f"model.layers.{i}.{m}.weight" for m in modules]
        fused = _one_block({key: [hf[n].data for n in names] for key, names in groups.items()})
        self._views: dict[str, torch.Tensor] = {}
        for key, names in groups.items():  # the HF tensors are row-slices of the fused ones
            parts = fused[key].split([hf[n].shape[0] for n in names])
            self._views.update(zip(names, parts, strict=True))
        self.embed, self.norm = fused["embed"], fused["norm"]
        self.lm_head = fused.get("lm_head", self.embed)
        if tied:
            self._views["lm_head.weight"] = self.embed
        self.layers = [
            {key: fused[f"{i}.{key}"] for key in LAYER_WEIGHTS}
            for i in range(config.num_hidden_layers)
        ]
        missing = set(hf) - set(self._views)
        assert not missing, f"weights the lean forward does not use: {sorted(missing)}"
        self._views = {name: self._views[name] for name in hf}  # HF's names, HF's order
        positions = config.max_position_embeddings
        inv_freq = 1.0 / (
            config.rope_parameters["rope_theta"]
            ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim)
        )
        freqs = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : self.head_dim // 2] *= -1  # see _rope
        self.cos, self.sin = emb.cos().to(dtype), sin.to(dtype)
        self.packed: list[dict[str, torch.Tensor]] | None = None
        """Per layer, prepacked copies of the matmul weights (None: no oneDNN fp32 here)."""
        self.packed_head: torch.Tensor | None = None
        self.repack()
        self.kernels = cpu_kernels() if dtype in (torch.float32, torch.bfloat16) else None
        """The compiled CPU kernels (`machine.cpu_kernels`; built or loaded now, not in a step)."""
        self.cache = SlotCache(
            config.num_hidden_layers, self.num_kv_heads, self.head_dim, max_rows, positions, dtype
        )

    def weights(self) -> dict[str, torch.Tensor]:
        """HF state-dict name -> the tensor (or view of a fused buffer) this forward reads."""
        return dict(self._views)

    def repack(self) -> None:
        """(Re)build the prepacked weights from the plain ones (after they were written)."""
        if self.packed is None and not _prepacks(self.lm_head.dtype):
            return
        self.packed = [
            {
                name: onednn_prepack(layer[name], PACK_ROWS)
                for name in ("qkv", "o", "gate_up", "down")
            }
            for layer in self.layers
        ]
        self.packed_head = onednn_prepack(self.lm_head, PACK_ROWS)

    # --------------------------------------------------------------------------- forward

    def forward(self, step: Step) -> torch.Tensor:
        """fp32 logits for `step.logits_at` (packed token indices); writes the cache if asked.

        One dispatch per matmul (residuals folded in), cache views and write indices built once
        per step, not per layer: at batch 1 the step is ~30% dispatch."""
        x = self.embed[step.ids]
        cos, sin = self.cos[step.positions, None], self.sin[step.positions, None]
        fused = self._fused_decode(step)
        where = None
        if step.write_rows is not None and not fused:
            where = self.cache.index(step.write_rows, step.positions)
        window = self._decode_window(step) if step.decode and not fused else None
        packed = self.packed if len(step.ids) > 1 else None  # one row: see _linear
        for i, layer in enumerate(self.layers):
            w = packed[i] if packed else layer
            qkv = self._linear(x, w["qkv"], norm=layer["ln1"])
            x = self._linear(self._attention(i, qkv, cos, sin, step, where, window), w["o"], x)
            gate_up = self._linear(x, w["gate_up"], norm=layer["ln2"])
            x = self._linear(gate_up, w["down"], x, glu=True)
        x = x[step.logits_at] if step.logits_at is not None else x
        head = self.packed_head if len(x) > 1 and self.packed_head is not None else self.lm_head
        return self._linear(x, head, norm=self.norm).float()

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        glu: bool = False,
    ) -> torch.Tensor:
        """x @ W.T (+ residual, updated in place) for a plain or prepacked [out, in] weight,
        x first RMS-normed and scaled by `norm`, or (`glu`) x = gate | up -> silu(gate) * up.
        With the compiled kernels: one row in one `gemv` call, the norm or SwiGLU included;
        more rows through their `layer_input` (one call where torch's ops take several)."""
        if self.kernels is not None and len(x) == 1 and not weight.is_mkldnn:
            return self.kernels.gemv(x, weight, residual, norm, self.eps, glu)
        if self.kernels is not None and (norm is not None or glu):
            x = self.kernels.layer_input(x, norm, self.eps, glu)
        else:
            if glu:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate).mul_(up)
            if norm is not None:
                x = self._norm(x, norm)
        return _matmul(x, weight, residual)

    def _fused_decode(self, step: Step) -> bool:
        """Whether `decode_attention` does the step's RoPE, cache writes and attention."""
        return step.decode and self.kernels is not None

    def _decode_window(self, step: Step) -> tuple[Sequence[torch.Tensor], ...]:
        """A decode step's keys and values per layer (`SlotCache.window`) and its additive
        mask per (row, kv head), for torch's ops. Positions past a row's length hold finite
        stale values (zeros, or an earlier owner's; rows that went non-finite are zeroed)."""
        beyond = torch.arange(step.width)[None, :] > step.positions[:, None]
        bias = torch.zeros(beyond.shape, dtype=self.cache.dtype).masked_fill_(beyond, -torch.inf)
        bias = bias.repeat_interleave(self.num_kv_heads, dim=0)[:, None, :]
        return (*self.cache.window(len(step.ids), step.width), bias)

    def _attention(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: Step,
        where: tuple[torch.Tensor, ...] | None,
        window: tuple[Sequence[torch.Tensor], ...] | None,
    ) -> torch.Tensor:
        n, heads, kv_heads, dim = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self._fused_decode(step):  # RoPE, cache write, attention: one call
            keys, values = self.cache.layer(layer)
            return self.kernels.decode_attention(
                qkv, cos, sin, keys, values, step.positions, heads, self.scale
            )
        qkv = qkv.view(n, heads + 2 * kv_heads, dim)
        qk = _rope(qkv[:, : heads + kv_heads], cos, sin)  # q and k heads in one go
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        if where is not None:
            self.cache.write(layer, where, k, v)
        if window is not None:  # decode: one token per row, rows [0, n), over the cache
            keys, values, bias = window[0][layer], window[1][layer], window[2]
            # GQA without repeating K/V: each (row, kv head) is one small matmul over its query
            # group. Plain baddbmm/bmm: SDPA's flash kernel is slower for one query position.
            q = q.reshape(n * kv_heads, heads // kv_heads, dim)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self.scale)
            return torch.bmm(scores.softmax(-1), values).view(n, heads * dim)
        # Packed prefill: pad into [rows, width] only for attention.
        q = q[step.pad_index].transpose(1, 2)
        if step.extends is None:  # from position 0: causal over the step's own tokens
            k, v = (t[step.pad_index].transpose(1, 2) for t in (k, v))
            mask, causal = None, True
        else:  # after cached prefixes: over each row's cache, its new tokens written above
            k, v = self.cache.rows(layer, step.extends, step.width)
            mask, causal = step.mask, False
        out = F.scaled_dot_product_attention(
            q, k, v, mask, is_causal=causal, scale=self.scale, enable_gqa=kv_heads != heads
        )
        return out.transpose(1, 2).reshape(-1, heads * dim)[step.unpad_index]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        h = x.float()  # as transformers: normalise in fp32, scale in the weights' dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)


class LeanRunner:
    """Batch rows over `LeanLlama`'s slot cache: the interface `LocalEngine` drives."""

    def __init__(self, hf_model: nn.Module, max_rows: int) -> None:
        self.model = LeanLlama(hf_model, max_rows)
        self.prefixes = PrefixCache(PREFIX_CACHE_BYTES)
        self._lengths: list[int] = []
        """Tokens in the cache, per row."""

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.weights()

    def weights_written(self) -> None:
        self.model.repack()
        self.prefixes.clear()  # keys and values of the old weights

    def prefill(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append rows for `seqs`; fp32 logits after each sequence's last token.

        Identical sequences (n samples of one prompt) are computed once and the cache row
        copied. A sequence whose first tokens were prefilled before since the last weight swap
        (`prefixes`) starts from their cached keys and values; sequences that share a prefix
        with each other but with nothing cached go in two forwards: the first of them, then
        the others from its prefix."""
        first, lengths = len(self._lengths), [len(s) for s in seqs]
        cache = self.model.cache
        cache.reserve(first + len(seqs), max(lengths))
        firsts: dict[tuple[int, ...], int] = {}
        source = [firsts.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        now: dict[int, tuple[int, torch.Tensor | None]] = {}  # the cached prefix of each
        later: dict[int, None] = {}  # share a prefix with one of `now`: looked up after it
        for key, i in firsts.items():
            hit = self.prefixes.longest(key)
            if hit[0] or not any(_common(key, seqs[j]) >= PrefixCache.MIN_TOKENS for j in now):
                now[i] = hit
            else:
                later[i] = None
        rows: dict[int, torch.Tensor] = {}  # unique sequence -> its logits
        for hits in (now, later):
            unique, cached = list(hits), []
            if not unique:
                continue
            for i, hit in hits.items():
                n, kv = hit or self.prefixes.longest(seqs[i])
                n = min(n, lengths[i] - 1)  # the last token is computed: its logits are needed
                if n:
                    cache.kv[:, :, first + i, :, :n] = kv[:, :, :, :n]
                cached.append(n)
            ends = torch.tensor([lengths[i] for i in unique]) - torch.tensor(cached)
            step = Step.packed(
                [seqs[i] for i in unique],
                [first + i for i in unique],
                (ends.cumsum(0) - 1).tolist(),
                cached,
            )
            logits = self.model(step)
            finite = torch.isfinite(logits).all(-1).tolist()
            for j, i in enumerate(unique):
                rows[i] = logits[j]
                if finite[j]:
                    self.prefixes.add(seqs[i], cache.kv[:, :, first + i, :, : lengths[i]])
        for i, src in enumerate(source):
            if src != i:
                cache.copy(first + src, first + i, lengths[i])
        self._lengths += lengths
        return torch.stack([rows[src] for src in source])

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; fp32 logits after it."""
        positions = self._lengths
        self.model.cache.reserve(len(tokens), max(positions) + 1)
        step = Step.decoding(tokens, positions)
        logits = self.model(step)
        self._lengths = [n + 1 for n in positions]
        return logits

    def keep(self, order: Sequence[int], clear: Sequence[int] = ()) -> None:
        """Row j becomes old row order[j]; the others leave. Rows in `clear` are zeroed first
        (they held non-finite values that masking cannot hide from the row's next owner)."""
        for row in clear:
            self.model.cache.clear(row)
        self._lengths = [self._lengths[src] for src in order]
        self.model.cache.keep(order, self._lengths)

    def reset(self) -> None:
        self._lengths = []
        self.model.cache.reset()

    def score(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """log p(seq[i] | seq[:i]) for i >= start; logits only at those positions."""
        at, targets, offset = [], [], 0
        for seq, begin in zip(seqs, starts, strict=True):
            at += range(offset + begin - 1, offset + len(seq) - 1)
            targets += seq[begin:]
            offset += len(seq)
        if not at:
            return [[] for _ in seqs]
        logp = torch.log_softmax(self.model(Step.packed(seqs, None, at)), dim=-1)
        flat = logp.gather(-1, torch.tensor(targets)[:, None])[:, 0].tolist()
        out, offset = [], 0
        for seq, begin in zip(seqs, starts, strict=True):
            out.append(flat[offset : offset + len(seq) - begin])
            offset += len(seq) - begin
        return out


class Step:
    """One forward's inputs: packed sequences (prefill, score) or one token per row (decode)."""

    ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor | None = None
    logits_at: torch.Tensor | None = None
    decode: bool = False
    extends: torch.Tensor | None = None
    """Prefill after cached prefixes: the cache row of each packed sequence."""
    width: int = 0
    """Keys attended to (decode, and prefill after cached prefixes): the longest row."""
    mask: torch.Tensor
    pad_index: torch.Tensor
    unpad_index: torch.Tensor

    @classmethod
    def packed(
        cls,
        seqs: Sequence[Sequence[int]],
        rows: list[int] | None,
        logits_at: list[int],
        cached: Sequence[int] | None = None,
    ) -> Step:
        """Sequences packed end to end, written to these cache rows (None: not written).
        With `cached`, each row's cache already holds the first `cached[i]` tokens of
        sequence i: only the rest are packed, and they attend over the row's cache."""
        step = cls()
        cached = cached or [0] * len(seqs)
        lengths = [len(s) - c for s, c in zip(seqs, cached, strict=True)]
        width = max(lengths)
        step.ids = torch.tensor([t for s, c in zip(seqs, cached, strict=True) for t in s[c:]])
        step.positions = torch.cat(
            [torch.arange(c, len(s)) for s, c in zip(seqs, cached, strict=True)]
        )
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        if rows is not None:
            step.write_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))
        grid = torch.arange(width)
        valid = grid[None, :] < torch.tensor(lengths)[:, None]
        # A pad repeats its row's last token: padding never mixes rows, so a row that goes
        # non-finite cannot reach another through attention (masked NaN still poisons SDPA).
        last = starts + torch.tensor(lengths) - 1
        step.pad_index = torch.where(valid, starts[:, None] + grid, last[:, None])
        step.unpad_index = (torch.arange(len(seqs))[:, None] * width + grid)[valid]
        step.logits_at = torch.tensor(logits_at)
        if any(cached):
            assert rows is not None, "a cached prefix lives in a cache row"
            step.extends = torch.tensor(rows)
            step.width = max(len(s) for s in seqs)
            query_at = step.positions[step.pad_index]  # [rows, width]
            step.mask = (torch.arange(step.width) <= query_at[:, :, None])[:, None]
        return step

    @classmethod
    def decoding(cls, tokens: list[int], positions: list[int]) -> Step:
        """One token per cache row [0, len(tokens)), at `positions`."""
        step = cls()
        step.decode = True
        step.ids = torch.tensor(tokens)
        step.positions = torch.tensor(positions)
        step.write_rows = torch.arange(len(tokens))
        step.width = max(positions) + 1
        return step


class SlotCache:
    """KV cache rows `[layers, 2, rows, kv_heads, capacity, head_dim]`; see the module docstring."""

    MIN_POSITIONS = 128

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_positions: int,
        dtype: torch.dtype,
    ) -> None:
        self.shape = (layers, 2, 0, kv_heads, 0, head_dim)
        self.max_rows, self.max_positions = max_rows, max_positions
        self.dtype = dtype
        self._heads = torch.arange(kv_heads)[None, :]
        self.reset()

    def _use(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self._keys, self._values = kv[:, 0].unbind(0), kv[:, 1].unbind(0)  # per layer

    def reserve(self, rows: int, positions: int) -> None:
        """Room for `rows` rows of `positions` tokens (capacities double; contents kept)."""
        have_rows, have_pos = self.kv.shape[2], self.kv.shape[4]
        if rows <= have_rows and positions <= have_pos:
            return
        new_rows = min(max(rows, 2 * have_rows), self.max_rows) if rows > have_rows else have_rows
        new_pos = have_pos
        if positions > have_pos:
            new_pos = max(positions, 2 * have_pos, self.MIN_POSITIONS)
            new_pos = min(new_pos, self.max_positions)
        layers, _, _, kv_heads, _, dim = self.kv.shape
        kv = huge_page_zeros((layers, 2, new_rows, kv_heads, new_pos, dim), self.dtype)
        kv[:, :, :have_rows, :, :have_pos] = self.kv
        self._use(kv)

    def index(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`write`'s index for one token per (row, position) pair."""
        return rows[:, None], self._heads, positions[:, None]

    def write(
        self, layer: int, index: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v: [tokens, kv_heads, head_dim], at `index` (from `index`)."""
        self._keys[layer].index_put_(index, k)
        self._values[layer].index_put_(index, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values, `[rows, kv_heads, capacity, head_dim]` views."""
        return self._keys[layer], self._values[layer]

    def window(self, n: int, width: int) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Per layer, keys and values of rows [0, n), positions [0, width), as
        `[n * kv_heads, width, head_dim]` views (a row's heads are adjacent: no copy)."""
        kv = self.kv[:, :, :n, :, :width].flatten(2, 3)
        return kv[:, 0].unbind(0), kv[:, 1].unbind(0)

    def rows(self, layer: int, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
        """Keys and values of these rows, positions [0, width): `[rows, kv_heads, width,
        head_dim]` each (copies)."""
        return self._keys[layer][:, :, :width][rows], self._values[layer][:, :, :width][rows]

    def keep(self, order: list[int], lengths: list[int]) -> None:
        """Row j becomes old row order[j] (only moved rows are copied)."""
        for j, (src, n) in enumerate(zip(order, lengths, strict=True)):
            if src != j:
                self.copy(src, j, n)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Row dst's first n positions := row src's."""
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]

    def clear(self, row: int) -> None:
        """Zero one row, so that nothing non-finite a failed request left stays in the cache."""
        self.kv[:, :, row].zero_()

    def reset(self) -> None:
        self._use(huge_page_zeros(self.shape, self.dtype))


PREFIX_CACHE_BYTES = 256 * 2**20
"""`PrefixCache`'s budget: ~5,700 tokens of SmolLM2-135M's keys and values in fp32."""


class PrefixCache:
    """Keys and values of recently prefilled sequences, least recently used out past a byte
    budget, for newcomers that start with the same tokens: the chat template and system prompt
    every request of an environment shares, an agent's earlier turns. They hold for one set of
    weights: the runner clears them on every swap."""

    MIN_TOKENS = 16
    """A shorter shared prefix is recomputed rather than copied."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._bytes = 0

    def longest(self, seq: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """The length of the longest cached prefix of `seq` (0 if under `MIN_TOKENS`) and the
        `[layers, 2, kv_heads, >= length, head_dim]` keys and values it starts."""
        best, found = 0, None
        for key in self._entries:
            n = _common(key, seq)
            if n > best:
                best, found = n, key
        if found is None or best < self.MIN_TOKENS:
            return 0, None
        self._entries.move_to_end(found)
        return best, self._entries[found]

    def add(self, seq: Sequence[int], kv: torch.Tensor) -> None:
        """Keep `kv` (copied), the keys and values of all of `seq`."""
        key, size = tuple(seq), kv.numel() * kv.element_size()
        if len(key) < self.MIN_TOKENS or size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = kv.clone()
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # shorter one ends it
        if x != y:
            return i
    return min(len(a), len(b))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim] with
    sin's first half negated, so rotate_half(x) * sin == roll(x, half) * signed sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


PACK_ROWS = 64
"""The batch size oneDNN picks the prepacked layout for (decode batches are up to 64 rows; on
an AVX2 EPYC the layout picked for 64 served 1-1500 rows as well as any other)."""


def _prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here (fp32 only: bf16 is not measured)."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(3, 8), torch.randn(4, 8)
        return torch.allclose(
            onednn_linear(x, onednn_prepack(w, PACK_ROWS)), F.linear(x, w), atol=1e-5
        )
    except (RuntimeError, AttributeError):
        return False


def _matmul(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ residual, updated in place) for a plain or prepacked [out, in] weight."""
    if weight.is_mkldnn:
        return onednn_linear(x, weight, residual)
    if len(x) == 1:
        return gemv(x, weight, residual)
    return F.linear(x, weight) if residual is None else residual.addmm_(x, weight.t())
