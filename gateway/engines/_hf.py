"""The local engine's fallback forward: transformers' own model and `DynamicCache`.

Used for architectures the lean forward (`_llama.py`) does not cover. Rows are left-padded to a
common width; positions come from the attention mask, so padding never shifts a row's RoPE
positions. Newcomers are prefilled into a fresh cache which is then concatenated onto the
running one (left-padding the narrower); leaving rows go by `index_select`, and the left padding
every remaining row shares is trimmed. Simple and general, but it copies the whole cache
whenever rows join or leave, and transformers rebuilds masks every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache


class HFRunner:
    """Batch rows over an HF causal LM; the interface `LocalEngine` drives (see `_llama.Runner`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)

    def weights(self) -> dict[str, torch.Tensor]:
        # keep_vars: the live Parameters, tied aliases (lm_head/embeddings) included.
        return dict(self.model.state_dict(keep_vars=True))

    def weights_written(self) -> None:
        pass  # the model reads its Parameters directly

    def prefill(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        ids, mask = _left_pad(seqs)
        cache = DynamicCache()
        logits = self._forward(ids, mask, cache, keep=1)[:, -1]
        if self._cache is None:
            self._cache, self._mask = cache, mask
            return logits
        width = max(mask.shape[1], self._mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)])
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)])
        self._mask = torch.cat([_pad_left(self._mask, width, dim=1), _pad_left(mask, width, dim=1)])
        return logits

    def decode(self, tokens: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(tokens)[:, None]
        mask = torch.cat([self._mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        logits = self._forward(ids, mask, self._cache, keep=1)[:, -1]
        self._mask = mask
        return logits

    def keep(self, order: Sequence[int], clear: Sequence[int] = ()) -> None:
        """Row j becomes old row order[j]; the others leave (`clear`: nothing to do here, a
        leaving row's cache is dropped)."""
        if not order:
            self.reset()
            return
        index = torch.tensor(order, dtype=torch.long)
        self._mask = self._mask.index_select(0, index)
        lead = int(self._mask.any(0).long().argmax())  # columns that are padding in every row
        self._mask = self._mask[:, lead:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
            layer.values = layer.values.index_select(0, index)[:, :, lead:]

    def reset(self) -> None:
        self._cache = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)

    def score(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        ids, mask = _left_pad(seqs)
        keep = max(len(seq) - begin + 1 for seq, begin in zip(seqs, starts, strict=True))
        logp = torch.log_softmax(self._forward(ids, mask, None, keep=keep), dim=-1)
        out = []
        for row, (seq, begin) in enumerate(zip(seqs, starts, strict=True)):
            n = len(seq) - begin  # left padding: the predictions are the kept window's tail
            targets = torch.tensor(seq[begin:]).unsqueeze(-1)
            out.append(logp[row, keep - n - 1 : keep - 1].gather(-1, targets)[:, 0].tolist())
        return out

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache | None, keep: int
    ) -> torch.Tensor:
        """Logits (fp32) of the last `keep` positions. Positions count only unmasked tokens."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        )
        return out.logits.float()


def _left_pad(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _pad_left(t: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
