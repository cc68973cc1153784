"""The UI's server side without a browser: token texts, the trajectory view of a real multi-turn
tool-calling session (with a weight swap in the middle), auth, paging 10,000 sessions, the page's
assets, samples.jsonl round trips and `trainer.view`'s JSON. The browser itself:
test_ui_browser.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from ui_helpers import make_run_dir, perturbed_norm, tool_agent

from gateway.server import Gateway, GatewayConfig
from gateway.server.auth import open_session_id
from gateway.server.ui import TokenTexts, trajectory_view
from gateway.trajectory import Segment, Trajectory
from trainer.metrics import SamplesLog, pack_segment, sample_trajectory
from trainer.view import make_app

ADMIN = "adm-test-token"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def gateway(engine, renderer, tiny_model_path):
    gw = Gateway(
        engine, tiny_model_path, GatewayConfig(auth="keys", admin_token=ADMIN), renderer=renderer
    )
    yield gw
    await gw.aclose()


def http(gw: Gateway, token: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app), base_url="http://gw", headers=headers
    )


def version_changes(traj: Trajectory) -> int:
    n = 0
    for seg in traj.segments:
        sampled = [v for v, m in zip(seg.versions, seg.loss_mask, strict=True) if m]
        n += sum(a != b for a, b in zip(sampled, sampled[1:], strict=False))
    return n


def test_token_texts_join_to_the_decoded_text(renderer):
    texts = TokenTexts(renderer)
    eos = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    parts = ["Plain ASCII, then emoji 🐉🐲 and CJK 龍の字 ", "\n\n  spaced   out\tend"]
    ids = renderer.encode(parts[0]) + [eos] + renderer.encode(parts[1])
    got, specials = texts(ids)
    assert len(got) == len(ids) and specials == [ids.index(eos)]
    assert got[specials[0]] == "<|im_end|>"
    plain = [t for i, t in enumerate(got) if i not in specials]
    assert "".join(plain) == renderer.decode(ids) == "".join(parts)
    # a character split over several byte-level tokens goes to the token that completes it
    dragon = renderer.encode("🐉")
    assert len(dragon) > 1 and texts(dragon)[0] == [""] * (len(dragon) - 1) + ["🐉"]
    assert TokenTexts(None)([5, 7]) == (["\u27e85\u27e9", "\u27e87\u27e9"], [])


async def test_session_view_is_the_trajectory_token_by_token(gateway, tiny_model_path):
    sid, key = gateway.create_session({"agent": "scripted"})

    async def swap(i: int) -> None:
        if i == 0:
            await gateway.update_weights(perturbed_norm(tiny_model_path), version=1)

    calls, results = await tool_agent(gateway.openai_client(key), "tiny-random", 3, after_turn=swap)
    gateway.attach_reward(sid, 0.25)
    traj = await gateway.close_session(sid, "aborted", "verifier: <b>timeout</b>")
    async with http(gateway, ADMIN) as client:
        view = (await client.get(f"/ui/api/sessions/{sid}")).json()
    assert view["status"] == "aborted" and view["reason"] == "verifier: <b>timeout</b>"
    assert view["reward"] == 0.25 and view["metadata"] == {"agent": "scripted"}
    stats = view["stats"]
    assert stats["trained"] == sum(sum(s.loss_mask) for s in traj.segments) > 0
    assert stats["tokens"] == sum(len(s.token_ids) for s in traj.segments)
    assert stats["versions"] == [0, 1] and stats["version_changes"] == version_changes(traj) == 1
    for got, seg in zip(view["segments"], traj.segments, strict=True):
        assert got["ids"] == seg.token_ids and got["mask"] == seg.loss_mask
        assert got["ver"] == seg.versions
        assert got["lp"] == pytest.approx(seg.logprobs, abs=1e-4)
        plain = "".join(t for i, t in enumerate(got["text"]) if i not in set(got["special"]))
        assert plain == gateway.renderer.decode(seg.token_ids)
    # every turn is placed where its output is, with what the agent got and sent
    assert len(view["turns"]) == 3
    for t, turn in zip(view["turns"], traj.turns, strict=True):
        seg = view["segments"][t["segment"]]
        assert seg["ids"][t["start"] : t["end"]] == turn.output_ids
        assert set(seg["mask"][t["start"] : t["end"]]) == {1}
    got_calls = [c for t in view["turns"] for c in t["tool_calls"]]
    assert [(c["name"], c["arguments"]) for c in got_calls] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert [r for t in view["turns"] for r in t["tool_results"]] == results


async def test_a_live_session_answers_unchanged_until_it_changes(gateway):
    sid, key = gateway.create_session()
    await tool_agent(gateway.openai_client(key), "tiny-random", 1)
    async with http(gateway, ADMIN) as client:
        first = (await client.get(f"/ui/api/sessions/{sid}")).json()
        assert first["live"] and first["status"] == "open" and first["stats"]["turns"] == 1
        same = (await client.get(f"/ui/api/sessions/{sid}", params={"since": first["rev"]})).json()
        assert same == {"rev": first["rev"], "unchanged": True}
        gateway.attach_reward(sid, 1.0)
        changed = (
            await client.get(f"/ui/api/sessions/{sid}", params={"since": first["rev"]})
        ).json()
        assert changed["reward"] == 1.0 and changed["rev"] != first["rev"]
        await gateway.close_session(sid)
        closed = (
            await client.get(f"/ui/api/sessions/{sid}", params={"since": changed["rev"]})
        ).json()
        assert closed["status"] == "ok" and not closed["live"]


async def test_auth_keys_mode(gateway):
    a, key_a = gateway.create_session()
    b, key_b = gateway.create_session()
    async with http(gateway) as anon, http(gateway, key_a) as owner, http(gateway, ADMIN) as admin:
        for client in (anon, owner):
            r = await client.get("/ui/api/sessions")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert (await admin.get("/ui/api/sessions")).json()["total"] == 2
        assert (await owner.get(f"/ui/api/sessions/{a}")).status_code == 200
        for client in (anon, owner):  # another's session and a missing one look the same
            assert (await client.get(f"/ui/api/sessions/{b}")).status_code == 404
            assert (await client.get("/ui/api/sessions/nope")).status_code == 404
        assert (await admin.get(f"/ui/api/sessions/{b}")).status_code == 200
        assert (await owner.get("/ui/api/whoami")).json() == {
            "kind": "gateway",
            "admin": False,
            "session": a,
        }
        assert (await admin.get("/ui/api/whoami")).json()["admin"] is True
        assert (await anon.get("/ui/api/whoami")).status_code == 401
        assert (await http(gateway, "sk-guess").get("/ui/api/whoami")).status_code == 401


async def test_auth_open_mode(engine, renderer, tiny_model_path):
    gw = Gateway(engine, tiny_model_path, GatewayConfig(admin_token=ADMIN), renderer=renderer)
    try:
        for key in ("alice-key", "bob-key"):
            await tool_agent(gw.openai_client(key), "tiny-random", 1)
        alice, bob = open_session_id("alice-key"), open_session_id("bob-key")
        async with http(gw, "alice-key") as client:
            assert (await client.get(f"/ui/api/sessions/{alice}")).json()["stats"]["turns"] == 1
            assert (await client.get(f"/ui/api/sessions/{bob}")).status_code == 404
            assert (await client.get("/ui/api/sessions")).status_code == 401
            assert (await client.get("/ui/api/whoami")).json()["session"] == alice
        async with http(gw, ADMIN) as client:
            ids = {r["id"] for r in (await client.get("/ui/api/sessions")).json()["rows"]}
            assert ids == {alice, bob}  # ids, never keys
    finally:
        await gw.aclose()


async def test_the_list_pages_10000_sessions(gateway):
    n = 10_000
    for i in range(n):
        sid, _ = gateway.create_session({"env": f"env-{i % 7}"}, session_id=f"task-{i:05d}")
        if i % 3 == 0:
            gateway.attach_reward(sid, i / n)
        if i % 10 == 0:
            await gateway.close_session(sid, "aborted" if i % 20 == 0 else "ok", "why")
    async with http(gateway, ADMIN) as client:
        start = time.perf_counter()
        first = (await client.get("/ui/api/sessions")).json()
        took = time.perf_counter() - start
        assert first["total"] == first["all"] == n and len(first["rows"]) == 50
        assert [r["id"] for r in first["rows"][:2]] == ["task-09999", "task-09998"]
        assert first["counts"] == {"open": n - n // 10, "ok": n // 20, "aborted": n // 20}
        page = (await client.get("/ui/api/sessions", params={"offset": 9990, "limit": 50})).json()
        assert [r["id"] for r in page["rows"]] == [f"task-{i:05d}" for i in range(9, -1, -1)]
        start = time.perf_counter()
        best = (await client.get("/ui/api/sessions", params={"sort": "-reward", "limit": 3})).json()
        took_sorted = time.perf_counter() - start
        assert [r["id"] for r in best["rows"]] == ["task-09999", "task-09996", "task-09993"]
        aborted = (await client.get("/ui/api/sessions", params={"status": "aborted"})).json()
        assert aborted["total"] == n // 20 and {r["status"] for r in aborted["rows"]} == {"aborted"}
        found = (await client.get("/ui/api/sessions", params={"q": "env-3", "limit": 500})).json()
        assert found["total"] == len([i for i in range(n) if i % 7 == 3])
    print(
        f"\nlist of {n} sessions: first page {took * 1e3:.1f} ms, sorted by reward {took_sorted * 1e3:.1f} ms"
    )


async def test_bad_list_parameters_are_400_naming_the_parameter(gateway):
    async with http(gateway, ADMIN) as client:
        for params, name in [
            ({"limit": "0"}, "limit"),
            ({"limit": "x"}, "limit"),
            ({"offset": "-1"}, "offset"),
            ({"sort": "bogus"}, "sort"),
            ({"status": "done"}, "status"),
        ]:
            r = await client.get("/ui/api/sessions", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, params


async def test_the_page_and_its_assets(gateway):
    async with http(gateway) as client:
        page = await client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert '<script src="/ui/static/ui.js" defer></script>' in page.text
        js = await client.get("/ui/static/ui.js")
        assert js.headers["content-type"].startswith("text/javascript")
        assert "innerHTML" not in js.text.split("*/", 1)[1]  # data only ever becomes text nodes
        for path in ("/ui/static/nope.js", "/ui/static/..%2Fui.py", "/ui/static/ui.py"):
            assert (await client.get(path)).status_code == 404, path


async def test_samples_jsonl_round_trip(gateway, tiny_model_path, tmp_path):
    sid, key = gateway.create_session({"env": "Lookup-v0"})

    async def swap(i: int) -> None:
        await gateway.update_weights(perturbed_norm(tiny_model_path, 1 + i), version=i + 1)

    await tool_agent(gateway.openai_client(key), "tiny-random", 3, after_turn=swap)
    gateway.attach_reward(sid, 0.5)
    traj = await gateway.close_session(sid)
    log = SamplesLog(tmp_path, 1, gateway.renderer.decode)
    log.write(7, [traj])
    (line,) = (tmp_path / "samples.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["text"] == gateway.renderer.decode(traj.segments[0].token_ids)
    back, layout = sample_trajectory(record)
    assert back.session_id == sid and back.reward == 0.5 and back.metadata == traj.metadata
    for a, b in zip(back.segments, traj.segments, strict=True):
        assert (a.token_ids, a.loss_mask, a.versions) == (b.token_ids, b.loss_mask, b.versions)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    texts = TokenTexts(gateway.renderer)
    assert trajectory_view(back, texts, layout)["turns"] == trajectory_view(traj, texts)["turns"]
    full = len(json.dumps([s.__dict__ for s in traj.segments]))
    packed = len(json.dumps([pack_segment(s) for s in traj.segments]))
    print(f"\nsamples.jsonl segments: {packed} bytes packed vs {full} as plain lists")
    assert packed < full


def synthetic_trajectory(sid: str, reward: float, status: str = "ok") -> Trajectory:
    seg = Segment(
        [1, 2, 3, 4, 5, 6],
        [0, 0, 1, 1, 0, 1],
        [0.0, 0.0, -0.5, -1.5, 0.0, -0.1],
        [-1, -1, 0, 0, -1, 1],
    )
    return Trajectory(sid, status, "" if status == "ok" else "crashed", reward, segments=[seg])


async def test_run_viewer_api(tmp_path):
    trajs = {
        0: [synthetic_trajectory("a", 0.0), synthetic_trajectory("b", 1.0, "aborted")],
        20: [synthetic_trajectory("c", 1.0)],
    }
    make_run_dir(tmp_path, trajs)
    app = make_app(tmp_path, "view-token", TokenTexts(None))

    def client(token=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://v", headers=headers
        )

    async with client() as anon, client("view-token") as c:
        assert (await anon.get("/ui")).status_code == 200  # the shell holds no data
        for path in (
            "/ui/api/whoami",
            "/ui/api/run",
            "/ui/api/samples",
            "/ui/api/samples/0",
            "/ui/api/plots/reward.png",
        ):
            assert (await anon.get(path)).status_code == 401, path
        run = (await c.get("/ui/api/run")).json()
        assert run["plots"] == ["mismatch.png", "reward.png", "timeline.png"] and run["steps"] == [
            0,
            20,
        ]
        assert len(run["metrics"]["rows"]) == 21 and "reward/mean" in run["metrics"]["keys"]
        assert run["summary"]["model"] == "tiny" and run["summary"]["samples"] == 3
        rows = (await c.get("/ui/api/samples", params={"step": 20})).json()["rows"]
        assert [r["id"] for r in rows] == ["c"] and rows[0]["trained"] == 3
        rows = (await c.get("/ui/api/samples", params={"status": "aborted"})).json()["rows"]
        assert [r["id"] for r in rows] == ["b"] and rows[0]["reason"] == "crashed"
        rows = (await c.get("/ui/api/samples", params={"min_reward": 0.5, "sort": "-step"})).json()[
            "rows"
        ]
        assert [r["id"] for r in rows] == ["c", "b"]
        view = (await c.get("/ui/api/samples/2")).json()
        assert (
            view["step"] == 20
            and view["stats"]["trained"] == 3
            and view["stats"]["version_changes"] == 1
        )
        assert view["segments"][0]["text"][0] == "\u27e81\u27e9"  # no tokenizer given: ids
        png = await c.get("/ui/api/plots/reward.png")
        assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
        for path, status in [
            ("/ui/api/plots/..%2Fconfig.yaml", 404),
            ("/ui/api/samples/3", 404),
            ("/ui/api/samples/x", 400),
            ("/ui/api/samples?sort=up", 400),
            ("/ui/api/samples?min_reward=high", 400),
        ]:
            assert (await c.get(path)).status_code == status, path
    # the run goes on: samples appended later are found without a restart
    SamplesLog(tmp_path, 1, resume_step=20).write(21, [synthetic_trajectory("d", 0.5)])
    async with client("view-token") as c:
        assert (await c.get("/ui/api/samples", params={"step": 21})).json()["total"] == 1


def test_the_wheel_ships_the_page(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".*", "runs", "build", "*.egg-info", "__pycache__", "test-artifacts", "tests", "bench"
        ),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("loongsage-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = Path(ROOT / "gateway/server/static")
    assert {f"gateway/server/static/{p.name}" for p in static.iterdir()} <= names
