"""The embedded torch inference engine (`kind: local`): continuous batching on CPU.

One engine thread owns the model and runs the scheduling loop; nothing else ever calls the
model, so weight swaps, pauses and aborts cannot race a forward pass. Callers (any asyncio
loop, any thread) talk to it through a thread-safe inbox of commands; each generation
request gets its own `asyncio.Queue`, filled by the engine thread with
`loop.call_soon_threadsafe`. torch releases the GIL inside its kernels, so the caller's event
loop (the gateway) stays responsive while the engine computes.

Each loop iteration: run pending commands (submit, abort, score, pause/resume, weight swap),
prefill newcomers as one left-padded batch into a fresh `DynamicCache`, sample their first
token, merge that cache into the running batch cache (left-padding the shorter one), then one
decode step for every running row; finished rows leave by `index_select` and the common left
padding is trimmed. Every running row keeps one sampled-but-not-yet-fed token, so newcomers
and old rows share the same decode step. Positions come from the attention mask, so padding
never shifts a row's RoPE positions.

Reused from transformers: the model forward (`attention_mask` + `position_ids` +
`logits_to_keep`) and its `DynamicCache`, whose per-layer key/value tensors we pad, concatenate
and select by batch index. transformers' own continuous-batching manager
(`generation/continuous_batching`) is not used: it samples the whole batch with one global
`do_sample` and one RNG (no per-request seed), reports logprobs of the warped (top-p/top-k)
distribution, has no stop strings, and no hook to swap weights between steps.

Semantics worth knowing:
- Logprobs: `log_softmax(logits / T)[sampled token]` with T = 1 for greedy, NOT renormalized
  by top-p/top-k, because the trainer divides its logits by the same temperature; top logprobs
  (`SamplingParams.top_logprobs`) are the k largest entries of the same distribution.
- Seeds: every request samples with its own `torch.Generator` (seeded from `seed`, or randomly),
  so a seeded request is reproducible whatever its batch neighbours are.
- Stop strings are searched in the decoded output; the token completing the match is kept.
- `update_weights` is applied by the engine thread between steps (all tensors or none, shapes
  checked before anything is queued); running requests are then re-prefilled with the new
  weights (prompt + output so far), so every token stamped `version` is exactly what a fresh
  engine with those weights would sample from the same prefix.
- `pause("abort")` ends running and queued requests; `"retract"` drops their cache and
  re-queues them (recomputed on resume, their streams continue); `"in_place"` keeps everything.
  Requests submitted while paused wait for `resume()`; `score` still runs while paused.
- `score` is prefill-only at T = 1 (teachers); sequences of concurrent calls share forwards.
- Cost of a swap: one prefill of every running request. The batch cache is a plain
  `DynamicCache` of full-attention layers; sliding-window / hybrid models are untested.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from gateway.engines.base import (
    Chunk,
    EngineError,
    FinishReason,
    Generation,
    PauseMode,
    SamplingParams,
    collect,
)
from gateway.models import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFILL_TOKEN_BUDGET = 8192
"""Padded prompt tokens prefilled in one forward; bounds activation memory when many join."""
SCORE_LOGITS_BUDGET = 128 * 2**20
"""Logit elements (batch x kept positions x vocab) per scoring forward."""


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    emit: Callable[[Chunk | BaseException], bool]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sent: int = 0
    """Output tokens already delivered to the caller."""
    finish: FinishReason | None = None
    done: bool = False
    """Its last chunk (or error) has been delivered."""


class LocalEngine:
    """Embedded continuous-batching engine for any HF causal-LM folder. See the module docstring."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_batch_size: int = 32,
        max_context: int | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.model_path = resolve_model(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype])
        self.model.eval()
        config = self.model.config
        limit = getattr(config, "max_position_embeddings", None) or 2**31
        if max_context is None:
            max_context = limit
        if not isinstance(max_context, int) or not 2 <= max_context <= limit:
            raise ValueError(f"max_context must be an integer in [2, {limit}], got {max_context!r}")
        self._max_context = max_context
        self.max_batch_size = max_batch_size
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.eos_token_ids = frozenset(
            _ids(config.eos_token_id) | _ids(self.model.generation_config.eos_token_id)
        )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except Exception:  # stop strings are then rejected with a ValueError
            self.tokenizer = None
        # keep_vars: the live Parameters, tied aliases (lm_head/embeddings) included.
        self._weights = dict(self.model.state_dict(keep_vars=True))
        self._version = 0
        self._ids = itertools.count()
        # Shared with callers: guarded by _lock. Everything else below is engine-thread only.
        self._lock = threading.Lock()
        self._active: dict[str, _Request] = {}
        self._closed = False
        self._inbox: queue.Queue[tuple[Callable, tuple, Callable | None]] = queue.Queue()
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros(0, 0, dtype=torch.long)
        self._paused = False
        self._stop = False
        self._score_jobs: list[tuple[list[list[int]], list[int], Callable]] = []
        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name="loongsage-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- Engine protocol (callers)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def load(self) -> int:
        with self._lock:
            return len(self._active)

    def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """Validates now (ValueError naming the field); the request is queued on first iteration."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                "params must be a SamplingParams (use SamplingParams.from_dict for a dict)"
            )
        prompt = self._check_ids("input_ids", input_ids)
        total = len(prompt) + params.max_tokens
        if total > self._max_context:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds the context limit of {self._max_context} tokens; lower "
                "max_tokens or shorten the prompt"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: {self.model_path} has no tokenizer to match stop strings")
        request_id = f"local-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        self._check_open()
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
        return self._run(prompt, params, request_id)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        return await collect(self.stream(input_ids, params, request_id, session_id))

    async def abort(self, request_id: str) -> None:
        await self._ask(self._abort, request_id)

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        """log p(token i | tokens < i) for i in [start, len), per sequence (T = 1)."""
        if not isinstance(sequences, list) or not isinstance(start, list):
            raise ValueError("sequences and start must be lists")
        if len(sequences) != len(start):
            raise ValueError(
                f"start: got {len(start)} start positions for {len(sequences)} sequences"
            )
        seqs = []
        for i, (seq, s) in enumerate(zip(sequences, start, strict=True)):
            seq = self._check_ids(f"sequences[{i}]", seq)
            if len(seq) > self._max_context:
                raise ValueError(
                    f"sequences[{i}]: {len(seq)} tokens exceed the context limit of "
                    f"{self._max_context}"
                )
            if not isinstance(s, int) or not 1 <= s <= len(seq):
                raise ValueError(
                    f"start[{i}] must be in [1, {len(seq)}] (token 0 has no context), got {s!r}"
                )
            seqs.append(seq)
        if not seqs:
            return []
        return await self._ask(self._queue_score, seqs, list(start), deferred=True)

    async def pause(self, mode: PauseMode = "in_place") -> None:
        """Returns once no forward pass runs; see the module docstring for the modes."""
        if mode not in get_args(PauseMode):
            raise ValueError(f"mode must be one of {', '.join(get_args(PauseMode))}, got {mode!r}")
        await self._ask(self._pause, mode)

    async def resume(self) -> None:
        await self._ask(self._resume)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap weights between steps. `state` may be a subset of the model's state dict; the
        caller must not modify its tensors until this returns."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an integer, got {version!r}")
        for name, tensor in state.items():
            if name not in self._weights:
                raise ValueError(f"state: unknown weight {name!r} (not in the model's state dict)")
            expected, got = tuple(self._weights[name].shape), getattr(tensor, "shape", type(tensor))
            if not isinstance(tensor, torch.Tensor) or tuple(got) != expected:
                raise ValueError(
                    f"state: weight {name!r} has shape {got}, the model expects {expected}"
                )
        await self._ask(self._swap_weights, dict(state), version)

    async def health(self) -> bool:
        return not self._closed and self._thread.is_alive()

    async def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inbox.put((self._shutdown, (), None))
        await asyncio.to_thread(self._thread.join)

    async def __aenter__(self) -> LocalEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ caller-side helpers

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise EngineError("the local engine is closed")

    def _check_ids(self, name: str, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"{name} must be a non-empty list of token ids")
        for pos, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"{name}: token id {t!r} at position {pos} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return list(ids)

    async def _ask(self, fn: Callable, *args: Any, deferred: bool = False) -> Any:
        """Run `fn(*args)` on the engine thread and await its result (a deferred `fn` gets a
        `reply(result, error)` callback as last argument and answers later)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def reply(result: Any = None, error: BaseException | None = None) -> None:
            _deliver(loop, _settle, fut, result, error)

        with self._lock:  # nothing enters the inbox after close() queued the shutdown
            self._check_open()
            self._inbox.put((fn, args, reply) if not deferred else (fn, (*args, reply), None))
        return await fut

    async def _run(
        self, prompt: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        emit = lambda item: _deliver(loop, chunks.put_nowait, item)  # noqa: E731
        req = _Request(request_id, prompt, params, frozenset(stop_ids), generator, emit)
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._check_open()
            self._active[request_id] = req
            self._inbox.put((self._waiting.append, (req,), None))
        finished = False
        try:
            while not finished:
                item = await chunks.get()
                finished = isinstance(item, BaseException) or item.finish_reason is not None
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not finished and not self._closed:  # the caller stopped listening
                self._inbox.put((self._abort, (request_id,), None))

    # ------------------------------------------------------------------------- engine thread

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)  # OpenMP settings are per thread
        while not self._stop:
            busy = not self._paused and bool(self._waiting or self._rows)
            self._run_commands(block=not busy)
            if self._score_jobs:
                self._run_scores()
            if self._stop or self._paused:
                continue
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._rows:
                        self._decode()
            except Exception as exc:  # a broken batch fails its requests, never the loop
                self._fail(self._rows, exc)
                self._reset_batch()
        self._fail(self._rows + list(self._waiting), EngineError("the local engine was closed"))

    def _run_commands(self, block: bool) -> None:
        """Run everything in the inbox (waiting for the first command if `block`)."""
        while True:
            try:
                fn, args, reply = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            try:
                result = fn(*args)
            except Exception as exc:  # the caller gets it; the loop goes on
                result, error = None, exc
            else:
                error = None
            if reply is not None:
                reply(result, error)

    def _shutdown(self) -> None:
        self._stop = True

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

    def _admit(self) -> None:
        """Prefill waiting requests (prompt + output so far) and merge them into the batch."""
        batch: list[_Request] = []
        longest = 0
        while self._waiting and len(self._rows) + len(batch) < self.max_batch_size:
            n = len(self._waiting[0].prompt) + len(self._waiting[0].output)
            if batch and (len(batch) + 1) * max(longest, n) > PREFILL_TOKEN_BUDGET:
                break
            batch.append(self._waiting.popleft())
            longest = max(longest, n)
        if not batch:
            return
        try:
            ids, mask = _left_pad([r.prompt + r.output for r in batch])
            cache = DynamicCache()
            logits = self._forward(ids, mask, cache, keep=1)[:, -1]
            self._sample(batch, logits)
        except Exception as exc:  # only the newcomers are affected
            self._fail(batch, exc)
            return
        keep = [i for i, r in enumerate(batch) if r.finish is None]
        if not keep:  # all done after one token
            return
        if len(keep) < len(batch):
            cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))
            mask = mask[keep]
        self._merge(cache, mask, [batch[i] for i in keep])

    def _decode(self) -> None:
        ids = torch.tensor([[r.output[-1]] for r in self._rows])
        mask = torch.cat([self._mask, torch.ones(len(self._rows), 1, dtype=torch.long)], dim=1)
        logits = self._forward(ids, mask, self._cache, keep=1)[:, -1]
        self._mask = mask
        self._sample(self._rows, logits)
        self._drop_rows([r for r in self._rows if r.finish is not None])

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request, record it, check stops, deliver the chunk."""
        temps = torch.tensor([r.params.temperature or 1.0 for r in reqs]).unsqueeze(1)
        logp = torch.log_softmax(logits / temps, dim=-1)
        greedy = logits.argmax(-1).tolist()
        k = max(r.params.top_logprobs for r in reqs)
        top = logp.topk(min(k, logp.shape[-1])) if k else None
        for i, req in enumerate(reqs):
            p = req.params
            token = greedy[i] if p.greedy else _draw(logp[i], p.top_k, p.top_p, req.generator)
            req.output.append(token)
            req.logprobs.append(float(logp[i, token]))
            if p.top_logprobs:
                ids = top.indices[i, : p.top_logprobs].tolist()
                req.top_logprobs.append(
                    list(zip(ids, top.values[i, : p.top_logprobs].tolist(), strict=True))
                )
            req.versions.append(self._version)
            if token in req.stop_ids:
                req.finish = "stop"
            elif p.stop and any(s in self.tokenizer.decode(req.output) for s in p.stop):
                req.finish = "stop"
            elif len(req.output) >= p.max_tokens:
                req.finish = "length"
            self._send(req)

    def _send(self, req: _Request, error: BaseException | None = None) -> None:
        """Deliver new tokens (or an error); a request leaves `load` before its last chunk."""
        if req.finish is not None or error is not None:
            req.done = True
            with self._lock:
                self._active.pop(req.id, None)
        if error is None:
            item: Chunk | BaseException = Chunk(
                req.output[req.sent :],
                req.logprobs[req.sent :],
                req.versions[req.sent :],
                top_logprobs=req.top_logprobs[req.sent :],
            )
            item.finish_reason = req.finish
            req.sent = len(req.output)
        else:
            item = error
        if not req.emit(item) and not req.done:  # the caller's event loop is gone
            req.finish, req.done = "abort", True
            with self._lock:
                self._active.pop(req.id, None)

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, reqs: list[_Request]) -> None:
        if self._cache is None or not self._rows:
            self._cache, self._mask, self._rows = cache, mask, reqs
            return
        width = max(mask.shape[1], self._mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)])
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)])
        self._mask = torch.cat([_pad_left(self._mask, width, dim=1), _pad_left(mask, width, dim=1)])
        self._rows = self._rows + reqs

    def _drop_rows(self, gone: list[_Request]) -> None:
        if not gone:
            return
        keep = [i for i, r in enumerate(self._rows) if r not in gone]
        if not keep:
            self._reset_batch()
            return
        self._rows = [self._rows[i] for i in keep]
        index = torch.tensor(keep, dtype=torch.long)
        self._mask = self._mask.index_select(0, index)
        lead = int(self._mask.any(0).long().argmax())  # columns that are padding in every row
        self._mask = self._mask[:, lead:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
            layer.values = layer.values.index_select(0, index)[:, :, lead:]

    def _reset_batch(self) -> None:
        self._rows, self._cache = [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long)

    def _fail(self, reqs: list[_Request], exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineError) else EngineError(f"local engine: {exc!r}")
        for req in reqs:
            if not req.done:
                req.finish = "abort"
                self._send(req, error)

    def _retract_all(self) -> None:
        """Move running requests back to the queue's front; they are re-prefilled later."""
        self._waiting.extendleft(reversed(self._rows))
        self._reset_batch()

    # Commands (engine thread).

    def _abort(self, request_id: str) -> None:
        for req in self._waiting:
            if req.id == request_id:
                self._waiting.remove(req)
                break
        else:
            req = next((r for r in self._rows if r.id == request_id), None)
            if req is None:
                return
            self._drop_rows([req])
        req.finish = "abort"
        self._send(req)

    def _pause(self, mode: PauseMode) -> None:
        self._paused = True
        if mode == "abort":
            for req in self._rows + list(self._waiting):
                req.finish = "abort"
                self._send(req)
            self._waiting.clear()
            self._reset_batch()
        elif mode == "retract":
            self._retract_all()

    def _resume(self) -> None:
        self._paused = False

    def _swap_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for name, tensor in state.items():
                self._weights[name].copy_(tensor)
        self._version = version
        self._retract_all()  # recompute running requests' cache with the new weights

    def _queue_score(self, seqs: list[list[int]], start: list[int], reply: Callable) -> None:
        self._score_jobs.append((seqs, start, reply))

    def _run_scores(self) -> None:
        """Score all queued jobs' sequences together, in groups that bound the logits memory."""
        jobs, self._score_jobs = self._score_jobs, []
        items = sorted(  # (sequence, start, job, index in job), shortest first: little padding
            (
                (seq, begin, j, k)
                for j, (seqs, starts, _) in enumerate(jobs)
                for k, (seq, begin) in enumerate(zip(seqs, starts, strict=True))
            ),
            key=lambda item: len(item[0]),
        )
        results: list[list[Any]] = [[None] * len(job[0]) for job in jobs]
        failed: dict[int, BaseException] = {}
        group: list[tuple] = []
        for item in [*items, None]:
            if item is not None:
                grown = [*group, item]
                keep = max(len(seq) - begin + 1 for seq, begin, _, _ in grown)
                if len(grown) <= self.max_batch_size and (
                    len(grown) * keep * self.vocab_size <= SCORE_LOGITS_BUDGET or not group
                ):
                    group = grown
                    continue
            try:
                self._score_group(group, results)
            except Exception as exc:  # fails the jobs in this group, never the engine
                failed.update({j: EngineError(f"local engine: {exc!r}") for _, _, j, _ in group})
            group = [item]
        for j, (_, _, reply) in enumerate(jobs):
            reply(results[j], failed.get(j))

    def _score_group(self, group: list[tuple], results: list[list[Any]]) -> None:
        ids, mask = _left_pad([seq for seq, _, _, _ in group])
        keep = max(len(seq) - begin + 1 for seq, begin, _, _ in group)
        with torch.inference_mode():
            logp = torch.log_softmax(self._forward(ids, mask, None, keep=keep), dim=-1)
        for row, (seq, begin, j, k) in enumerate(group):
            n = len(seq) - begin  # left padding: the predictions are the kept window's tail
            targets = torch.tensor(seq[begin:]).unsqueeze(-1)
            results[j][k] = logp[row, keep - n - 1 : keep - 1].gather(-1, targets)[:, 0].tolist()


def _draw(logp: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """Sample from the temperature-scaled distribution restricted by top-k then top-p."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k).values[-1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs[before >= top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _left_pad(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
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


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not fut.done():  # a cancelled caller no longer waits
        fut.set_exception(error) if error is not None else fut.set_result(result)


def _deliver(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the caller's loop is closed
        return False
