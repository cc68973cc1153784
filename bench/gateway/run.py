"""Gateway benchmark: added latency and throughput of the LoongSage gateway versus calling the
engine directly, side by side with LiteLLM's proxy versus its upstream, in one run; then a load
test of 64 concurrent sessions x 10 turns that checks every generated token is logged once.

Four servers, all on this machine:
- the fake SGLang server (`tests/fake_sglang.py`), a hash instead of a model: the "engine";
- the gateway, `python -m gateway.serve engine.kind=sglang engine.urls=[fake SGLang]`;
- a fake OpenAI upstream (`bench/gateway/fake_openai.py`), equally cheap (same Starlette +
  uvicorn + orjson stack, no model);
- LiteLLM's proxy (`litellm --config ...`) in front of the fake upstream, with every callback,
  telemetry and spend log off (there is no outside network).

For each concurrency (1, 16, 64) and mode (non-streaming, streaming), each target gets the same
chat request (16 output tokens) back to back for `--duration` seconds from a light HTTP/1.1
client (`loadgen.py`). Gateway requests use a fresh session id (open mode API key) each, like
one rollout per session; the direct engine call sends the very prompt ids the gateway renders.
Every request has the same messages, as the n first turns of a GRPO group do: the gateway
renders them once (its render memo); `--distinct` puts a different prompt in every request
(also LiteLLM's), for the cost of rendering and tokenizing each one.
Added latency = p50 through the proxy - p50 direct; throughput ratio = gateway req/s over
LiteLLM req/s at the same concurrency.

Besides latency and req/s, each line reports the CPU time the measured server process used per
request (and so req/s per core): on a shared machine that is the number noise moves least.

Run: `.venv/bin/python bench/gateway/run.py` (needs the `bench` extra: `pip install -e '.[bench]'`;
`--skip-litellm` runs without it). `--baseline DIR` also serves the gateway of another source
tree (e.g. `git archive REV | tar -x -C DIR`) and prints the current one's req/s against it, side
by side in the same run: how the cost of a change (such as request validation) is measured. `--gateway-launcher nodelay` serves the same gateway app from
uvicorn's own socket (see `serve_nodelay.py`: TCP_NODELAY). Numbers depend on the machine and
its load: every server and the client share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from fake_sglang import free_port  # noqa: E402
from loadgen import Connection, Result, run_load  # noqa: E402

MODEL = "tiny-random"
LITELLM_KEY = "sk-loongsage-bench-" + "0" * 32
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]


# ---------------------------------------------------------------------------------------------
# Processes


@contextlib.contextmanager
def process(
    name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: str | Path = ROOT
) -> Iterator[int]:
    log = open(tempfile.gettempdir() + f"/loongsage-bench-{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        yield proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its children so far."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.Error:
        pass
    return total


def wait_http(name: str, url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    log = Path(tempfile.gettempdir()) / f"loongsage-bench-{name}.log"
    raise RuntimeError(f"{name} did not come up at {url}; log: {log.read_text()[-2000:]}")


def litellm_config(upstream_port: int, folder: str) -> str:
    path = os.path.join(folder, "litellm.yaml")
    with open(path, "w") as f:
        f.write(
            f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: fake-upstream-key
litellm_settings:
  telemetry: false
  success_callback: []
  failure_callback: []
  callbacks: []
  turn_off_message_logging: true
general_settings:
  master_key: {LITELLM_KEY}
  disable_spend_logs: true
"""
        )
    return path


# ---------------------------------------------------------------------------------------------
# Requests


