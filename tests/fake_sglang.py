"""A fake SGLang HTTP server: SGLang's wire protocol, field by field, with a hash for a model.

SGLang needs a GPU, so CPU tests and the gateway benchmark talk to this instead. It follows
SGLang's source (`entrypoints/http_server.py`, `managers/io_struct.py`,
`managers/tokenizer_manager.py`, `sampling/sampling_params.py`):

- `POST /generate` with `input_ids`; `sampling_params` is strict (an unknown key is a 400, as
  SGLang's `SamplingParams(**params)` raises on it) and checked like `SamplingParams.verify`
  (`top_k` must be -1 or >= 1, `top_p` in (0, 1], ...); prompts of `context_length` tokens or
  more are a 400. Errors are `{"error": {"message": ...}}`; on a stream, an `error` event.
- The answer is `{text, output_ids, meta_info}` with `id`, `finish_reason`
  (`{"type": "stop", "matched": ID}`, `{"type": "stop", "matched": "str"}`,
  `{"type": "length", "length": N}`, `{"type": "abort", "message": ...}`), `prompt_tokens`,
  `completion_tokens`, `cached_tokens`, `weight_version` (a string, `"default"` at start; the
  version of the last output token), `weight_versions` (per-token spans
  `[{version, start, end}]` over the whole output, one per version a request ran under),
  `e2e_latency` and, with `return_logprob`, `output_token_logprobs` / `input_token_logprobs`
  as `[logprob, token_id, null]` (the prompt's first entry has a null logprob); with
  `top_logprobs_num=k`, `output_top_logprobs` (per output position, k such triples).
- The EOS id ends up in `output_ids` but not in `text`; a matched stop string is cut from `text`.
- Streams are cumulative (every event carries the whole output so far) unless started with
  `--incremental` (SGLang's `--incremental-streaming-output`), then deltas. Like SGLang, an abort
  event of a request still waiting in the queue carries only the last output id.
- `/pause_generation` (`mode`: `abort` ends running requests, `retract` and `in_place` hold them;
  new requests wait) and `/continue_generation`; `/abort_request` (`rid` or `abort_all`);
  `/flush_cache` (400 while requests run); the weight routes answer
  `{"success", "message"}` and set `weight_version` when given one (only when it is given:
  a bucket without one leaves the version alone); `/update_weights_from_tensor` and
  `/update_weights_from_distributed` are refused (400, `success: false`) outside a
  `/begin_weight_update` ... `/end_weight_update` session, and a second `begin` or an `end`
  without one is refused too, as SGLang's weight updater asserts; `/health` (which, like
  SGLang's, runs into its timeout and answers 503 while generation is paused),
  `/release_memory_occupation` and `/resume_memory_occupation` (`tags`, default weights and
  KV cache; weights resumed without `--enable-weights-cpu-backup` are garbage, as in SGLang:
  every logprob is then the uniform -log(vocab)),
  `/get_model_info`, `/get_weight_version`, `/get_server_info`, `/v1/models`.

The "model" is a rolling hash of the token ids: the next token and its logprob depend only on
the context, so a scored sequence gets exactly the logprobs its generation reported, and
prefill-only scoring (`max_new_tokens=0`) is consistent with generation. It is cheap: thousands
of requests per second, for the gateway benchmark. `/_fake/health` (not SGLang) lets tests take
the server down and up without killing it.

Run: `python tests/fake_sglang.py --port N [--latency-ms X] [--tokens-per-s Y] [--incremental]`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# Every key SGLang's SamplingParams accepts; anything else is a TypeError there, a 400 here.
SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p "
    "frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema regex "
    "ebnf structural_tag ignore_eos skip_special_tokens spaces_between_special_tokens "
    "no_stop_trim custom_params stream_interval logit_bias sampling_seed".split()
)
MASK = (1 << 61) - 1


def mix(h: int) -> int:
    """A cheap 61-bit integer mixer (splitmix-style)."""
    h = (h ^ (h >> 31)) * 0x7FB5D329728EA185 & MASK
    h = (h ^ (h >> 27)) * 0x81DADEF4BC2DD44D & MASK
    return h ^ (h >> 33)


def step(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 1) & MASK


def token_logprob(h: int, token: int) -> float:
    """log p(token | context hash h): deterministic, in [-6, -0.001]."""
    return -0.001 - (mix(h ^ (token * 0x9E3779B97F4A7C15 & MASK)) % 6000) / 1000.0


class BadRequest(ValueError):
    pass


def weight_versions(versions: list[str], current: str) -> dict[str, Any]:
    """SGLang's `weight_versions` spans over the output positions, and `weight_version` (the
    last span's; the server's current version for an empty output)."""
    spans: list[dict[str, Any]] = []
    for pos, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = pos + 1
        else:
            spans.append({"version": version, "start": pos, "end": pos + 1})
    if not spans:
        spans = [{"version": current, "start": 0, "end": 0}]
    return {"weight_versions": spans, "weight_version": spans[-1]["version"]}


@dataclass
class FakeConfig:
    model_path: str = "fake/tiny-random"
    context_length: int = 4096
    vocab_size: int = 49152
    first_token_id: int = 17
    """Sampled ids are in [first_token_id, vocab_size): SmolLM2's special tokens are 0..16."""
    eos_token_id: int = 2
    eos_every: int = 48
    """About one sampled token in this many is EOS (unless ignore_eos); 0: never."""
    latency_ms: float = 0.0
    """Delay before the first token (prefill)."""
    tokens_per_s: float = 0.0
    """Decode pace; 0 = as fast as possible."""
    incremental: bool = False
    """SGLang's --incremental-streaming-output: stream deltas, not cumulative outputs."""
    weight_version: str = "default"
    health_timeout_s: float = 20.0
    """How long /health waits for a paused server (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT)."""
    weights_cpu_backup: bool = False
    """SGLang's --enable-weights-cpu-backup (off by default there too): without it, weights
    released by /release_memory_occupation come back from /resume_memory_occupation as
    garbage, which this fake models as a uniform distribution (every logprob -log(vocab))."""


