"""`sglang` engine: an HTTP client of a real SGLang server, speaking token ids only.

SGLang's own request classes (`sglang.srt.managers.io_struct`) do not import without a GPU, so
the wire format is restated here field by field (answers checked by `_parse_event`), from
SGLang's source (`io_struct.py`, `sampling/sampling_params.py`, `entrypoints/http_server.py`,
`managers/tokenizer_manager.py`). Facts this client relies on:

- `POST /generate` takes `input_ids`, `sampling_params`, `return_logprob`, `logprob_start_len`,
  `stream` and `rid`. `sampling_params` is strict: an unknown key is rejected, so it is
  `max_new_tokens` (not `max_tokens`) and `sampling_seed` (not `seed`); `top_k=-1` disables top-k
  and `0` is invalid; `temperature=0` is greedy.
- The answer is `{text, output_ids, meta_info}`; `meta_info` has `id`, `finish_reason`
  (`{"type": "stop", "matched": ID-or-string}`, `{"type": "length", "length": N}` or
  `{"type": "abort", "message": ...}`), `prompt_tokens`, `completion_tokens`,
  `weight_version` (a string; `"default"` until the first versioned update), per-token
  `weight_versions` spans `[{version, start, end}]` over the output positions (a request that
  runs across a weight update has one span per version; `weight_version` is the last one) and, with
  `return_logprob`, `output_token_logprobs = [[logprob, token_id, text-or-null], ...]`; with
  `top_logprobs_num=k` (a top-level field, not a sampling one) also `output_top_logprobs`, one
  list of k such triples per output position.
  The EOS id is in `output_ids` but not in `text`; we never use `text`.
- Streaming is SSE (`data: {...}` events, then `data: [DONE]`). Events are cumulative (the whole
  output so far) unless the server runs with `--incremental-streaming-output` (deltas). Both are
  handled the same way: `completion_tokens` is the running total, so the new tokens of an event
  are the last `completion_tokens - seen` entries of `output_token_logprobs`. This also covers
  SGLang's abort event, which carries only the last output id. Cumulative events make a stream
  of n tokens cost O(n^2) bytes to send and parse: run SGLang with
  `--incremental-streaming-output` for long generations.
- Bad input is HTTP 400 with `{"error": {"message": ...}}` (or, on a stream, an `error` event).

`update_weights` of the Engine protocol goes over disk (safetensors in a folder the server can
read, then `/update_weights_from_disk` with `weight_version`), the one route that works over
plain HTTP. The other weight routes (`/update_weights_from_tensor`, `/init_weights_update_group`,
`/update_weights_from_distributed`, memory release/resume) are methods here for TransferMesh
(trainer/transfer), which also reads `placement`. SGLang refuses tensor and distributed updates
outside `/begin_weight_update` ... `/end_weight_update` (an open session is also required
between them, and a second `begin` is refused); every update request takes `weight_version`,
which the server records as soon as that request succeeds, so a bucketed update sends it with
its last bucket only. Read from SGLang's source (main, 2026: `managers/io_struct.py`,
`managers/scheduler_components/weight_updater.py`, `utils/weight_versions.py`), the version
the issue tracker calls 0.5.23.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

import httpx
import orjson
import torch

from gateway.engines.base import (
    Chunk,
    EngineError,
    FinishReason,
    Generation,
    PauseMode,
    SamplingParams,
)
from gateway.engines.placement import SGLANG_TRANSPORTS, Placement

# ---------------------------------------------------------------------------------------------
# Wire format: what SGLang answers, checked field by field


def _parse_event(data: bytes) -> dict[str, Any]:
    """One `/generate` answer or stream event, with the type of every field this client reads
    checked (by hand: a pydantic model cost 3-4x the JSON parse itself on the gateway's
    per-request path). Unknown fields are ignored, as SGLang adds them over time."""
    try:
        event = orjson.loads(data)
        _check_answer(event)
    except (orjson.JSONDecodeError, TypeError, KeyError) as exc:
        raise EngineError(f"SGLang sent an answer we cannot read ({exc}): {data[:200]!r}") from None
    return event


def _is(value: Any, kind: type | tuple[type, ...], name: str, optional: bool = True) -> Any:
    """`value` if it is a `kind` (a bool is not an int here), or None where `optional`."""
    if (value is None and optional) or (
        isinstance(value, kind) and (kind is bool or type(value) is not bool)
    ):
        return value
    raise TypeError(f"{name} is {value!r:.60}")


def _check_answer(event: Any) -> None:
    _is(event, dict, "the answer", optional=False)
    if _is(event.get("error"), dict, "error") is not None:
        _is(event["error"].get("message"), str, "error.message")
    meta = _is(event.get("meta_info"), dict, "meta_info")
    if meta is None:
        return
    finish = _is(meta.get("finish_reason"), dict, "finish_reason")
    if finish is not None:
        _is(finish["type"], str, "finish_reason.type", optional=False)
        _is(finish.get("status_code"), int, "finish_reason.status_code")
        _is(finish.get("message"), str, "finish_reason.message")
    _is(meta.get("completion_tokens"), int, "completion_tokens")
    _is(meta.get("weight_version"), (str, int), "weight_version")
    for span in _is(meta.get("weight_versions"), list, "weight_versions") or ():
        _is(span, dict, "a weight_versions span", optional=False)
        _is(span["version"], (str, int), "weight_versions[].version", optional=False)
        _is(span["start"], int, "weight_versions[].start", optional=False)
        _is(span["end"], int, "weight_versions[].end", optional=False)
    _check_entries(meta.get("output_token_logprobs"), "output_token_logprobs")
    _check_entries(meta.get("input_token_logprobs"), "input_token_logprobs")
    for row in _is(meta.get("output_top_logprobs"), list, "output_top_logprobs") or ():
        _check_entries(row, "output_top_logprobs[]")


def _check_entries(rows: Any, name: str) -> None:
    """`[[logprob-or-null, token_id, text-or-null], ...]`."""
    for entry in _is(rows, list, name) or ():
        if (
            type(entry) is not list
            or len(entry) != 3
            or type(entry[1]) is not int
            or not (entry[0] is None or type(entry[0]) in (float, int))
        ):
            raise TypeError(f"{name} has the entry {entry!r:.60}")


_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def parse_version(value: str | int | None) -> int:
    """SGLang's `weight_version` string -> our int; `"default"` (never updated) is version 0."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineError(
            f"SGLang reports weight_version {value!r}, which is not an integer; start the server "
            "with --weight-version 0 or update its weights through LoongSage"
        ) from None


