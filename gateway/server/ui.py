"""The browser UI: the session list and a token-by-token trajectory viewer, at `GET /ui`.

The page is static HTML, CSS and vanilla JS shipped in `static/` (package data; no build step,
nothing fetched from outside the machine). It reads JSON from the routes here, which follow the
admin routes' rules: the session list needs the admin token; one session is readable by the
admin or by its own key (in open mode too), and to anyone else it does not exist (404).
`trainer.view` serves the same page and the same trajectory view for a finished run.

Decisions a reader needs:
- **How the browser authenticates.** A navigation cannot carry an `Authorization` header, so the
  page shell (`/ui`, `/ui/static/*`) holds no data and needs no token; all data comes from
  `/ui/api/*`, which the page fetches with `Authorization: Bearer <token>`. The token arrives in
  the URL fragment (`/ui#token=...`: browsers never send a fragment to a server, nor in a
  `Referer`), or is typed into the page's form; the page keeps it in `sessionStorage` (this tab
  and this origin only, port included) and removes it from the address bar. No cookie: a cookie
  is not scoped by port, so one set by a gateway on 127.0.0.1:8000 would go to every other server
  on 127.0.0.1 too, and an ambient credential would need CSRF defences that a header does not.
- **Nothing from a model or an agent is ever markup.** The page builds every node that holds
  data with `textContent`/text nodes (never `innerHTML`), links only to URLs it builds itself, and
  every `/ui` response carries a Content-Security-Policy without inline scripts, so even a bug
  there could not run injected code.
- **Rendering.** The server sends one JSON view per trajectory: per segment the token ids, each
  token's text (`TokenTexts`), loss mask, behaviour logprobs and versions as flat arrays, and per
  turn where its output sits in the segments with the tool calls parsed from it (as the agent got
  them) and the tool results the agent sent before it. The browser builds the token spans in
  chunks, yielding between them, so a 32K-token trajectory renders without freezing the tab. A
  large view is built on a worker thread, off the gateway's event loop.
- **Live sessions** are polled (`?since=<rev>`, once a second): an unchanged session answers
  `{"unchanged": true}` without exporting anything. (Polling, not SSE: `EventSource` cannot send
  the `Authorization` header.)
- **10,000 sessions**: the list is paged on the server (filter, sort, slice), and only the rows
  of the page are summarized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.render import IncrementalDecoder, Renderer, ToolCallParser
from gateway.server.auth import api_key, same_key
from gateway.server.http import json_response
from gateway.server.validation import ApiError
from gateway.sessions import Session
from gateway.trajectory import Trajectory

if TYPE_CHECKING:
    from gateway.server.app import Gateway

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
OFFTHREAD_TOKENS = 4096
"""A trajectory view with more tokens than this is built on a worker thread."""
MAX_PAGE = 500
SORT_KEYS = ("created", "reward", "turns", "tokens", "status")
_TOOL_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
_FORCED_PREFIX_TOKENS = 64
"""How far back before an output to look for a `<tool_call>` the gateway wrote (forced call)."""


# ---------------------------------------------------------------------------------------------
# The page and its assets


def _static() -> dict[str, bytes]:
    folder = importlib.resources.files("gateway.server") / "static"
    return {
        f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(tuple(STATIC_TYPES))
    }


_ASSETS: dict[str, bytes] | None = None


def asset_response(name: str) -> Response:
    """A file of `static/` with the UI's security headers; 404 for any other name."""
    global _ASSETS
    if _ASSETS is None:
        _ASSETS = _static()
    body = _ASSETS.get(name)
    if body is None:
        raise ApiError(404, f"no UI asset {name[:100]!r}", code="not_found")
    suffix = name[name.rfind(".") :]
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-cache"}
    return Response(body, 200, headers, media_type=STATIC_TYPES[suffix])


def shell_routes(wrap: Callable[[Callable[[Request], Awaitable[Response]]], Any]) -> list[Route]:
    """`/ui` (the page) and `/ui/static/{name}`: no data, no token needed."""

    async def page(request: Request) -> Response:
        return asset_response("ui.html")

    async def static(request: Request) -> Response:
        return asset_response(request.path_params["name"])

    return [
        Route("/ui", wrap(page), methods=["GET"]),
        Route("/ui/static/{name}", wrap(static), methods=["GET"]),
    ]