@dataclass
class Running:
    rid: str
    waiting: bool = True
    """Still queued (no token yet): SGLang's abort path then differs."""
    abort_message: str | None = None


@dataclass
class FakeState:
    config: FakeConfig
    weight_version: str = "default"
    paused: bool = False
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    running: dict[str, Running] = field(default_factory=dict)
    healthy: bool = True
    released: set[str] = field(default_factory=set)
    session_open: bool = False
    """Inside /begin_weight_update ... /end_weight_update."""
    garbage_weights: bool = False
    """Weights resumed without a CPU backup: every logprob is -log(vocab_size)."""
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: int = 0
    generated_tokens: int = 0
    """Every token sampled, for benchmarks that check none is lost or duplicated downstream."""


def validate_sampling(raw: Any, prompt_len: int, config: FakeConfig) -> dict[str, Any]:
    params = dict(raw or {})
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"Unexpected keyword argument '{unknown[0]}'")
    out = {
        "max_new_tokens": params.get("max_new_tokens", 128),
        "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0),
        "top_k": params.get("top_k", -1),
        "ignore_eos": bool(params.get("ignore_eos", False)),
        "sampling_seed": params.get("sampling_seed"),
        "no_stop_trim": bool(params.get("no_stop_trim", False)),
    }
    for key in ("temperature", "top_p"):
        if out[key] is None:
            out[key] = 1.0
    if out["top_k"] is None:
        out["top_k"] = -1
    if not isinstance(out["temperature"], int | float) or out["temperature"] < 0:
        raise BadRequest(
            f"temperature must be a non-negative finite number, got {out['temperature']}."
        )
    if not isinstance(out["top_p"], int | float) or not 0.0 < out["top_p"] <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {out['top_p']}.")
    top_k = out["top_k"]
    if out["temperature"] < 1e-6:  # SGLang: greedy is top_k=1
        top_k = 1
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    max_new = out["max_new_tokens"]
    if max_new is None:
        max_new = config.context_length - prompt_len
    if not isinstance(max_new, int) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
    out["max_new_tokens"] = max_new
    stop = params.get("stop") or []
    out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    ids = params.get("stop_token_ids") or []
    if not all(isinstance(t, int) for t in ids):
        raise BadRequest(f"stop_token_ids must be integers, got {ids!r}")
    out["stop_token_ids"] = set(ids)
    return out


def token_text(token: int) -> str:
    return f" t{token}"