def chat_body(stream: bool, max_tokens: int, messages: list[dict] | None = None) -> bytes:
    body: dict = {
        "model": MODEL,
        "messages": messages or MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def messages(args, worker: int, n: int) -> list[dict] | None:
    """The chat request's messages: the same for every request (as a GRPO group's first turns,
    which the gateway renders once), or with `--distinct` a different one each time."""
    if not args.distinct:
        return None
    return [{"role": "user", "content": f"{MESSAGES[0]['content']} ({worker}.{n})"}]


def check_chat(stream: bool, max_tokens: int):
    """Every target must answer `max_tokens` tokens (its usage says so): a reply that ended
    early would be cheaper than the others'."""
    want = re.compile(rb'"completion_tokens":\s*%d\b' % max_tokens)

    def check(status: int, data: bytes) -> str | None:
        if status != 200:
            return f"HTTP {status}: {data[:200]!r}"
        if stream and not data.endswith(b"data: [DONE]\n\n"):
            return f"stream did not end with [DONE]: {data[-200:]!r}"
        if not stream and b'"choices"' not in data:
            return f"no choices: {data[:200]!r}"
        if not want.search(data):
            return f"not {max_tokens} completion tokens: {data[-300:]!r}"
        return None

    return check


def check_generate(stream: bool):
    def check(status: int, data: bytes) -> str | None:
        if status != 200:
            return f"HTTP {status}: {data[:200]!r}"
        if stream and not data.endswith(b"data: [DONE]\n\n"):
            return "stream did not end with [DONE]"
        if b'"finish_reason":{' not in data:
            return f"no finish_reason: {data[-200:]!r}"
        return None

    return check


JSON = {"Content-Type": "application/json"}


async def one_request(port: int, path: str, body: bytes | None, key: str) -> dict:
    conn = Connection("127.0.0.1", port)
    try:
        method = "POST" if body is not None else "GET"
        status, _, data = await conn.request(
            method, path, body or b"", {**JSON, "Authorization": f"Bearer {key}"}
        )
    finally:
        await conn.close()
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {data[:300]!r}")
    return orjson.loads(data)


# ---------------------------------------------------------------------------------------------
# Throughput and latency


async def measure(
    args, ports: dict[str, int], pids: dict[str, int], prompt_ids: list[int]
) -> list[dict]:
    rows = []
    run_id = int(time.time())
    for stream in (False, True):
        for c in args.concurrency:
            targets: dict[str, tuple] = {
                "sglang direct": (
                    ports["sglang"],
                    lambda w, n, s=stream: (
                        "POST",
                        "/generate",
                        orjson.dumps(
                            {
                                "input_ids": prompt_ids,
                                "sampling_params": {
                                    "max_new_tokens": args.max_tokens,
                                    "temperature": 0,
                                },
                                "return_logprob": True,
                                "stream": s,
                            }
                        ),
                        JSON,
                    ),
                    check_generate(stream),
                ),
                "gateway": (
                    ports["gateway"],
                    lambda w, n, s=stream, c=c: (
                        "POST",
                        "/v1/chat/completions",
                        chat_body(s, args.max_tokens, messages(args, w, n)),
                        {**JSON, "Authorization": f"Bearer b{run_id}-{int(s)}-{c}-{w}-{n}"},
                    ),
                    check_chat(stream, args.max_tokens),
                ),
            }
            if "baseline" in ports:
                targets["gw baseline"] = (ports["baseline"], *targets["gateway"][1:])
            if "litellm" in ports:
                targets["openai direct"] = (
                    ports["openai"],
                    lambda w, n, s=stream: (
                        "POST",
                        "/v1/chat/completions",
                        chat_body(s, args.max_tokens, messages(args, w, n)),
                        {**JSON, "Authorization": "Bearer fake-upstream-key"},
                    ),
                    check_chat(stream, args.max_tokens),
                )
                targets["litellm"] = (
                    ports["litellm"],
                    lambda w, n, s=stream: (
                        "POST",
                        "/v1/chat/completions",
                        chat_body(s, args.max_tokens, messages(args, w, n)),
                        {**JSON, "Authorization": f"Bearer {LITELLM_KEY}"},
                    ),
                    check_chat(stream, args.max_tokens),
                )
            server_of = {
                "sglang direct": "sglang",
                "gateway": "gateway",
                "gw baseline": "baseline",
                "openai direct": "openai",
                "litellm": "litellm",
            }
            for name, (port, make, check) in targets.items():
                pid = pids[server_of[name]]
                cpu0 = cpu_seconds(pid)
                result = await run_load("127.0.0.1", port, make, check, c, args.duration)
                # CPU of the measured server alone (not its upstream, not the client): the
                # noise-robust number on a shared machine, as req/s per core.
                cpu = cpu_seconds(pid) - cpu0
                rows.append(row(name, stream, c, result, cpu))
                print(format_row(rows[-1]), flush=True)
    return rows


def row(name: str, stream: bool, c: int, r: Result, cpu_s: float) -> dict:
    n = len(r.latencies) + r.errors
    return {
        "cpu_ms_per_request": cpu_s / n * 1e3 if n else float("nan"),
        "rps_per_core": n / cpu_s if cpu_s > 0 else float("nan"),
        "target": name,
        "stream": stream,
        "concurrency": c,
        "requests": len(r.latencies),
        "errors": r.errors,
        "error_samples": r.error_samples,
        "rps": r.rps,
        "p50_ms": r.pct(0.5) * 1e3,
        "p99_ms": r.pct(0.99) * 1e3,
        "ttfb_p50_ms": r.pct(0.5, "first_bytes") * 1e3,
    }


def format_row(r: dict) -> str:
    mode = "stream" if r["stream"] else "plain"
    text = (
        f"{r['target']:<14} {mode:<6} c={r['concurrency']:<3} {r['rps']:>8.0f} req/s  "
        f"p50 {r['p50_ms']:>7.2f} ms  p99 {r['p99_ms']:>7.2f} ms  "
        f"ttfb p50 {r['ttfb_p50_ms']:>7.2f} ms  cpu {r['cpu_ms_per_request']:>6.2f} ms/req "
        f"({r['rps_per_core']:>6.0f} req/s/core)  n={r['requests']:<6} errors={r['errors']}"
    )
    if r["error_samples"]:
        text += f"  e.g. {r['error_samples'][0]}"
    return text


def ratios(rows: list[dict]) -> list[str]:
    """One line per (mode, concurrency): added p50 latency of each proxy over its direct call,
    req/s, and req/s per core of CPU the proxy process itself used."""
    by = {(r["target"], r["stream"], r["concurrency"]): r for r in rows}

    def f(value: float | None, fmt: str, width: int) -> str:
        return f"{value:{fmt}}".rjust(width) if value is not None else "-".rjust(width)

    lines = [
        "mode   conc | added p50 ms: gateway litellm | req/s: gateway litellm ratio "
        "| req/s per core: gateway litellm ratio",
        "-" * 110,
    ]
    for stream in (False, True):
        for c in sorted({r["concurrency"] for r in rows}):
            gw, direct = by.get(("gateway", stream, c)), by.get(("sglang direct", stream, c))
            ll, up = by.get(("litellm", stream, c)), by.get(("openai direct", stream, c))
            if not (gw and direct):
                continue
            ll_added = ll["p50_ms"] - up["p50_ms"] if ll and up else None
            ratio = gw["rps"] / ll["rps"] if ll and ll["rps"] else None
            core_ratio = gw["rps_per_core"] / ll["rps_per_core"] if ll else None
            lines.append(
                f"{'stream' if stream else 'plain':<6} {c:>4} | "
                f"{f(gw['p50_ms'] - direct['p50_ms'], '.2f', 21)} {f(ll_added, '.2f', 7)} | "
                f"{f(gw['rps'], '.0f', 14)} {f(ll['rps'] if ll else None, '.0f', 7)} "
                f"{f(ratio, '.1f', 5)}x | "
                f"{f(gw['rps_per_core'], '.0f', 23)} {f(ll['rps_per_core'] if ll else None, '.0f', 7)}"
                f" {f(core_ratio, '.1f', 5)}x"
            )
    if any(r["target"] == "gw baseline" for r in rows):
        lines += ["", "gateway vs the baseline tree (--baseline): req/s and req/s per core"]
        for r in rows:
            base = by.get(("gw baseline", r["stream"], r["concurrency"]))
            if r["target"] == "gateway" and base:
                lines.append(
                    f"{'stream' if r['stream'] else 'plain':<6} {r['concurrency']:>4} | "
                    f"{r['rps']:>7.0f} vs {base['rps']:>7.0f} ({r['rps'] / base['rps']:.2f}x) | "
                    f"{r['rps_per_core']:>7.0f} vs {base['rps_per_core']:>7.0f} "
                    f"({r['rps_per_core'] / base['rps_per_core']:.2f}x)"
                )
    return lines


# ---------------------------------------------------------------------------------------------
# Load test: 64 sessions x 10 turns, every token logged exactly once


async def load_test(args, ports: dict[str, int]) -> dict:
    gw, engine = ports["gateway"], ports["sglang"]
    before = (await one_request(engine, "/get_server_info", None, "-"))["generated_tokens"]
    run_id = int(time.time())
    latencies: list[float] = []
    errors: list[str] = []
    usage_tokens: dict[str, int] = {}

    async def session(i: int) -> None:
        key = f"load-{run_id}-{i}"
        conn = Connection("127.0.0.1", gw)
        messages: list[dict] = []
        usage_tokens[key] = 0
        try:
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"Turn {turn}: go on, session {i}."})
                stream = turn % 2 == 1  # alternate, so both paths are in the log
                start = time.perf_counter()
                status, _, data = await conn.request(
                    "POST",
                    "/v1/chat/completions",
                    chat_body(stream, args.max_tokens, messages),
                    {**JSON, "Authorization": f"Bearer {key}"},
                )
                if status != 200:
                    errors.append(f"{key} turn {turn}: HTTP {status} {data[:200]!r}")
                    return
                latencies.append(time.perf_counter() - start)
                content, tokens = read_chat(data, stream)
                usage_tokens[key] += tokens
                messages.append({"role": "assistant", "content": content})
        except Exception as exc:  # a broken session is an error to report, not a crash
            errors.append(f"{key}: {exc!r}")
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(args.sessions)))
    wall = time.perf_counter() - started
    after = (await one_request(engine, "/get_server_info", None, "-"))["generated_tokens"]

    logged = 0
    problems: list[str] = []
    forks = 0
    for key, tokens in usage_tokens.items():
        traj = await one_request(gw, f"/sessions/{key}/trajectory", None, key)
        outputs = [t for turn in traj["turns"] for t in turn["output_ids"]]
        sampled = [
            t
            for seg in traj["segments"]
            for t, m in zip(seg["token_ids"], seg["loss_mask"], strict=True)
            if m == 1
        ]
        logged += len(outputs)
        forks += traj.get("forks", 0)
        if len(traj["turns"]) != args.turns:
            problems.append(f"{key}: {len(traj['turns'])} turns logged")
        if len(outputs) != tokens:
            problems.append(f"{key}: usage says {tokens} tokens, turns hold {len(outputs)}")
        if sorted(sampled) != sorted(outputs) or len(sampled) != len(outputs):
            problems.append(f"{key}: segments' sampled tokens differ from the turns' outputs")
    latencies.sort()
    return {
        "sessions": args.sessions,
        "turns": args.turns,
        "requests": len(latencies),
        "errors": len(errors),
        "error_samples": errors[:3],
        "engine_generated_tokens": after - before,
        "logged_output_tokens": logged,
        "usage_tokens": sum(usage_tokens.values()),
        "segment_forks": forks,
        "problems": problems[:5],
        "wall_s": wall,
        "p50_ms": latencies[len(latencies) // 2] * 1e3 if latencies else float("nan"),
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3
        if latencies
        else float("nan"),
    }


def read_chat(data: bytes, stream: bool) -> tuple[str, int]:
    """(assistant content, completion tokens from usage) of a chat answer or SSE stream."""
    if not stream:
        answer = orjson.loads(data)
        return answer["choices"][0]["message"]["content"] or "", answer["usage"][
            "completion_tokens"
        ]
    content, tokens = [], None
    for line in data.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = orjson.loads(line[6:])
        for choice in event.get("choices") or []:
            content.append((choice.get("delta") or {}).get("content") or "")
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    if tokens is None:
        raise ValueError("stream had no usage chunk")
    return "".join(content), tokens


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=64, help="load test sessions")
    parser.add_argument("--turns", type=int, default=10, help="load test turns per session")
    parser.add_argument(
        "--gateway-launcher",
        choices=["serve", "nodelay"],
        default="serve",
        help="serve: python -m gateway.serve; nodelay: the same app on uvicorn's own socket "
        "(TCP_NODELAY; see serve_nodelay.py)",
    )
    parser.add_argument(
        "--baseline",
        help="also serve the gateway from this source tree (e.g. `git archive REV | tar -x`) "
        "and print the current gateway's req/s against it, side by side",
    )
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="a different prompt in every proxied request (no render is reused by the gateway)",
    )
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--skip-load-test", action="store_true")
    parser.add_argument("--out", help="write all numbers as JSON here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    use_litellm = not args.skip_litellm
    litellm = shutil.which("litellm", path=str(Path(sys.executable).parent)) or shutil.which(
        "litellm"
    )
    if use_litellm and litellm is None:
        sys.exit("litellm is not installed: pip install -e '.[bench]' (or pass --skip-litellm)")

    ports = {"sglang": free_port(), "gateway": free_port()}
    if args.baseline:
        ports["baseline"] = free_port()
    if use_litellm:
        ports |= {"openai": free_port(), "litellm": free_port()}
    py = sys.executable
    env = dict(os.environ)
    # LiteLLM: local cost map (no download), no telemetry, no UI/docs; there is no network.
    env |= {
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_TELEMETRY": "False",
        "LITELLM_LOG": "ERROR",
        "NO_DOCS": "True",
        "DISABLE_ADMIN_UI": "True",
    }
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        pids: dict[str, int] = {}
        pids["sglang"] = stack.enter_context(
            process(
                "fake-sglang",
                # no EOS: every reply is --max-tokens long, as the fake OpenAI upstream's are
                [py, "tests/fake_sglang.py", "--port", str(ports["sglang"]), "--eos-every", "0"],
            )
        )
        pids["gateway"] = stack.enter_context(
            process(
                "gateway",
                [
                    py,
                    *(
                        ["-m", "gateway.serve"]
                        if args.gateway_launcher == "serve"
                        else [str(HERE / "serve_nodelay.py")]
                    ),
                    "engine.kind=sglang",
                    f"engine.urls=[http://127.0.0.1:{ports['sglang']}]",
                    f"model={MODEL}",
                    "auth=open",
                    f"port={ports['gateway']}",
                ],
            )
        )
        if args.baseline:
            pids["baseline"] = stack.enter_context(
                process(
                    "gateway-baseline",
                    [
                        py,
                        "-m",
                        "gateway.serve",
                        "engine.kind=sglang",
                        f"engine.urls=[http://127.0.0.1:{ports['sglang']}]",
                        f"model={MODEL}",
                        "auth=open",
                        f"port={ports['baseline']}",
                    ],  # fmt: skip
                    env={**env, "PYTHONPATH": str(Path(args.baseline).resolve())},
                    cwd=args.baseline,
                )
            )
        if use_litellm:
            pids["openai"] = stack.enter_context(
                process(
                    "fake-openai",
                    [py, str(HERE / "fake_openai.py"), "--port", str(ports["openai"])],
                )
            )
            pids["litellm"] = stack.enter_context(
                process(
                    "litellm",
                    [
                        litellm,
                        "--config",
                        litellm_config(ports["openai"], folder),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(ports["litellm"]),
                        "--num_workers",
                        "1",
                    ],
                    env=env,
                )
            )
        wait_http("fake-sglang", f"http://127.0.0.1:{ports['sglang']}/health")
        wait_http("gateway", f"http://127.0.0.1:{ports['gateway']}/health")
        if args.baseline:
            wait_http("gateway-baseline", f"http://127.0.0.1:{ports['baseline']}/health")
        if use_litellm:
            wait_http("fake-openai", f"http://127.0.0.1:{ports['openai']}/health")
            wait_http("litellm", f"http://127.0.0.1:{ports['litellm']}/health/liveliness")
        print(f"servers up: {ports}", flush=True)
        results = asyncio.run(run_all(args, ports, pids))
    print()
    print("=== side by side (p50 added over the direct call; req/s ratios) ===")
    for line in ratios(results["rows"]):
        print(line)
    if results.get("load"):
        load = results["load"]
        print()
        print("=== load test: gateway, concurrent sessions x turns ===")
        print(
            f"{load['sessions']} sessions x {load['turns']} turns: {load['requests']} requests, "
            f"{load['errors']} errors, p50 {load['p50_ms']:.2f} ms, p99 {load['p99_ms']:.2f} ms, "
            f"{load['wall_s']:.1f} s"
        )
        print(
            f"tokens: engine generated {load['engine_generated_tokens']}, trajectories hold "
            f"{load['logged_output_tokens']}, usage reported {load['usage_tokens']}; "
            f"segment forks {load['segment_forks']}; problems: {load['problems'] or 'none'}"
        )
        if load["error_samples"]:
            print("errors, e.g.:", load["error_samples"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


async def run_all(args, ports: dict[str, int], pids: dict[str, int]) -> dict:
    # The exact prompt ids the gateway renders for MESSAGES, for the direct engine calls.
    probe = f"probe-{int(time.time())}"
    await one_request(ports["gateway"], "/v1/chat/completions", chat_body(False, 1), probe)
    traj = await one_request(ports["gateway"], f"/sessions/{probe}/trajectory", None, probe)
    prompt_ids = traj["turns"][0]["prompt_ids"]
    rows = await measure(args, ports, pids, prompt_ids)
    load = None if args.skip_load_test else await load_test(args, ports)
    return {"rows": rows, "load": load, "prompt_tokens": len(prompt_ids)}


if __name__ == "__main__":
    main()