def api_json(data: Any, status: int = 200) -> Response:
    response = json_response(data, status)
    response.headers.update({**SECURITY_HEADERS, "Cache-Control": "no-store"})
    return response


def require_token(request: Request, token: str) -> None:
    """401 unless the request carries `token` (a viewer's own token, as the admin's)."""
    if not same_key(api_key(request), token):
        raise ApiError(
            401,
            "this page needs the token: open the URL with #token=... or enter it in the form",
            code="invalid_api_key",
        )


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise ApiError(
            400, f"{name} must be an integer in [{lo}, {hi}], got {raw[:50]!r}", param=name
        )
    return int(raw)


def choice_param(request: Request, name: str, choices: Sequence[str], default: str) -> str:
    raw = request.query_params.get(name) or default
    if raw not in choices:
        raise ApiError(
            400, f"{name} must be one of {', '.join(choices)}; got {raw[:50]!r}", param=name
        )
    return raw


# ---------------------------------------------------------------------------------------------
# Token texts


class TokenTexts:
    """Each token's text, as a list that joins to exactly what the tokenizer decodes (special
    tokens, which decoding skips, by name: `<|im_end|>`).

    One token decoded alone is usually its text, and a per-id cache of that makes a 32K-token
    trajectory cost milliseconds; but not always (a byte-level token holding part of a UTF-8
    character, a SentencePiece word-start space). So each run of non-special tokens is decoded as
    a whole too, and where the cached texts do not join to it the run is detokenized
    incrementally, each character going to the token that completes it (a token that completes
    none reads as an empty string). Without a tokenizer, each token reads as `⟨id⟩`.
    """

    def __init__(self, renderer: Renderer | None) -> None:
        self.renderer = renderer
        self._one: dict[int, str] = {}

    def __call__(self, ids: Sequence[int]) -> tuple[list[str], list[int]]:
        """The texts of `ids`, and the positions of special tokens."""
        r = self.renderer
        if r is None:
            return [f"\u27e8{i}\u27e9" for i in ids], []
        texts: list[str] = []
        specials: list[int] = []
        run: list[int] = []
        for pos, i in enumerate(ids):
            if i in r.special_ids:
                self._run(run, texts)
                run = []
                specials.append(pos)
                texts.append(r.token_text(i))
            else:
                run.append(i)
        self._run(run, texts)
        return texts, specials

    def _run(self, run: list[int], out: list[str]) -> None:
        if not run:
            return
        one = self._one
        texts = []
        for i in run:
            t = one.get(i)
            if t is None:
                t = one[i] = self.renderer.decode([i])  # type: ignore[union-attr]
            texts.append(t)
        if "".join(texts) != self.renderer.decode(run):  # type: ignore[union-attr]
            decoder = IncrementalDecoder(self.renderer)  # type: ignore[arg-type]
            texts = [decoder.push([i]) for i in run]
            texts[-1] += decoder.finish()
        out.extend(texts)


# ---------------------------------------------------------------------------------------------
# Views


def turn_layout(traj: Trajectory) -> list[dict[str, Any]]:
    """Per turn: where its output sits in the segments (`segment`, `start`, `end`; `segment` is
    None for a turn left out of them: undelivered), and what describes it."""
    segments = [s.token_ids for s in traj.segments]
    out = []
    for turn in traj.turns:
        start, end = len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.output_ids)
        where = None
        if turn.delivered:
            where = next(
                (
                    k
                    for k in reversed(range(len(segments)))
                    if len(segments[k]) >= end
                    and segments[k][start:end] == turn.output_ids
                    and segments[k][:start] == turn.prompt_ids
                ),
                None,
            )
        versions = turn.output_versions
        out.append(
            {
                "segment": where,
                "start": start,
                "end": end,
                "finish_reason": turn.finish_reason,
                "endpoint": turn.endpoint,
                "delivered": turn.delivered,
                "started_at": turn.started_at,
                "duration_s": round(turn.duration_s, 4),
                "max_tokens": turn.max_tokens,
                "versions": [min(versions), max(versions)] if versions else None,
            }
        )
    return out