class FakeSGLang:
    """The generation loop and request bookkeeping; `build_app` wraps it in HTTP routes."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.state = FakeState(config=config, weight_version=config.weight_version)
        self.state.resumed.set()

    def parse_generate(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body.get("input_ids")
        if ids is None:
            if body.get("text") is not None:
                raise BadRequest("this fake SGLang takes input_ids only (it has no tokenizer)")
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of integers")
        if len(ids) >= self.config.context_length:
            raise BadRequest(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.config.context_length} tokens)."
            )
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise BadRequest(f"input_ids must be in [0, {self.config.vocab_size})")
        params = validate_sampling(body.get("sampling_params"), len(ids), self.config)
        start = body.get("logprob_start_len")
        start = -1 if start is None else start
        if not isinstance(start, int) or start >= len(ids):
            raise BadRequest(
                f"logprob_start_len ({start}) is higher than the number of input tokens "
                f"({len(ids)}). Request with a lower logprob_start_len."
            )
        top_k = body.get("top_logprobs_num") or 0
        if not isinstance(top_k, int) or top_k < 0:
            raise BadRequest("top_logprobs_num must be a non-negative integer")
        rid = body.get("rid") or f"{time.time_ns():x}"
        if rid in self.state.running:
            raise BadRequest(f"Duplicate request ID: {rid}")
        return {
            "rid": rid,
            "ids": ids,
            "params": params,
            "return_logprob": bool(body.get("return_logprob")),
            "logprob_start_len": start,
            "top_logprobs_num": top_k,
            "stream": bool(body.get("stream")),
            "versions": [],
        }

    async def generate(self, req: dict[str, Any]):
        """Yields (token, logprob, top row, finish_reason-or-None, total_ids, total_text)."""
        cfg, state = self.config, self.state
        running = Running(req["rid"])
        state.running[req["rid"]] = running
        state.requests += 1
        try:
            await state.resumed.wait()  # SGLang holds new requests while paused
            if cfg.latency_ms:
                await asyncio.sleep(cfg.latency_ms / 1000)
            params = req["params"]
            h = 0
            for t in req["ids"]:
                h = step(h, t)
            seed = params["sampling_seed"] or 0
            greedy = params["temperature"] < 1e-6
            span = cfg.vocab_size - cfg.first_token_id
            out_ids: list[int] = []
            text_parts: list[str] = []
            delay = 1.0 / cfg.tokens_per_s if cfg.tokens_per_s else 0.0
            finish: dict[str, Any] | None = None
            if params["max_new_tokens"] == 0:
                finish = {"type": "length", "length": 0}
            while finish is None:
                if running.abort_message is not None:
                    finish = {"type": "abort", "message": running.abort_message}
                    break
                if not state.resumed.is_set():
                    await state.resumed.wait()
                    continue
                r = mix(h if greedy else h ^ mix(seed + 1))
                if not params["ignore_eos"] and cfg.eos_every and r % cfg.eos_every == 0:
                    token = cfg.eos_token_id
                else:
                    token = cfg.first_token_id + (r >> 8) % span
                lp = self.logprob(h, token)
                top = self.top_row(h, token, req["top_logprobs_num"])
                h = step(h, token)
                out_ids.append(token)
                req["versions"].append(state.weight_version)
                state.generated_tokens += 1
                running.waiting = False
                if token == cfg.eos_token_id and not params["ignore_eos"]:
                    finish = {"type": "stop", "matched": token}
                elif token in params["stop_token_ids"] and not params["ignore_eos"]:
                    finish = {"type": "stop", "matched": token}
                    text_parts.append(token_text(token))
                else:
                    text_parts.append(token_text(token))
                    if params["stop"]:
                        text = "".join(text_parts)
                        for s in params["stop"]:
                            cut = text.find(s)
                            if cut >= 0:
                                finish = {"type": "stop", "matched": s}
                                if not params["no_stop_trim"]:
                                    text_parts = [text[:cut]]
                                break
                if finish is None and len(out_ids) >= params["max_new_tokens"]:
                    finish = {"type": "length", "length": params["max_new_tokens"]}
                yield token, lp, top, finish, out_ids, text_parts
                if delay:
                    await asyncio.sleep(delay)
            if finish["type"] == "abort" or not out_ids:
                yield None, None, None, finish, out_ids, text_parts
        finally:
            state.running.pop(req["rid"], None)

    def logprob(self, h: int, token: int) -> float:
        """`token_logprob`, or the uniform distribution's once the weights are garbage."""
        if self.state.garbage_weights:
            return -math.log(self.config.vocab_size)
        return token_logprob(h, token)

    def top_row(self, h: int, token: int, k: int) -> list[list[Any]]:
        """The k likeliest of the sampled token and 2k hashed candidates, as SGLang triples."""
        if k <= 0:
            return []
        span = self.config.vocab_size - self.config.first_token_id
        ids = {token} | {self.config.first_token_id + mix(h ^ (j + 1)) % span for j in range(2 * k)}
        return sorted(([self.logprob(h, t), t, None] for t in ids), reverse=True)[:k]

    def meta(
        self,
        req: dict[str, Any],
        finish: dict[str, Any] | None,
        completion: int,
        logprobs: list[list[Any]] | None,
        started: float,
        tops: list[list[list[Any]]] | None = None,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req["rid"],
            "finish_reason": finish,
            "prompt_tokens": len(req["ids"]),
            **weight_versions(req.get("versions", [])[:completion], self.state.weight_version),
            "total_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": completion,
            "cached_tokens": 0,
        }
        if req["return_logprob"]:
            meta["output_token_logprobs"] = logprobs
            meta["input_token_logprobs"] = self.input_logprobs(req)
            meta["output_top_logprobs"] = (tops or []) if req["top_logprobs_num"] else []
            meta["input_top_logprobs"] = []
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - started
        return meta

    def input_logprobs(self, req: dict[str, Any]) -> list[list[Any]]:
        ids = req["ids"]
        start = req["logprob_start_len"]
        start = len(ids) - 1 if start < 0 else start
        out: list[list[Any]] = []
        h = 0
        for i, t in enumerate(ids):
            if i >= start:
                out.append([None if i == 0 else self.logprob(h, t), t, None])
            h = step(h, t)
        return out


