"""The embedded torch inference engine (`kind: local`): continuous batching on CPU.

One engine thread loads and owns the model and runs the scheduling loop; nothing else ever
calls the model, so weight swaps, pauses and aborts cannot race a forward pass (and the engine's
process has one OpenMP team where nothing else in it computes, which on 2 cores is ~1.9x faster
at batch 1 than beside a second live team). Callers (any asyncio
loop, any thread) talk to it through a thread-safe inbox of commands; each generation
request gets its own `asyncio.Queue`, filled by the engine thread with
`loop.call_soon_threadsafe`: a chunk per token for `stream`, one at the end for `generate`
(every wake-up of the caller's loop takes a core from the engine's on a small machine). torch
releases the GIL inside its kernels, so the caller's event loop (the gateway) stays responsive
while the engine computes.

Each loop iteration: run pending commands (submit, abort, score, pause/resume, weight swap),
prefill newcomers (prompt + output so far) as new batch rows and sample their first token,
then one decode step for every running row; finished rows leave. Every running row keeps one
sampled-but-not-yet-fed token, so newcomers and old rows share the same decode step.

The model runs behind a small `Runner` interface, two implementations:
- `_llama.LeanRunner` for Llama-family configs (the embedded SmolLM2): a lean forward with
  fused q/k/v and gate/up weights (on CPU in fp32 also prepacked for oneDNN's GEMM, repacked
  after each swap) over a preallocated slot KV cache (no per-step padding,
  concatenation or `index_select`; a leaving row's place is taken by the last row, one copy);
  identical sequences in one prefill (n samples of a prompt) are computed once.
- `_hf.HFRunner` for any other causal LM (or `forward="transformers"`): transformers' own
  forward and a left-padded `DynamicCache`. `LocalEngine.forward` says which one runs.
transformers' continuous-batching manager (`generation/continuous_batching`) is not used: it
samples the whole batch with one global `do_sample` and one RNG (no per-request seed),
reports logprobs of the warped (top-p/top-k) distribution, has no stop strings, and no hook
to swap weights between steps.

Semantics worth knowing:
- Logprobs: `log_softmax(logits / T)[sampled token]` with T = 1 for greedy, NOT renormalized
  by top-p/top-k, because the trainer divides its logits by the same temperature; top logprobs
  (`SamplingParams.top_logprobs`) are the k largest entries of the same distribution.
- Sampling is one batched pass over all rows, no per-row tensor work: temperature, top-k (by
  the k-th largest value), top-p (its nucleus searched among the `NUCLEUS_CANDIDATES` most
  likely tokens, a full sort only for rows whose nucleus is wider), then the inverse CDF of
  each row at that request's own uniform draw.
- Seeds: every request owns a `random.Random` stream (seeded from `seed`, or from the OS) and
  draws exactly one uniform per sampled token, so a seeded request is reproducible whatever its
  batch neighbours are (its tokens depend only on its own logits and its own stream).
- Failure isolation: a row whose distribution is not finite ends its own request, alone, with
  a `ValueError` when its temperature made finite logits overflow (the gateway's 400) or an
  `EngineError` when the model's logits themselves are NaN/inf; the other rows go on unharmed
  (padding never mixes rows; the failed row's cache is zeroed). Temperatures below
  `base.MIN_TEMPERATURE` are greedy (`SamplingParams`), so only absurd logits (~1e33) overflow.
- Stop strings are searched in the decoded output; the token completing the match is kept.
- `update_weights` is applied by the engine thread between steps (all tensors or none, shapes
  checked before anything is queued), one `copy_` per tensor into the live weights (with the
  lean forward, views of its fused buffers); running requests are then re-prefilled with the
  new weights (prompt + output so far), so every token stamped `version` is exactly what a
  fresh engine with those weights would sample from the same prefix.
- `pause("abort")` ends running and queued requests; `"retract"` drops their cache and
  re-queues them (recomputed on resume, their streams continue); `"in_place"` keeps everything.
  Requests submitted while paused wait for `resume()`; `score` still runs while paused.
- `score` is prefill-only at T = 1 (teachers), with logits only at the scored positions (lean
  forward); sequences of concurrent calls share forwards.
- Cost of a swap: one prefill of every running request. Both caches hold full-attention
  layers only; sliding-window / hybrid models (transformers' forward) are untested.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.engines._hf import HFRunner
from gateway.engines._llama import LeanRunner, unsupported
from gateway.engines.base import (
    Chunk,
    EngineError,
    FinishReason,
    Generation,
    PauseMode,
    SamplingParams,
    collect,
)
from gateway.machine import CoreBoard
from gateway.models import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFILL_TOKEN_BUDGET = 8192
"""Padded prompt tokens prefilled in one forward; bounds activation memory when many join."""
SCORE_LOGITS_BUDGET = 128 * 2**20
"""Logit elements (batch x kept positions x vocab) per scoring forward."""
NUCLEUS_CANDIDATES = 256
"""top-p looks for its nucleus among this many most likely tokens first; rows whose nucleus is
larger are fully sorted."""


class Runner(Protocol):
    """Batch rows over a model and its KV cache: `_llama.LeanRunner` (Llama family) or
    `_hf.HFRunner` (anything else). Row order is the engine's `_rows` order."""

    model: nn.Module

    def weights(self) -> dict[str, torch.Tensor]:
        """HF state-dict name -> the live tensor that name is copied into on a weight swap."""
        ...

    def weights_written(self) -> None:
        """A swap wrote into `weights()`: rebuild whatever is derived from them."""
        ...

    def prefill(self, seqs: list[list[int]]) -> torch.Tensor:
        """Append one row per sequence; fp32 logits after each sequence's last token."""
        ...

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; fp32 logits after it."""
        ...

    def keep(self, order: list[int], clear: list[int] = ...) -> None:
        """Row j becomes old row order[j], the others leave; rows in `clear` held non-finite
        values."""
        ...

    def reset(self) -> None: ...

    def score(self, seqs: list[list[int]], starts: list[int]) -> list[list[float]]:
        """log p(seq[i] | seq[:i]) for i >= start, per sequence (T = 1)."""
        ...


@dataclass(eq=False)
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    rng: random.Random
    """One uniform draw per sampled token, from this request's own stream."""
    emit: Callable[[Chunk | BaseException], bool]
    stream: bool
    """Deliver every token as it comes (else everything at the end)."""
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
        max_batch_size: int = 64,
        max_context: int | None = None,
        forward: Literal["auto", "transformers"] = "auto",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if forward not in ("auto", "transformers"):
            raise ValueError(f"forward must be 'auto' or 'transformers', got {forward!r}")
        self.model_path = resolve_model(str(model_path))
        self.max_batch_size = max_batch_size
        self._version = 0
        self._ids = itertools.count()
        # Shared with callers: guarded by _lock. Everything else below is engine-thread only.
        self._lock = threading.Lock()
        self._active: dict[str, _Request] = {}
        self._closed = False
        self._inbox: queue.Queue[tuple[Callable, tuple, Callable | None]] = queue.Queue()
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request] = []
        self._paused = False
        self._stop = False
        self._score_jobs: list[tuple[list[list[int]], list[int], Callable]] = []
        self._num_threads = torch.get_num_threads()
        self._cores: CoreBoard | None = None
        self._borrow = False
        # The engine's thread loads the model too, and is the only thread of the engine that
        # runs torch: a second thread's OpenMP team in the process (this one's, had it loaded
        # the weights) makes every parallel region of the engine's thread wait on a sleeping
        # worker, which measured 1.9x slower decode steps at batch 1 on 2 cores.
        loaded: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._main,
            args=(dtype, max_context, forward, loaded),
            name="loongsage-engine",
            daemon=True,
        )
        self._thread.start()
        try:
            loaded.result()
        except BaseException:
            self._thread.join()
            raise

    def _load(self, dtype: str, max_context: int | None, forward: str) -> None:
        hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype]).eval()
        config = hf.config
        limit = getattr(config, "max_position_embeddings", None) or 2**31
        if max_context is None:
            max_context = limit
        if not isinstance(max_context, int) or not 2 <= max_context <= limit:
            raise ValueError(f"max_context must be an integer in [2, {limit}], got {max_context!r}")
        self._max_context = max_context
        self.vocab_size = hf.get_input_embeddings().num_embeddings
        self.eos_token_ids = frozenset(
            _ids(config.eos_token_id) | _ids(hf.generation_config.eos_token_id)
        )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except Exception:  # stop strings are then rejected with a ValueError
            self.tokenizer = None
        lean = forward == "auto" and unsupported(config) is None
        self._runner: Runner = LeanRunner(hf, self.max_batch_size) if lean else HFRunner(hf)
        self.forward = "lean" if lean else "transformers"
        """Which forward runs: the lean Llama one, or transformers' own (any other model)."""
        self.model = self._runner.model
        self._weights = self._runner.weights()

    # ---------------------------------------------------------------- Engine protocol (callers)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def weights(self) -> dict[str, torch.Tensor]:
        """HF state-dict name -> the live tensor this engine serves (a view into its fused
        buffers for the lean forward): what a weight swap writes, for inspection."""
        return dict(self._weights)

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
        return self._request(input_ids, params, request_id, stream=True)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        """The whole generation, delivered once at its end: no wake-up of the caller's event
        loop per token, which on 2 cores took ~9% of a batch-1 decode step from the engine."""
        return await collect(self._request(input_ids, params, request_id, stream=False))

    def _request(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None, stream: bool
    ) -> AsyncIterator[Chunk]:
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
        return self._run(prompt, params, request_id, stream)

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

    def share_cores(self, board: CoreBoard, borrow: bool = False) -> None:
        """Mark this engine busy or idle on `board` from now on, so that another process of the
        run computes with its cores while it has nothing to do (`gateway.machine.CoreBoard`);
        with `borrow`, each forward also runs with the cores of the others that are idle."""
        with self._lock:
            self._check_open()
            self._inbox.put((self._share_cores, (board, borrow), None))

    def _share_cores(self, board: CoreBoard, borrow: bool) -> None:
        self._cores, self._borrow = board, borrow

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
        self, prompt: list[int], params: SamplingParams, request_id: str, stream: bool
    ) -> AsyncIterator[Chunk]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        rng = random.Random(params.seed)  # seed None: from os.urandom
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        emit = lambda item: _deliver(loop, chunks.put_nowait, item)  # noqa: E731
        req = _Request(request_id, prompt, params, frozenset(stop_ids), rng, emit, stream)
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

    def _main(self, dtype: str, max_context: int | None, forward: str, loaded: Future) -> None:
        torch.set_num_threads(self._num_threads)  # OpenMP settings are per thread
        try:
            self._load(dtype, max_context, forward)
        except BaseException as exc:  # noqa: BLE001 - raised by __init__, in the caller's thread
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        self._loop()

    def _loop(self) -> None:
        # Commands change the cache in place too (an abort moves rows into holes), and the cache
        # is an inference tensor: everything on this thread runs in inference mode.
        with torch.inference_mode():
            while not self._stop:
                self._run_commands(block=not self._mark_busy())
                self._mark_busy()
                if self._score_jobs:
                    self._run_scores()
                if self._stop or self._paused:
                    continue
                try:
                    self._admit()
                    if self._rows:
                        self._decode()
                except Exception as exc:  # a broken batch fails its requests, never the loop
                    self._fail(self._rows, exc)
                    self._reset_batch()
        self._fail(self._rows + list(self._waiting), EngineError("the local engine was closed"))
        if self._cores is not None:
            self._cores.close()

    def _mark_busy(self) -> bool:
        """Whether there is work for the loop (on the CoreBoard too, if lending)."""
        busy = bool(self._score_jobs) or (not self._paused and bool(self._waiting or self._rows))
        if self._cores is not None:
            self._cores.mark(busy, self._num_threads)
            if busy and self._borrow:
                threads = self._num_threads + self._cores.idle_cores()
                if threads != torch.get_num_threads():
                    torch.set_num_threads(threads)  # the engine thread's team, from its next op
        return busy

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

    def _admit(self) -> None:
        """Prefill waiting requests (prompt + output so far) as new rows; sample a token each."""
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
            logits = self._runner.prefill([r.prompt + r.output for r in batch])
        except Exception as exc:  # only the newcomers are affected
            self._fail(batch, exc)
            return
        self._rows += batch
        self._step(batch, logits)

    def _decode(self) -> None:
        self._step(self._rows, self._runner.decode([r.output[-1] for r in self._rows]))

    def _step(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample, deliver, and let finished and failed rows leave."""
        failed = self._sample(reqs, logits)
        self._drop_rows({r for r in reqs if r.finish is not None}, failed)

    def _sample(self, reqs: list[_Request], logits: torch.Tensor) -> set[_Request]:
        """Sample one token per request, record it, check stops, deliver the chunk. A row whose
        distribution is not finite ends its own request with an error; returns those requests."""
        params = [r.params for r in reqs]
        temps = [p.temperature or 1.0 for p in params]
        scaled = logits
        if any(t != 1.0 for t in temps):
            scaled = logits / torch.tensor(temps, dtype=logits.dtype)[:, None]
        # logp = scaled - lse, formed only where needed (the drawn rows, chosen and top tokens).
        lse = torch.logsumexp(scaled, dim=-1)
        finite = torch.isfinite(lse).tolist()  # NaN or inf anywhere in a row reaches its lse
        tokens = scaled.argmax(-1)
        drawn = [i for i, p in enumerate(params) if not p.greedy and finite[i]]
        if drawn:
            tokens[drawn] = _draw(
                scaled[drawn] - lse[drawn, None],
                [params[i].top_k for i in drawn],
                [params[i].top_p for i in drawn],
                [reqs[i].rng.random() for i in drawn],  # one draw per sampled token
            )
        chosen = (scaled.gather(-1, tokens[:, None])[:, 0] - lse).tolist()
        tokens = tokens.tolist()
        top_ids = top_logps = []
        if k := min(max(p.top_logprobs for p in params), logits.shape[-1]):
            values, indices = scaled.topk(k)
            top_ids, top_logps = indices.tolist(), (values - lse[:, None]).tolist()
        failed = set()
        for i, req in enumerate(reqs):
            p = req.params
            if not finite[i]:
                failed.add(req)
                req.finish = "abort"
                self._send(req, self._non_finite(req, logits[i]))
                continue
            token = tokens[i]
            req.output.append(token)
            req.logprobs.append(chosen[i])
            if p.top_logprobs:
                n = p.top_logprobs
                req.top_logprobs.append(list(zip(top_ids[i][:n], top_logps[i][:n], strict=True)))
            req.versions.append(self._version)
            if token in req.stop_ids:
                req.finish = "stop"
            elif p.stop and any(s in self.tokenizer.decode(req.output) for s in p.stop):
                req.finish = "stop"
            elif len(req.output) >= p.max_tokens:
                req.finish = "length"
            if req.stream or req.finish is not None:
                self._send(req)
        return failed

    def _non_finite(self, req: _Request, logits: torch.Tensor) -> Exception:
        where = f"at output token {len(req.output)} of request {req.id!r}"
        if not bool(torch.isfinite(logits).all()):
            return EngineError(f"local engine: the model produced non-finite logits {where}")
        return ValueError(
            f"temperature: {req.params.temperature!r} makes the scaled logits overflow in float32 "
            f"{where}; use a larger temperature, or 0 for greedy"
        )

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

    def _drop_rows(self, gone: set[_Request], failed: set[_Request] = frozenset()) -> None:
        """Rows in `gone` leave; rows from the end move into their places (one copy each)."""
        if not gone:
            return
        n = len(self._rows) - len(gone)
        if n == 0:
            self._reset_batch()
            return
        holes = [i for i in range(n) if self._rows[i] in gone]
        movers = [i for i in range(n, len(self._rows)) if self._rows[i] not in gone]
        order = list(range(n))
        for hole, src in zip(holes, movers, strict=True):
            order[hole] = src
        self._runner.keep(order, [i for i, r in enumerate(self._rows) if r in failed])
        self._rows = [self._rows[i] for i in order]

    def _reset_batch(self) -> None:
        self._rows = []
        self._runner.reset()

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
            self._drop_rows({req})
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
        for name, tensor in state.items():
            live = self._weights[name]
            if live.dim() == 2 and live.stride(0) < live.stride(1):  # a transposed buffer
                live, tensor = live.t(), tensor.t()  # write in the buffer's order: ~3x faster
            live.copy_(tensor)
        self._runner.weights_written()
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
                width = max(len(seq) for seq, *_ in grown)
                if not group or (
                    len(grown) <= self.max_batch_size
                    and len(grown) * keep * self.vocab_size <= SCORE_LOGITS_BUDGET
                    and len(grown) * width <= PREFILL_TOKEN_BUDGET
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
        scores = self._runner.score([seq for seq, *_ in group], [b for _, b, _, _ in group])
        for (_, _, j, k), score in zip(group, scores, strict=True):
            results[j][k] = score


def _draw(
    logp: torch.Tensor, top_k: list[int], top_p: list[float], uniforms: list[float]
) -> torch.Tensor:
    """One token per row from the temperature-scaled distribution restricted by top-k then
    top-p, by inverse CDF at the row's uniform (no Python loop over rows)."""
    vocab = logp.shape[-1]
    probs = logp.exp()
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    if rows := (k < vocab).nonzero()[:, 0].tolist():
        kth = logp[rows].topk(int(k[rows].max())).values.gather(-1, k[rows, None] - 1)
        probs[rows] = probs[rows].masked_fill(logp[rows] < kth, 0.0)
    p = torch.tensor(top_p, dtype=probs.dtype)
    if rows := (p < 1).nonzero()[:, 0].tolist():
        probs[rows] = _nucleus(probs[rows], p[rows])
    cdf = probs.double().cumsum(-1)
    target = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside the smallest most-likely set holding `top_p` of the mass (a
    token stays if the mass strictly above it is below top_p)."""
    out = torch.zeros_like(probs)
    limit = top_p[:, None] * probs.sum(-1, keepdim=True)
    values, index = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]))  # sorted, descending
    above = values.cumsum(-1) - values
    wide = (above[:, -1] < limit[:, 0]).nonzero()[:, 0]  # nucleus not within the candidates
    if len(wide):
        full, full_index = probs[wide].sort(dim=-1, descending=True, stable=True)
        full_above = full.cumsum(-1) - full
        full = full.masked_fill(full_above >= limit[wide], 0.0)
        out[wide] = out[wide].scatter(-1, full_index, full)
    values = values.masked_fill(above >= limit, 0.0)
    narrow = torch.ones(len(probs), dtype=torch.bool)
    narrow[wide] = False
    out[narrow] = out[narrow].scatter(-1, index[narrow], values[narrow])
    return out


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