# ---------------------------------------------------------------------------------------------


class SGLangEngine:
    """One SGLang server behind the Engine protocol. `await connect()` reads its context length
    and weight version; generation connects by itself if that was not done, and reading
    `max_context` before any connection fetches it once, synchronously."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600,
        health_timeout_s: float = 30,
        max_connections: int = 1024,
        max_context: int | None = None,
        weights_dir: str | None = None,
    ) -> None:
        """`weights_dir`: a folder the *server* can read, for `update_weights` over disk
        (default: the system temp folder, right when client and server share a host)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.health_timeout_s = health_timeout_s
        self.weights_dir = weights_dir
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )
        self._pool = _Pool(self.url, timeout_s, max_connections)
        self._max_context = max_context
        self._weight_version = 0
        self._connected = False
        self._inflight: set[str] = set()

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r})"

    # -- protocol properties -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def max_context(self) -> int:
        if self._max_context is None:
            # A sync property cannot await: one blocking round trip, once, if nobody connected.
            try:
                response = httpx.get(self.url + "/v1/models", timeout=10)
                response.raise_for_status()
                self._max_context = _max_model_len(response.json())
            except (httpx.HTTPError, ValueError) as exc:
                raise EngineError(f"{self!r}: cannot read max_model_len: {exc!r}") from exc
        return self._max_context

    @property
    def load(self) -> int:
        return len(self._inflight)

    async def connect(self) -> SGLangEngine:
        """Read the server's context length (`/v1/models`) and weight version
        (`/get_model_info`); raises EngineError if the server is not up."""
        info = await self.get_model_info()
        self._weight_version = parse_version(info.get("weight_version"))
        if self._max_context is None:
            try:
                self._max_context = _max_model_len(await self._request("GET", "/v1/models"))
            except ValueError as exc:
                raise EngineError(f"{self!r}: {exc}") from exc
        self._connected = True
        return self

    async def _ensure_connected(self) -> None:
        if not self._connected:
            await self.connect()

    # -- generation ----------------------------------------------------------------------------

    async def stream(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[Chunk]:
        await self._ensure_connected()
        body = self._generate_body(input_ids, params, request_id, stream=True)
        rid = body["rid"]
        self._inflight.add(rid)
        seen = 0
        try:
            async with self._pool.post("/generate", orjson.dumps(body)) as response:
                if response.status != 200:
                    self._raise_for(response.status, await response.read(), "/generate")
                last: Chunk | None = None
                async for line in response.lines():
                    if last is not None or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    chunk = self._chunk(_parse_event(data), seen, started=seen > 0)
                    if chunk is None:
                        continue
                    seen += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        # Held back until the body is read to its end (`[DONE]` follows at
                        # once): callers stop at the last chunk, and a fully read connection
                        # goes back to the pool instead of being closed.
                        last = chunk
                        continue
                    yield chunk
            if last is None:
                raise EngineError(f"{self!r}: stream for {rid} ended without a finish_reason")
            self._inflight.discard(rid)
            yield last
        except (OSError, EOFError, TimeoutError) as exc:
            raise EngineError(f"{self!r}: /generate failed: {exc!r}") from exc
        finally:
            self._inflight.discard(rid)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        session_id: str | None = None,
    ) -> Generation:
        await self._ensure_connected()
        body = self._generate_body(input_ids, params, request_id, stream=False)
        self._inflight.add(body["rid"])
        try:
            raw = await self._generate_raw(body)
        finally:
            self._inflight.discard(body["rid"])
        chunk = self._chunk(_parse_event(raw), 0, started=False)
        if chunk is None or chunk.finish_reason is None:
            raise EngineError(f"{self!r}: /generate answered without a finish_reason")
        out = Generation()
        out.add(chunk)
        return out

    async def abort(self, request_id: str) -> None:
        await self._request("POST", "/abort_request", {"rid": request_id})

    async def score(self, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
        if len(sequences) != len(start):
            raise ValueError(
                f"score: got {len(sequences)} sequences but {len(start)} start positions"
            )
        return list(await asyncio.gather(*map(self._score_one, sequences, start)))

    async def _score_one(self, ids: list[int], start: int) -> list[float]:
        if not 1 <= start <= len(ids):
            raise ValueError(
                f"score: start must be in [1, len(sequence)={len(ids)}] (token 0 has no "
                f"context to be scored on), got {start}"
            )
        if start == len(ids):
            return []
        # Prefill only: max_new_tokens=0. `input_token_logprobs` then holds one entry per
        # position from `logprob_start_len` on ([logprob, token_id, text], logprob null at
        # position 0); we ask one position early and align from the end, so the answer does
        # not hinge on how the first entry is counted, and check every token id.
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "rid": uuid.uuid4().hex,
        }
        meta = _parse_event(await self._generate_raw(body)).get("meta_info") or {}
        entries = meta.get("input_token_logprobs") or []
        want = len(ids) - start
        tail = entries[-want:] if len(entries) >= want else None
        if tail is None or [e[1] for e in tail] != ids[start:] or any(e[0] is None for e in tail):
            raise EngineError(
                f"{self!r}: input_token_logprobs does not line up with the scored sequence "
                f"({len(entries)} entries for {want} positions)"
            )
        return [float(e[0]) for e in tail]

    # -- control -------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "in_place") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def health(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=self.health_timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def flush_cache(self) -> None:
        """Drop the radix (prefix) cache; SGLang refuses (400) while requests run."""
        await self._request("POST", "/flush_cache")

    async def get_model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        """The server's arguments and state (`tp_size`, ...)."""
        return await self._request("GET", "/get_server_info")

    @property
    def placement(self) -> Placement:
        """Where the server is, for TransferMesh: its host, a GPU, SGLang's weight API."""
        host = httpx.URL(self.url).host
        if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
            local = Placement.here()
            return Placement(local.host, local.node, 0, "cuda", SGLANG_TRANSPORTS, "sglang")
        return Placement(host, f"host:{host}", 0, "cuda", SGLANG_TRANSPORTS, "sglang")

    async def close(self) -> None:
        self._pool.close()
        await self._client.aclose()

    # -- weights -------------------------------------------------------------------------------

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Write `state` (HF parameter names) as safetensors under `weights_dir`, then have the
        server load it with `/update_weights_from_disk`. Needs a folder both can see."""
        from safetensors.torch import save_file

        root = self.weights_dir or tempfile.gettempdir()
        folder = tempfile.mkdtemp(prefix=f"loongsage-v{version}-", dir=root)
        try:
            tensors: dict[str, torch.Tensor] = {}
            seen_storage: set[int] = set()
            for name, tensor in state.items():
                t = tensor.detach().to("cpu").contiguous()
                # safetensors refuses tensors that share memory (tied embeddings): copy those.
                ptr = t.untyped_storage().data_ptr()
                tensors[name] = t.clone() if ptr in seen_storage else t
                seen_storage.add(ptr)
            path = os.path.join(folder, "model.safetensors")
            await asyncio.to_thread(save_file, tensors, path)
            await self.update_weights_from_disk(folder, version)
        finally:
            await asyncio.to_thread(_rmtree, folder)

    async def update_weights_from_disk(
        self,
        model_path: str,
        version: int,
        *,
        load_format: str | None = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> None:
        await self._weight_update(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "load_format": load_format,
                "abort_all_requests": abort_all_requests,
                "flush_cache": flush_cache,
                "weight_version": str(version),
            },
            version,
        )

    async def begin_weight_update(self, selector: str = "all") -> None:
        """Open a weight-update session (tensor and distributed updates need one); `selector`:
        target, draft or all (the draft model of speculative decoding)."""
        await self._weight_update("/begin_weight_update", {"selector": selector}, None)

    async def end_weight_update(self) -> None:
        """Close the session: the server finalizes the loaded weights (e.g. re-quantizes)."""
        await self._weight_update("/end_weight_update", {}, None)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        version: int | None,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """`serialized_named_tensors`: base64 of SGLang's `MultiprocessingSerializer` output,
        one per TP rank (CUDA IPC handles: same node only). `version` (the server's new weight
        version) only with the last bucket of a version; None before."""
        await self._weight_update(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
                "weight_version": _version_field(version),
            },
            version,
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Join an NCCL group whose rank 0 is the trainer (for `update_weights_from_distributed`)."""
        await self._weight_update(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            None,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None,
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Receive one bucket of tensors broadcast by the trainer over the group
        (`load_format="flattened_bucket"`: as one flat broadcast). `version` as for tensors."""
        await self._weight_update(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
                "weight_version": _version_field(version),
                "load_format": load_format,
            },
            version,
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._weight_update("/destroy_weights_update_group", {"group_name": group_name}, None)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free GPU memory (`weights`, `kv_cache`, or all) while the trainer needs it."""
        await self._request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._request("POST", "/resume_memory_occupation", {"tags": tags})

    # -- internals -----------------------------------------------------------------------------

    def _generate_body(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None, stream: bool
    ) -> dict[str, Any]:
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if self._max_context is not None and len(input_ids) >= self._max_context:
            raise ValueError(
                f"prompt has {len(input_ids)} tokens; the engine's context is "
                f"{self._max_context} tokens"
            )
        # SGLang's `GenerateReqInput` (one request, token ids) and the subset of its strict
        # `SamplingParams` we send: an unknown sampling key would be a 400.
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,  # ours: 0 or -1 off; SGLang: -1
            "ignore_eos": params.ignore_eos,
        }
        if params.stop:
            sampling["stop"] = list(params.stop)
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling,
            "rid": request_id or uuid.uuid4().hex,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": stream,
        }
        if params.top_logprobs:
            body["top_logprobs_num"] = params.top_logprobs
        return body

    def _chunk(self, event: dict[str, Any], seen: int, started: bool) -> Chunk | None:
        """New tokens of one answer/event (checked by `_parse_event`), given `seen` tokens
        already delivered."""
        error = event.get("error")
        if error is not None:
            message = error.get("message") or "SGLang reported an error"
            if started:
                raise EngineError(f"{self!r}: {message}")
            raise ValueError(message)
        meta = event.get("meta_info")
        if meta is None:
            raise EngineError(f"{self!r}: /generate answer without meta_info")
        if meta.get("weight_version") is not None:
            self._weight_version = parse_version(meta["weight_version"])
        finish = meta.get("finish_reason")
        if (
            finish is not None
            and finish["type"] == "abort"
            and finish.get("status_code") == 400
            and not started
        ):
            raise ValueError(finish.get("message") or "SGLang rejected the request")
        entries = meta.get("output_token_logprobs") or []
        total = meta.get("completion_tokens")
        if total is None:
            total = len(entries)
        new = max(total - seen, 0)
        if new > len(entries):
            raise EngineError(
                f"{self!r}: {new} new tokens but only {len(entries)} output_token_logprobs"
            )
        fresh = entries[len(entries) - new :] if new else []
        if not fresh and finish is None:
            return None
        tops = meta.get("output_top_logprobs") or []
        fresh_tops = tops[len(tops) - new :] if new and len(tops) >= new else []
        return Chunk(
            token_ids=[e[1] for e in fresh],
            logprobs=[float(e[0]) if e[0] is not None else 0.0 for e in fresh],
            versions=self._versions(meta.get("weight_versions"), total - len(fresh), total),
            finish_reason=_FINISH.get(finish["type"], "abort") if finish is not None else None,
            top_logprobs=[
                [(e[1], float(e[0])) for e in row or [] if e[0] is not None] for row in fresh_tops
            ],
        )

    def _versions(self, spans: list[dict[str, Any]] | None, start: int, end: int) -> list[int]:
        """The weight version of output positions [start, end): from the spans, else (an older
        SGLang without them) the answer's `weight_version`."""
        if not spans:
            return [self._weight_version] * (end - start)
        out = [parse_version(spans[-1]["version"])] * (end - start)  # positions no span holds
        for span in reversed(spans):  # so that the first span holding a position wins
            lo, hi = max(span["start"], start), min(span["end"], end)
            if lo < hi:
                out[lo - start : hi - start] = [parse_version(span["version"])] * (hi - lo)
        return out

    async def _weight_update(self, path: str, body: dict[str, Any], version: int | None) -> None:
        """A weight route: `{success, message}` (a failed update is a 400 with success false);
        a 400 of another shape is SGLang refusing the request itself (ValueError)."""
        try:
            response = await self._client.post(path, content=orjson.dumps(body), headers=_JSON)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self!r}: {path} failed: {exc!r}") from exc
        raw = response.content
        if response.status_code not in (200, 400):
            self._raise_for_status(response, path)
        try:
            result = orjson.loads(raw)
            _is(result["success"], bool, "success", optional=False)
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            if response.status_code == 400:
                raise ValueError(f"SGLang rejected {path}: {_error_message(raw)}") from None
            raise EngineError(f"{self!r}: {path} answered {raw[:200]!r}") from exc
        if not result["success"]:
            raise EngineError(f"{self!r}: {path} failed: {result.get('message', '')}")
        if version is not None:
            self._weight_version = version

    async def _generate_raw(self, body: dict[str, Any]) -> bytes:
        try:
            status, data = await self._pool.fetch("/generate", orjson.dumps(body))
        except (OSError, EOFError, TimeoutError) as exc:
            raise EngineError(f"{self!r}: /generate failed: {exc!r}") from exc
        if status != 200:
            self._raise_for(status, data, "/generate")
        return data

    async def _request(
        self, method: Literal["GET", "POST"], path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        try:
            response = await self._client.request(
                method,
                path,
                content=orjson.dumps(body) if body is not None else None,
                headers=_JSON if body is not None else None,
            )
        except httpx.HTTPError as exc:
            raise EngineError(f"{self!r}: {path} failed: {exc!r}") from exc
        if response.status_code != 200:
            self._raise_for_status(response, path)
        try:
            data = response.json()
        except ValueError:
            return {}  # several control routes answer with plain text or nothing
        return data if isinstance(data, dict) else {"data": data}

    def _raise_for_status(self, response: httpx.Response, path: str) -> None:
        self._raise_for(response.status_code, response.content, path)

    def _raise_for(self, status: int, content: bytes, path: str) -> None:
        message = _error_message(content)
        if status == 400:
            raise ValueError(f"SGLang rejected {path}: {message}")
        raise EngineError(f"{self!r}: {path} returned HTTP {status}: {message}")


_JSON = {"content-type": "application/json"}


class _Pool:
    """Keep-alive HTTP/1.1 connections to one server, for `/generate` only: the hot path, where
    httpx's per-request cost (milliseconds on a busy 2-core machine) would be most of the
    gateway's overhead. Control routes use httpx. A response's body is framed by
    Content-Length or chunked encoding (uvicorn streams SSE chunked); a connection goes back to
    the pool only after its response was read to the end, and is closed otherwise (which is
    also how SGLang learns that an abandoned stream should be aborted).

    Timeouts: a watchdog task aborts any connection that has received nothing for `timeout_s`
    (its pending read then fails). Per-read timers would cost a timer-heap update per streamed
    event, and a timeout scope cannot span the `yield`s of a streaming generator."""

    def __init__(self, url: str, timeout_s: float, max_connections: int) -> None:
        parsed = httpx.URL(url)
        self.host = parsed.host
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.ssl = parsed.scheme == "https"
        self.prefix = parsed.path.rstrip("/")
        self.timeout_s = timeout_s
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._slots = asyncio.Semaphore(max_connections)
        self._watchdog: asyncio.Task[None] | None = None

    def close(self) -> None:
        """Close every connection, including those of requests still running (they fail)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for conn in [*self._idle, *self._busy]:
            conn.writer.close()
        self._idle.clear()

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes) -> AsyncIterator[_Response]:
        """A response to read as it arrives (a stream)."""
        async with self._slots:
            conn, response = await self._send(self._request(path, body))
            try:
                yield response
            finally:
                self._release(conn, response)

    async def fetch(self, path: str, body: bytes) -> tuple[int, bytes]:
        """A whole response: (status, body); `post` without a generator per request."""
        async with self._slots:
            conn, response = await self._send(self._request(path, body))
            try:
                return response.status, await response.read()
            finally:
                self._release(conn, response)

    def _request(self, path: str, body: bytes) -> bytes:
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    def _release(self, conn: _Conn, response: _Response) -> None:
        self._busy.discard(conn)
        if response.done and response.keep_alive and not conn.writer.is_closing():
            self._idle.append(conn)
        else:
            conn.writer.close()

    async def _send(self, request: bytes) -> tuple[_Conn, _Response]:
        clock = asyncio.get_running_loop().time
        while True:
            reused = bool(self._idle)
            if reused:
                conn = self._idle.pop()
            else:
                async with asyncio.timeout(min(self.timeout_s, 10.0)):
                    conn = _Conn(
                        *await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None)
                    )
            conn.active = clock()
            self._busy.add(conn)
            try:
                conn.writer.write(request)
                head = await conn.reader.readuntil(b"\r\n\r\n")
                return conn, _Response(conn, head, clock, self.timeout_s)
            except (OSError, asyncio.IncompleteReadError) as exc:
                self._busy.discard(conn)
                conn.writer.close()
                if conn.timed_out:
                    raise TimeoutError(f"no answer within {self.timeout_s} s") from exc
                # The server may close an idle keep-alive connection just as we reuse it:
                # retry on a fresh one. A fresh connection failing is a real failure.
                if not reused or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    raise

    async def _watch(self) -> None:
        clock = asyncio.get_running_loop().time
        interval = max(0.05, min(5.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            now = clock()
            for conn in list(self._busy):
                if now - conn.active > self.timeout_s:
                    conn.timed_out = True
                    conn.writer.transport.abort()


class _Conn:
    __slots__ = ("reader", "writer", "active", "timed_out")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.active = 0.0
        """Loop time of the last byte received (the watchdog's clock)."""
        self.timed_out = False


class _Response:
    def __init__(self, conn: _Conn, head: bytes, clock: Any, timeout_s: float) -> None:
        self.conn, self.clock, self.timeout_s = conn, clock, timeout_s
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise OSError(f"not an HTTP/1.1 response: {lines[0]!r}")
        self.status = int(parts[1])
        fields: dict[str, str] = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        self.chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        self.length = int(fields.get("content-length", "0"))
        self.keep_alive = fields.get("connection", "").lower() != "close"
        self.done = False

    def __enter__(self) -> _Response:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        """A read that failed because the watchdog aborted the connection is a timeout."""
        if isinstance(exc, OSError | asyncio.IncompleteReadError) and self.conn.timed_out:
            raise TimeoutError(f"no data for {self.timeout_s} s") from exc

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        if not self.chunked:
            yield await self.read()
            return
        reader = self.conn.reader
        with self:
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    self.done = True
                    return
                data = await reader.readexactly(size + 2)
                self.conn.active = self.clock()
                yield data[:-2]

    async def read(self) -> bytes:
        """The whole body (a Content-Length one without a generator: the non-streaming path)."""
        if self.chunked:
            return b"".join([piece async for piece in self.pieces()])
        with self:
            data = await self.conn.reader.readexactly(self.length)
        self.done = True
        return data

    async def lines(self) -> AsyncIterator[bytes]:
        buffer = b""
        async for piece in self.pieces():
            buffer += piece
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                yield line
        if buffer:
            yield buffer


def _max_model_len(models: dict[str, Any]) -> int:
    data = models.get("data") or [{}]
    value = int(data[0].get("max_model_len") or 0)
    if value <= 0:
        raise ValueError("/v1/models did not report max_model_len")
    return value


def _error_message(content: bytes) -> str:
    """SGLang's error bodies: `{"error": {"message"}}`, `{"message"}` or plain text."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode(errors="replace").strip()[:500]
    if isinstance(data, dict):
        if isinstance(data.get("error"), dict):
            return str(data["error"].get("message", data))
        if "message" in data:
            return str(data["message"])
        if "detail" in data:
            return str(data["detail"])
    return str(data)[:500]


def _version_field(version: int | None) -> str | None:
    return None if version is None else str(version)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
