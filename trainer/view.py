"""`python -m trainer.view runs/<dir>`: a run in the browser.

Shows the run's plots, its metrics over steps (a small chart per metric, filtered by name, and a
table), and the trajectories of `samples.jsonl`, browsable by step, reward and status and shown
token by token with the gateway's viewer (`gateway.server.ui`: the same page and the same
trajectory view), two side by side to compare what the model did at step 0 and at step 20. The
files are re-read when they grow, so a run in progress can be watched; samples.jsonl is indexed
by byte offset and a sample is parsed only when opened.

Like the gateway's page it needs a token, random unless `--token` is given, and prints the URL
to open with it in the fragment (`http://127.0.0.1:8765/ui#token=...`): the machine may have
other users, and a run's samples are its data. Token texts come from the run's tokenizer
(`config.yaml`'s `model.name`, or `--model`); without one, tokens read as their ids.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.server.http import HttpServer, error_response
from gateway.server.ui import (
    MAX_PAGE,
    TokenTexts,
    api_json,
    int_param,
    page_of,
    require_token,
    shell_routes,
    trajectory_view,
)
from gateway.server.validation import ApiError
from trainer.metrics import METRICS_FILE, read_metrics, sample_trajectory

SAMPLE_SORTS = ("step", "-step", "reward", "-reward")


class RunFiles:
    """The files of one run directory, re-read when they change (thread-safe)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        self._lock = threading.Lock()
        self._samples: list[dict[str, Any]] = []
        """One row per samples.jsonl line: its byte offset and what the list shows."""
        self._indexed = 0
        self._metrics: list[dict[str, Any]] = []
        self._metrics_stamp: tuple[int, int] | None = None

    @property
    def samples_path(self) -> Path:
        return self.dir / "samples.jsonl"

    def config(self) -> tuple[str, dict[str, Any]]:
        path = self.dir / "config.yaml"
        if not path.is_file():
            return "", {}
        text = path.read_text()
        data = yaml.safe_load(text)
        return text, data if isinstance(data, dict) else {}

    def metrics(self) -> list[dict[str, Any]]:
        path = self.dir / METRICS_FILE
        with self._lock:
            stamp = (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None
            if stamp != self._metrics_stamp:
                self._metrics, self._metrics_stamp = read_metrics(path), stamp
            return self._metrics

    def plots(self) -> list[str]:
        return sorted(p.name for p in (self.dir / "plots").glob("*.png"))

    def samples(self) -> list[dict[str, Any]]:
        """The index, extended by the lines appended since the last call (rebuilt when the file
        shrank: a resumed run rewrites it)."""
        path = self.samples_path
        with self._lock:
            size = path.stat().st_size if path.is_file() else 0
            if size < self._indexed:
                self._samples, self._indexed = [], 0
            if size > self._indexed:
                with open(path, "rb") as f:
                    f.seek(self._indexed)
                    for line in f:
                        if not line.endswith(b"\n"):
                            break  # being written
                        offset, self._indexed = self._indexed, self._indexed + len(line)
                        with contextlib.suppress(orjson.JSONDecodeError):
                            self._samples.append(_index_row(len(self._samples), offset, line))
            return self._samples

    def sample(self, index: int) -> dict[str, Any]:
        rows = self.samples()
        if not 0 <= index < len(rows):
            raise ApiError(404, f"no sample {index}; this run has {len(rows)}", code="not_found")
        with open(self.samples_path, "rb") as f:
            f.seek(rows[index]["offset"])
            return orjson.loads(f.readline())


def _index_row(index: int, offset: int, line: bytes) -> dict[str, Any]:
    rec = orjson.loads(line)
    segments = rec.get("segments") or []
    return {
        "index": index,
        "offset": offset,
        "step": rec["step"],
        "id": rec.get("id"),
        "reward": rec.get("reward"),
        "status": rec.get("status", "ok"),
        "reason": (rec.get("reason") or "")[:200],
        "turns": len(rec.get("turns") or []),
        "tokens": sum(len(s["token_ids"]) for s in segments),
        "trained": sum(b - a for s in segments for a, b in s["sampled"]),
        "versions": rec.get("versions") or [],
    }


def _tokenizer(model: str | None) -> TokenTexts:
    if not model:
        return TokenTexts(None)
    try:
        from gateway.models import resolve_model
        from gateway.render import load_renderer

        return TokenTexts(load_renderer(resolve_model(model)))
    except Exception as e:  # the model may not be on this machine any more
        print(f"[loongsage] tokens will read as ids: no tokenizer for {model!r} ({e})")
        return TokenTexts(None)


def make_app(run_dir: Path, token: str, texts: TokenTexts) -> Starlette:
    """The viewer's app: the gateway's page (`shell_routes`) and the run's JSON."""
    files = RunFiles(run_dir)

    def wrap(handler: Callable[[Request], Awaitable[Response]]) -> Any:
        async def wrapped(request: Request) -> Response:
            try:
                if request.url.path.startswith("/ui/api/"):
                    require_token(request, token)
                return await handler(request)
            except ApiError as e:
                return error_response(e)

        return wrapped

    async def whoami(request: Request) -> Response:
        return api_json({"kind": "run", "admin": True, "title": files.dir.name})

    async def run(request: Request) -> Response:
        config_text, config = await asyncio.to_thread(files.config)
        rows = await asyncio.to_thread(files.metrics)
        samples = await asyncio.to_thread(files.samples)
        keys = sorted({k for r in rows for k in r if k not in ("step", "time_s")})
        section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}  # noqa: E731
        summary = {
            "model": section("model").get("name", "?"),
            "env": section("rollout").get("env", "?"),
            "agent": section("agent").get("kind", "?"),
            "steps logged": rows[-1]["step"] if rows else 0,
            "samples": len(samples),
        }
        return api_json(
            {
                "name": files.dir.name,
                "dir": str(files.dir),
                "config": config_text,
                "summary": summary,
                "metrics": {"keys": keys, "rows": rows},
                "plots": files.plots(),
                "steps": sorted({s["step"] for s in samples}),
            }
        )

    async def samples(request: Request) -> Response:
        rows = await asyncio.to_thread(files.samples)
        offset = int_param(request, "offset", 0, 0, 10**9)
        limit = int_param(request, "limit", 50, 1, MAX_PAGE)
        sort = request.query_params.get("sort") or "step"
        if sort not in SAMPLE_SORTS:
            raise ApiError(400, f"sort must be one of {', '.join(SAMPLE_SORTS)}", param="sort")
        chosen = rows
        if request.query_params.get("step"):
            step = int_param(request, "step", 0, 0, 10**9)
            chosen = [r for r in chosen if r["step"] == step]
        if status := request.query_params.get("status"):
            chosen = [r for r in chosen if r["status"] == status]
        if raw := request.query_params.get("min_reward"):
            try:
                least = float(raw)
            except ValueError:
                raise ApiError(400, "min_reward must be a number", param="min_reward") from None
            chosen = [r for r in chosen if r["reward"] is not None and r["reward"] >= least]
        field = sort.removeprefix("-")
        if field == "reward":
            key = lambda r: (r["reward"] is not None, r["reward"] or 0.0)  # noqa: E731
        else:
            key = lambda r: (r["step"], r["index"])  # noqa: E731
        page = page_of(chosen, offset, limit, key, sort.startswith("-"))
        strip = [{k: v for k, v in r.items() if k != "offset"} for r in page]
        return api_json({"total": len(chosen), "offset": offset, "limit": limit, "rows": strip})

    def sample_view(index: int) -> dict[str, Any]:
        rec = files.sample(index)
        traj, layout = sample_trajectory(rec)
        view = trajectory_view(traj, texts, layout, step=rec["step"], index=index)
        if not traj.segments:  # written before samples kept token ids
            view["text"] = rec.get("text") or " ".join(map(str, rec.get("token_ids") or []))
        return view

    async def sample(request: Request) -> Response:
        raw = request.path_params["index"]
        if not raw.isdigit():
            raise ApiError(400, f"a sample is named by its index, got {raw[:50]!r}", param="index")
        return api_json(await asyncio.to_thread(sample_view, int(raw)))

    async def plot(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files.plots():
            raise ApiError(404, f"no plot {name[:100]!r}", code="not_found")
        body = await asyncio.to_thread((files.dir / "plots" / name).read_bytes)
        return Response(body, media_type="image/png", headers={"Cache-Control": "no-store"})

    return Starlette(
        routes=[
            *shell_routes(wrap),
            Route("/ui/api/whoami", wrap(whoami), methods=["GET"]),
            Route("/ui/api/run", wrap(run), methods=["GET"]),
            Route("/ui/api/samples", wrap(samples), methods=["GET"]),
            Route("/ui/api/samples/{index}", wrap(sample), methods=["GET"]),
            Route("/ui/api/plots/{name}", wrap(plot), methods=["GET"]),
        ]
    )


def run_model(run_dir: Path) -> str | None:
    """The model a run trained (its config.yaml's model.name), if it says."""
    _, config = RunFiles(run_dir).config()
    model = config.get("model")
    return model.get("name") if isinstance(model, dict) else None


async def serve(run_dir: Path, host: str, port: int, token: str, model: str | None) -> None:
    texts = await asyncio.to_thread(_tokenizer, model or run_model(run_dir))
    server = HttpServer(make_app(run_dir, token, texts), host, port, None)
    await server.start()
    print(f"[loongsage] run viewer for {run_dir}: {server.base_url}/ui#token={token}", flush=True)
    try:
        await server.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.view", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dir", type=Path, help="a run directory (runs/<name>)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8765, help="port (0: a free one)")
    parser.add_argument("--token", default=None, help="the page's token (default: a random one)")
    parser.add_argument(
        "--model", default=None, help="tokenizer to decode with (default: the run's)"
    )
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise SystemExit(f"trainer.view: {args.run_dir} is not a directory")
    token = args.token or secrets.token_urlsafe(24)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.run_dir, args.host, args.port, token, args.model))


if __name__ == "__main__":
    main(sys.argv[1:])