def trajectory_view(
    traj: Trajectory,
    texts: TokenTexts,
    layout: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON the page renders one trajectory from (see the module docstring); `layout` is
    `turn_layout(traj)` unless given (a sample stores it, since it keeps no turns)."""
    layout = turn_layout(traj) if layout is None else [dict(t) for t in layout]
    segments = []
    trained = changes = 0
    versions: set[int] = set()
    for seg in traj.segments:
        seg_texts, specials = texts(seg.token_ids)
        segments.append(
            {
                "ids": seg.token_ids,
                "text": seg_texts,
                "special": specials,
                "mask": seg.loss_mask,
                "lp": [round(x, 4) for x in seg.logprobs],
                "ver": seg.versions,
            }
        )
        trained += sum(seg.loss_mask)
        sampled = [v for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m]
        versions.update(sampled)
        changes += sum(a != b for a, b in zip(sampled, sampled[1:], strict=False))
    _annotate_turns(layout, segments)
    return {
        "id": traj.session_id,
        "status": traj.status,
        "reason": traj.reason,
        "reward": traj.reward,
        "info": traj.info,
        "metadata": traj.metadata,
        "forks": traj.forks,
        "turns": layout,
        "segments": segments,
        "stats": {
            "turns": len(layout),
            "tokens": sum(len(s["ids"]) for s in segments),
            "trained": trained,
            "versions": sorted(versions),
            "version_changes": changes,
        },
        **extra,
    }


def _annotate_turns(layout: list[dict[str, Any]], segments: list[dict[str, Any]]) -> None:
    """Add to each placed turn the tool calls the agent got from its output and the tool results
    it sent in the prompt tokens before it (everything after the previous output)."""
    last_end: dict[int, int] = {}
    for turn in sorted((t for t in layout if t["segment"] is not None), key=lambda t: t["start"]):
        seg = segments[turn["segment"]]
        specials = set(seg["special"])

        def text(a: int, b: int, seg=seg, specials=specials) -> str:
            return "".join(seg["text"][i] for i in range(a, b) if i not in specials)

        gap_start = last_end.get(turn["segment"], 0)
        turn["input_start"] = gap_start
        turn["tool_results"] = _TOOL_RESPONSE.findall(text(gap_start, turn["start"]))
        # a forced call's opening is the gateway's, written after the generation prompt (its
        # last special token) of this turn's own new prompt tokens
        since = max(gap_start, turn["start"] - _FORCED_PREFIX_TOKENS)
        since = max([since] + [i + 1 for i in seg["special"] if since <= i < turn["start"]])
        before = text(since, turn["start"])
        opened = before.rfind("<tool_call>")
        forced = opened >= 0 and "</tool_call>" not in before[opened:]
        parser = ToolCallParser(before[opened:] if forced else "", forced=forced)
        parser.push(text(turn["start"], turn["end"]))
        parser.finish()
        turn["tool_calls"] = [
            {"name": c.name, "arguments": c.arguments, "valid": c.valid} for c in parser.calls
        ]
        last_end[turn["segment"]] = turn["end"]


def session_status(session: Session) -> str:
    return session.trajectory.status if session.closed else "open"


def session_rev(session: Session) -> str:
    """Changes whenever the session's view would."""
    t = session.trajectory
    return f"{len(t.turns)}:{session_status(session)}:{t.reward}:{len(t.info)}:{session.requests}"


def session_row(session: Session) -> dict[str, Any]:
    t = session.trajectory
    versions = [v for turn in t.turns for v in turn.output_versions[:1] + turn.output_versions[-1:]]
    meta = t.metadata
    return {
        "id": session.id,
        "status": session_status(session),
        "reason": t.reason[:200],
        "reward": t.reward,
        "turns": len(t.turns),
        "output_tokens": t.num_output_tokens,
        "context": max((len(x.prompt_ids) + len(x.output_ids) for x in t.turns), default=0),
        "forks": session.forks,
        "endpoints": sorted({x.endpoint for x in t.turns}),
        "agent": str(meta.get("agent") or meta.get("env") or "")[:100],
        "versions": [min(versions), max(versions)] if versions else None,
        "requests_in_flight": session.requests,
        "created_at": session.created_at,
    }


def _sort_key(name: str) -> Callable[[Session], Any]:
    if name == "reward":
        return lambda s: (s.trajectory.reward is not None, s.trajectory.reward or 0.0)
    if name == "turns":
        return lambda s: len(s.trajectory.turns)
    if name == "tokens":
        return lambda s: s.trajectory.num_output_tokens
    if name == "status":
        return session_status
    return lambda s: s.created_at


def page_of(
    items: list[Any], offset: int, limit: int, key: Callable[[Any], Any] | None, desc: bool
) -> list[Any]:
    """`items[offset:offset+limit]` in the order asked (`key` None: as given, newest last)."""
    if key is None:
        ordered = items[::-1] if desc else items
    else:
        ordered = sorted(items, key=key, reverse=desc)  # stable: ties keep creation order
    return ordered[offset : offset + limit]


# ---------------------------------------------------------------------------------------------
# The gateway's routes


def ui_routes(gw: Gateway) -> list[Route]:
    """The page, its assets and its JSON routes, on the gateway `gw`."""
    auth = gw.auth
    texts = TokenTexts(gw.renderer)

    def wrap(handler: Callable[[Request], Awaitable[Response]]) -> Any:
        return gw.endpoint("ui", handler)

    async def whoami(request: Request) -> Response:
        if auth.is_admin(request):
            return api_json({"kind": "gateway", "admin": True, "session": None})
        key = api_key(request)
        session = auth.sessions.by_key(key) if key else None
        if session is None:
            raise ApiError(
                401,
                "unknown token: use the admin token (gateway.serve prints it) or a session's key",
                code="invalid_api_key",
            )
        return api_json({"kind": "gateway", "admin": False, "session": session.id})

    async def sessions(request: Request) -> Response:
        auth.require_admin(request)
        offset = int_param(request, "offset", 0, 0, 10**9)
        limit = int_param(request, "limit", 50, 1, MAX_PAGE)
        status = choice_param(request, "status", ("all", "open", "ok", "aborted", "error"), "all")
        sort = request.query_params.get("sort") or "-created"
        desc, field = sort.startswith("-"), sort.removeprefix("-")
        if field not in SORT_KEYS:
            raise ApiError(
                400,
                f"sort must be one of {', '.join(SORT_KEYS)} (a leading - for descending)",
                param="sort",
            )
        q = (request.query_params.get("q") or "").strip().lower()
        everything = gw.sessions.all()
        counts: dict[str, int] = {}
        for s in everything:
            st = session_status(s)
            counts[st] = counts.get(st, 0) + 1
        chosen = everything
        if status != "all":
            chosen = [s for s in chosen if session_status(s) == status]
        if q:
            chosen = [
                s for s in chosen if q in s.id.lower() or q in str(s.trajectory.metadata).lower()
            ]
        key = None if field == "created" else _sort_key(field)
        rows = [session_row(s) for s in page_of(chosen, offset, limit, key, desc)]
        return api_json(
            {
                "total": len(chosen),
                "all": len(everything),
                "counts": counts,
                "offset": offset,
                "limit": limit,
                "rows": rows,
                "weight_version": gw.engine.weight_version,
            }
        )

    async def session(request: Request) -> Response:
        s = auth.readable(request, request.path_params["sid"])
        rev = session_rev(s)
        if request.query_params.get("since") == rev:
            return api_json({"rev": rev, "unchanged": True})
        traj = s.export()
        extra = {
            "rev": rev,
            "live": not s.closed,
            "requests_in_flight": s.requests,
            "created_at": s.created_at,
            "weight_version": gw.engine.weight_version,
        }
        # a snapshot: the session may grow while a worker thread builds the view
        snap = dataclasses.replace(
            traj, turns=list(traj.turns), info=dict(traj.info), metadata=dict(traj.metadata)
        )
        if sum(len(x.token_ids) for x in snap.segments) > OFFTHREAD_TOKENS:
            view = await asyncio.to_thread(trajectory_view, snap, texts, **extra)
        else:
            view = trajectory_view(snap, texts, **extra)
        view["status"] = session_status(s)
        return api_json(view)

    return [
        *shell_routes(wrap),
        Route("/ui/api/whoami", wrap(whoami), methods=["GET"]),
        Route("/ui/api/sessions", wrap(sessions), methods=["GET"]),
        Route("/ui/api/sessions/{sid}", wrap(session), methods=["GET"]),
    ]