def build_app(config: FakeConfig) -> Starlette:
    fake = FakeSGLang(config)
    state = fake.state

    async def generate(request: Request) -> Response:
        body = None
        try:
            body = orjson.loads(await request.body())
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            req = fake.parse_generate(body)
        except (BadRequest, orjson.JSONDecodeError) as exc:
            if isinstance(body, dict) and body.get("stream"):
                return StreamingResponse(_error_stream(str(exc)), media_type="text/event-stream")
            return _error(str(exc))
        started = time.perf_counter()
        if req["stream"]:
            return StreamingResponse(stream_events(req, started), media_type="text/event-stream")
        entries: list[list[Any]] = []
        tops: list[list[list[Any]]] = []
        last: tuple = ()
        async for item in fake.generate(req):
            if item[0] is not None:
                entries.append([item[1], item[0], None])
                tops.append(item[2])
            last = item
        _, _, _, finish, ids, text_parts = last
        answer = {
            "text": "".join(text_parts),
            "output_ids": list(ids),
            "meta_info": fake.meta(req, finish, len(ids), entries, started, tops),
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def stream_events(req: dict[str, Any], started: float):
        entries: list[list[Any]] = []
        tops: list[list[list[Any]]] = []
        sent = sent_text = 0
        async for token, lp, top, finish, ids, text_parts in fake.generate(req):
            if token is not None:
                entries.append([lp, token, None])
                tops.append(top)
            if finish is not None and finish["type"] == "abort":
                # SGLang's abort event: cumulative logprobs, but only the last output id.
                last = [ids[-1]] if ids else []
                meta = fake.meta(req, finish, len(ids), entries, started, tops)
                event = {"text": "".join(text_parts), "output_ids": last, "meta_info": meta}
            elif config.incremental:
                text = "".join(text_parts)
                meta = fake.meta(req, finish, len(ids), entries[sent:], started, tops[sent:])
                event = {"text": text[sent_text:], "output_ids": ids[sent:], "meta_info": meta}
                sent_text = len(text)
            else:
                meta = fake.meta(req, finish, len(ids), list(entries), started, list(tops))
                event = {"text": "".join(text_parts), "output_ids": list(ids), "meta_info": meta}
            sent = len(ids)
            yield b"data: " + orjson.dumps(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def abort_request(request: Request) -> Response:
        body = await _json(request)
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        for key, running in list(state.running.items()):
            # SGLang matches by prefix (a parallel-sampling request's children share it).
            if abort_all or (rid and key.startswith(rid)):
                running.abort_message = (
                    "Abort in waiting queue" if running.waiting else "Abort before finishing"
                )
        return Response(status_code=200)

    async def pause_generation(request: Request) -> Response:
        body = await _json(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _error(
                f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place']."
            )
        state.paused = True
        state.resumed.clear()
        if mode == "abort":
            for running in state.running.values():
                running.abort_message = "Abort in waiting queue" if running.waiting else "Abort"
            # Aborted requests must be able to finish while the server stays paused.
            state.resumed.set()
            await asyncio.sleep(0)
            deadline = time.monotonic() + 5
            while any(r.abort_message for r in state.running.values()):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.001)
            state.resumed.clear()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(request: Request) -> Response:
        state.paused = False
        state.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(request: Request) -> Response:
        ok = not state.running
        return Response(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n",
            status_code=200 if ok else 400,
        )

    def _session_refusal(body: dict[str, Any], route: str) -> Response | None:
        if state.session_open:
            return None
        return _weights_result(body, False, f"{route} requires an open begin_weight_update session")

    async def begin_weight_update(request: Request) -> Response:
        body = await _json(request)
        if state.session_open:
            message = "begin_weight_update called while a weight-update session is already open"
            return _weights_result({}, False, message)
        if body.get("selector", "all") not in ("all", "target", "draft"):
            return _weights_result({}, False, f"invalid selector {body.get('selector')!r}")
        state.session_open = True
        return _weights_result({}, True, "Success")

    async def end_weight_update(request: Request) -> Response:
        if not state.session_open:
            return _weights_result(
                {}, False, "end_weight_update called without begin_weight_update"
            )
        state.session_open = False
        return _weights_result({}, True, "Success")

    def _weights_result(body: dict[str, Any], ok: bool, message: str, **extra) -> Response:
        if ok and body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {state.weight_version}."
        return JSONResponse(
            {"success": ok, "message": message, **extra}, status_code=200 if ok else 400
        )

    async def update_weights_from_disk(request: Request) -> Response:
        body = await _json(request)
        path = body.get("model_path")
        if not isinstance(path, str):
            return _error("model_path is required")
        names = _safetensors_names(path)
        if names is None:
            return _weights_result(
                body,
                False,
                f"Failed to get weights iterator: no *.safetensors in {path}.",
                num_paused_requests=0,
            )
        return _weights_result(
            body,
            True,
            f"Succeeded to update model weights ({len(names)} tensors).",
            num_paused_requests=0,
        )

    async def update_weights_from_tensor(request: Request) -> Response:
        body = await _json(request)
        if refused := _session_refusal(body, "update_weights_from_tensor"):
            return refused
        tensors = body.get("serialized_named_tensors")
        if not isinstance(tensors, list) or not tensors:
            return _weights_result(body, False, "serialized_named_tensors is required")
        try:  # base64 of a pickle per TP rank: not unpickled here (CUDA IPC handles)
            for payload in tensors:
                base64.b64decode(payload, validate=True)
        except (TypeError, ValueError):
            return _error("serialized_named_tensors must be base64 strings, one per TP rank")
        return _weights_result(body, True, "Succeeded to update model weights.")

    async def init_weights_update_group(request: Request) -> Response:
        body = await _json(request)
        missing = [
            k
            for k in ("master_address", "master_port", "rank_offset", "world_size")
            if k not in body
        ]
        if missing:
            return _error(f"missing field(s): {', '.join(missing)}")
        state.groups[body.get("group_name", "weight_update_group")] = body
        return _weights_result({}, True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(request: Request) -> Response:
        body = await _json(request)
        if refused := _session_refusal(body, "update_weights_from_distributed"):
            return refused
        group = body.get("group_name", "weight_update_group")
        if group not in state.groups:
            return _weights_result(body, False, f"Group {group} not in process groups")
        if not (
            len(body.get("names", [])) == len(body.get("dtypes", [])) == len(body.get("shapes", []))
        ):
            return _weights_result(body, False, "names, dtypes and shapes differ in length")
        return _weights_result(body, True, "Succeeded to update parameter online.")

    async def destroy_weights_update_group(request: Request) -> Response:
        body = await _json(request)
        ok = state.groups.pop(body.get("group_name", "weight_update_group"), None) is not None
        return _weights_result({}, ok, "Succeeded to destroy group." if ok else "Group not found")

    async def release_memory(request: Request) -> Response:
        body = await _json(request)
        state.released |= set(body.get("tags") or ["weights", "kv_cache"])
        return Response(status_code=200)

    async def resume_memory(request: Request) -> Response:
        body = await _json(request)
        tags = set(body.get("tags") or ["weights", "kv_cache"])
        if "weights" in tags & state.released and not config.weights_cpu_backup:
            state.garbage_weights = True
        state.released -= tags
        return Response(status_code=200)

    async def health(request: Request) -> Response:
        # SGLang's /health generates one token; while paused that request waits, and after
        # SGLANG_HEALTH_CHECK_TIMEOUT (20 s) without an answer the probe is a 503.
        if not state.healthy:
            return Response(status_code=503)
        if state.paused:
            try:
                await asyncio.wait_for(state.resumed.wait(), config.health_timeout_s)
            except TimeoutError:
                return Response(status_code=503)
        return Response(status_code=200)

    async def set_health(request: Request) -> Response:
        state.healthy = bool((await _json(request)).get("healthy", True))
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": config.model_path,
                "tokenizer_path": config.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": state.weight_version,
            }
        )

    async def weight_version(request: Request) -> Response:
        return JSONResponse({"weight_version": state.weight_version})

    async def server_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": config.model_path,
                "context_length": config.context_length,
                "incremental_streaming_output": config.incremental,
                "weight_version": state.weight_version,
                "tp_size": 1,
                "paused": state.paused,
                "released_memory": sorted(state.released),
                "num_requests": state.requests,
                "generated_tokens": state.generated_tokens,
                "version": "fake",
            }
        )

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model_path,
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang",
                        "root": config.model_path,
                        "max_model_len": config.context_length,
                    }
                ],
            }
        )

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/begin_weight_update", begin_weight_update, methods=["POST"]),
        Route("/end_weight_update", end_weight_update, methods=["POST"]),
        Route("/update_weights_from_tensor", update_weights_from_tensor, methods=["POST"]),
        Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
        Route(
            "/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]
        ),
        Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
        Route("/release_memory_occupation", release_memory, methods=["GET", "POST"]),
        Route("/resume_memory_occupation", resume_memory, methods=["GET", "POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_weight_version", weight_version, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/_fake/health", set_health, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.fake = fake
    return app


async def _error_stream(message: str):
    yield b"data: " + orjson.dumps({"error": {"message": message}}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _error(message: str, status: int = 400) -> Response:
    return Response(
        orjson.dumps({"error": {"message": message}}),
        status_code=status,
        media_type="application/json",
    )


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def _safetensors_names(path: str) -> list[str] | None:
    """Tensor names in a folder's safetensors files, read from their JSON headers."""
    import glob
    import os
    import struct

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    names: list[str] = []
    for f in files:
        with open(f, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = orjson.loads(handle.read(size))
        names += [k for k in header if k != "__metadata__"]
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="delay before the first token"
    )
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="decode pace (0 = instant)")
    parser.add_argument("--incremental", action="store_true", help="incremental streaming output")
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--eos-token-id", type=int, default=2)
    parser.add_argument(
        "--eos-every", type=int, default=48, help="about one token in N is EOS (0: never)"
    )
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--health-timeout-s", type=float, default=20.0)
    parser.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep released weights in CPU memory (without it they come back as garbage)",
    )
    args = parser.parse_args(argv)
    config = FakeConfig(
        latency_ms=args.latency_ms,
        tokens_per_s=args.tokens_per_s,
        incremental=args.incremental,
        context_length=args.context_length,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        eos_every=args.eos_every,
        weight_version=args.weight_version,
        health_timeout_s=args.health_timeout_s,
        weights_cpu_backup=args.enable_weights_cpu_backup,
    )
    import uvicorn

    print(f"fake SGLang on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(
        build_app(config),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_fake(*args: str, port: int | None = None) -> Iterator[str]:
    """Run the fake in a subprocess (its own event loop and GIL, like a real server); yields its
    URL once `/health` answers, and stops it on exit."""
    import subprocess
    import sys
    import urllib.request

    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fake SGLang exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("fake SGLang did not start within 30 s") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=2)  # uvicorn waits for open streams; do not wait long
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
