"""The UI in a real browser: headless Chromium from Debian's packages (`chromium`,
`chromium-driver`; scripts/test_services.sh installs them) driven by Selenium, against a real
gateway on the tiny model's engine over HTTP, with sessions made by a real multi-turn
tool-calling agent (tests/ui_helpers.py) and a weight swap in the middle of one.

The gateway runs in an event loop on a thread of its own, since Selenium's calls block. Every test
checks that the browser logged no error (a script error, a refused resource, a CSP violation).
Screenshots are kept under test-artifacts/ui/ (gitignored; their paths are printed). Skipped,
saying what is missing, without chromium, chromedriver or selenium.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import openai
import pytest
from ui_helpers import make_run_dir, perturbed_norm, tool_agent

from gateway.engines.local import LocalEngine
from gateway.server import Gateway, GatewayConfig, HttpServer
from gateway.server.ui import TokenTexts
from gateway.trajectory import Trajectory, Turn
from trainer.view import make_app

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "ui"
ADMIN = "adm-browser-test"
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",  # we run as root in CI
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1440,1800",
]


class LoopThread:
    """An event loop on its own thread: the gateway serves there while the test blocks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Site:
    def __init__(self, loop: LoopThread, gw: Gateway, base_url: str) -> None:
        self.loop, self.gw, self.base = loop, gw, base_url

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run(coro)

    def agent(self, key: str, turns: int = 3, **kw: Any) -> tuple[list, list]:
        """The scripted agent over real HTTP with the session's key."""

        async def go() -> tuple[list, list]:
            client = openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0)
            try:
                return await tool_agent(client, self.gw.model_name, turns, **kw)
            finally:
                await client.close()

        return self.run(go())


@pytest.fixture(scope="module")
def site(tiny_model_path):
    loop = LoopThread()

    async def start() -> tuple[LocalEngine, Gateway, HttpServer]:
        engine = LocalEngine(tiny_model_path)
        gw = Gateway(engine, tiny_model_path, GatewayConfig(auth="keys", admin_token=ADMIN))
        return engine, gw, await gw.start_http(port=0)

    engine, gw, server = loop.run(start())
    yield Site(loop, gw, server.base_url)

    async def stop() -> None:
        await server.stop()
        await gw.aclose()
        await engine.close()

    loop.run(stop())
    loop.close()


@pytest.fixture(scope="module")
def driver():
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.skip(
            "needs headless Chromium: apt-get install chromium chromium-driver "
            "(scripts/test_services.sh does it)"
        )
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="loongsage-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # a driver path given: Selenium Manager (which would go online) is not run
    drv = webdriver.Chrome(service=Service(chromedriver), options=options)
    drv.set_script_timeout(30)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_browser_errors(request):
    yield
    if "driver" in request.fixturenames:
        drv = request.getfixturevalue("driver")
        errors = [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Helpers


def css(drv, selector: str) -> Any:
    return drv.find_element("css selector", selector)


def css_all(drv, selector: str) -> list[Any]:
    return drv.find_elements("css selector", selector)


def wait(drv, condition, timeout: float = 60, what: str = "") -> Any:
    """Until `condition(drv)` is truthy; an element the page replaced meanwhile (a live session
    re-renders) is looked up again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(drv, timeout, 0.1, ignored).until(condition, what)


def wait_css(drv, selector: str, timeout: float = 60) -> Any:
    return wait(drv, lambda d: (css_all(d, selector) or [None])[0], timeout, selector)


def open_page(site: Site, drv, path: str, token: str | None) -> None:
    drv.get(f"{site.base}{path}" + (f"#token={token}" if token else ""))


def open_session(site: Site, drv, sid: str, token: str = ADMIN, timeout: float = 60) -> float:
    start = time.perf_counter()
    open_page(site, drv, f"/ui?session={sid}", token)
    wait_css(drv, ".traj[data-ready=true]", timeout)
    return time.perf_counter() - start


def stat(drv, key: str) -> str:
    return css(drv, f'.traj [data-stat="{key}"]').text


def screenshot(drv, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    drv.save_screenshot(str(path))
    print(f"\nscreenshot: {path}")
    return path


def mask_sum(traj: Trajectory) -> int:
    return sum(sum(s.loss_mask) for s in traj.segments)


# ---------------------------------------------------------------------------------------------
# Tests


def test_a_tool_calling_session_token_by_token(site, driver, tiny_model_path):
    gw = site.gw
    sid, key = gw.create_session({"agent": "scripted-lookup", "env": "Lookup-v0"})
    before = gw.weight_version
    after = before + 1

    async def swap(i: int) -> None:
        if i == 0:  # between the first and the second call: the session spans two versions
            await gw.update_weights(perturbed_norm(tiny_model_path), version=after)

    calls, results = site.agent(key, 3, after_turn=swap)
    gw.attach_reward(sid, 0.75)
    traj = site.run(gw.close_session(sid))

    open_page(site, driver, "/ui", ADMIN)
    row = wait_css(driver, f'tr[data-session="{sid}"]')
    assert "token=" not in driver.current_url  # taken out of the address bar
    assert "scripted-lookup" in row.text and "ok" in row.text
    row.find_element("css selector", "a").click()
    wait_css(driver, ".traj[data-ready=true]")

    trained = mask_sum(traj)
    assert int(stat(driver, "trained")) == trained == len(css_all(driver, "[data-segment] .tk.tr"))
    assert int(stat(driver, "tokens")) == sum(len(s.token_ids) for s in traj.segments)
    marks = css_all(driver, ".vmark")
    assert [m.text for m in marks] == [f"v{before}\u2192v{after}"] and stat(
        driver, "vchanges"
    ) == "1"
    first_new = driver.execute_script("return document.querySelector('.vmark').nextElementSibling")
    assert "tr" in first_new.get_attribute("class").split()  # right before the first new token
    assert css(driver, '[data-field="reward"]').text.endswith("0.750")
    cards = css_all(driver, ".card.call")
    assert len(cards) == len(calls) > 0 and all("lookup" in c.text for c in cards)
    assert [c.text for c in css_all(driver, ".card.result pre")] == results

    # hover shows a token's id, logprob and version; a click pins them
    from selenium.webdriver.common.action_chains import ActionChains

    span = css(driver, "[data-segment] .tk.tr")
    ActionChains(driver).move_to_element(span).perform()
    tip = wait(
        driver, lambda d: d.find_element("id", "tip").is_displayed() and d.find_element("id", "tip")
    )
    seg = traj.segments[0]
    i = seg.loss_mask.index(1)
    assert (
        tip.text.startswith(f"#{seg.token_ids[i]} ") and f"version v{seg.versions[i]}" in tip.text
    )
    span.click()
    assert css(driver, '[data-pin] [data-key="id"]').text == str(seg.token_ids[i])
    assert css(driver, '[data-pin] [data-key="logprob"]').text.startswith(f"{seg.logprobs[i]:.4f}")
    screenshot(driver, "session")


def test_a_live_session_updates_while_the_agent_works(site, driver):
    gw = site.gw
    sid, key = gw.create_session({"agent": "live"})
    site.agent(key, 1)
    open_session(site, driver, sid)
    assert stat(driver, "turns") == "1" and "on" in css(driver, "#live").get_attribute("class")
    site.agent(key, 3)  # the same agent goes on (a fresh history: a second segment)
    wait(driver, lambda d: stat(d, "turns") == "4", 30, "the page shows the new turns")
    wait_css(driver, ".traj[data-ready=true]")
    assert int(stat(driver, "trained")) == mask_sum(gw.trajectory(sid))
    gw.attach_reward(sid, 1.0)
    site.run(gw.close_session(sid))
    wait(driver, lambda d: css(d, ".hero .st").text == "ok", 30, "the page shows it closed")
    wait(driver, lambda d: "on" not in css(d, "#live").get_attribute("class"), 30)


def test_auth_in_the_browser(site, driver):
    gw = site.gw
    a, key_a = gw.create_session({"agent": "a"})
    b, _ = gw.create_session({"agent": "b"})
    site.agent(key_a, 1)
    open_page(site, driver, "/ui", None)
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    wait_css(driver, "form.login")  # no token: nothing but the form
    open_page(site, driver, "/ui", "not-a-token")
    assert "unknown token" in wait_css(driver, "form.login .err").text

    # a session's key: its own session only
    open_page(site, driver, "/ui", key_a)
    wait(driver, lambda d: f"session={a}" in d.current_url, 30, "sent to its own session")
    wait_css(driver, ".traj[data-ready=true]")
    assert css(driver, '.traj [data-field="id"]').text == a
    open_page(site, driver, f"/ui?session={b}", None)
    assert wait_css(driver, "[data-error]").get_attribute("data-error") == "404"
    status = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/ui/api/sessions', {headers: {Authorization: 'Bearer ' + arguments[0]}})"
        ".then(r => done(r.status));",
        key_a,
    )
    assert status == 401

    # the admin token typed into the form opens the list
    driver.execute_script("sessionStorage.clear()")
    open_page(site, driver, "/ui", None)
    form = wait_css(driver, "form.login")
    form.find_element("css selector", "input").send_keys(ADMIN)
    form.submit()
    wait_css(driver, f'tr[data-session="{b}"]')
    driver.get_log("browser")  # the 401s above are logged as failed loads: expected here


def test_model_and_agent_text_is_shown_never_run(site, driver):
    gw = site.gw
    evil = "<img src=x onerror=\"window.__pwned='{}'\">"
    script = "<script>window.__pwned='{}'</script>"
    sid, key = gw.create_session({"agent": evil.format("agent"), "note": script.format("meta")})
    tool_text = script.format("tool") + evil.format("tool")
    site.agent(key, 2, tool_result=lambda i: tool_text)
    # The tiny model cannot be made to write markup, so one turn's output ids are written here:
    # text and a tool call, tokenized as the model would have sampled them.
    r = gw.renderer
    output = (
        script.format("model") + '<tool_call>\n{"name": "' + evil.format("call").replace('"', "'")
    )
    output += '", "arguments": {"q": "</pre><script>window.__pwned=1</script>"}}\n</tool_call>'
    out_ids = r.encode(output) + sorted(r.eos_ids)[:1]
    turn = Turn(
        prompt_ids=r.render([{"role": "user", "content": "write markup"}]),
        output_ids=out_ids,
        output_logprobs=[-0.5] * len(out_ids),
        output_versions=[gw.weight_version] * len(out_ids),
        finish_reason="tool_calls",
        endpoint="chat",
    )
    gw.sessions.get(sid).add_turn(turn)
    site.run(gw.close_session(sid, "aborted", script.format("reason")))

    open_page(site, driver, "/ui", ADMIN)
    row = wait_css(driver, f'tr[data-session="{sid}"]')
    assert evil.format("agent") in row.text
    open_session(site, driver, sid)
    page = css(driver, "body").text
    for where in ("meta", "tool", "model", "reason"):
        assert script.format(where) in page or where == "meta", where
    assert "window.__pwned='call'" in css_all(driver, ".card.call b")[-1].text
    assert script.format("reason") in css(driver, '[data-field="reason"]').text
    assert driver.execute_script("return window.__pwned") is None
    assert driver.execute_script("return document.scripts.length") == 1  # ui.js only
    assert css_all(driver, "img") == []
    css(driver, "details.json summary").click()
    assert script.format("meta") in css(driver, "details.json pre").text
    screenshot(driver, "escaping")


def test_a_32k_token_trajectory(site, driver):
    gw = site.gw
    sid, _ = gw.create_session({"agent": "long"})
    rng = random.Random(0)
    vocab = [i for i in range(len(gw.renderer.tokenizer)) if i not in gw.renderer.special_ids]
    n = 16_384
    prompt = [rng.choice(vocab) for _ in range(n)]
    output = [rng.choice(vocab) for _ in range(n)]
    v = gw.weight_version
    gw.sessions.get(sid).add_turn(
        Turn(
            prompt_ids=prompt,
            output_ids=output,
            output_logprobs=[-rng.expovariate(1.0) for _ in range(n)],
            output_versions=[v] * (n // 2) + [v + 1] * (n - n // 2),  # a partial rollout
            finish_reason="length",
            endpoint="chat",
        )
    )
    site.run(gw.close_session(sid))
    took = open_session(site, driver, sid, timeout=180)
    assert int(stat(driver, "tokens")) == 2 * n == len(css_all(driver, "[data-segment] .tk"))
    assert int(stat(driver, "trained")) == n and stat(driver, "vchanges") == "1"
    render_ms = css(driver, ".traj").get_attribute("data-render-ms")
    print(
        f"\n32K-token trajectory: page ready {took:.2f} s after navigation ({render_ms} ms to build the spans)"
    )
    screenshot(driver, "32k")


def test_the_run_viewer(site, driver, tmp_path, tiny_model_path):
    gw = site.gw
    samples: dict[int, list[Trajectory]] = {}
    for step in (0, 20):
        if step:
            version = gw.weight_version + 1
            site.run(gw.update_weights(perturbed_norm(tiny_model_path, 0.5), version=version))
        samples[step] = []
        for reward in (0.0, 1.0):
            sid, key = gw.create_session({"env": "Lookup-v0", "step": step})
            site.agent(key, 3)
            gw.attach_reward(sid, reward)
            samples[step].append(site.run(gw.close_session(sid)))
    make_run_dir(tmp_path, samples, gw.renderer.decode)
    app = make_app(tmp_path, "run-token", TokenTexts(gw.renderer))

    async def start() -> HttpServer:
        server = HttpServer(app, "127.0.0.1", 0, None)
        await server.start()
        return server

    server = site.run(start())
    try:
        driver.get(f"{server.base_url}/ui#token=run-token")
        wait_css(driver, "[data-table=samples] tbody tr")
        wait(
            driver,
            lambda d: all(
                d.execute_script("return arguments[0].naturalWidth", img) > 0
                for img in css_all(d, "img[data-plot]")
            ),
            30,
            "the plots load",
        )
        assert len(css_all(driver, "img[data-plot]")) == 3
        assert css_all(driver, '.chart[data-metric="reward/mean"] polyline')
        assert len(css_all(driver, "[data-table=samples] tbody tr")) == 4
        from selenium.webdriver.support.ui import Select

        Select(css(driver, '[data-control="step"]')).select_by_value("20")
        wait(driver, lambda d: len(css_all(d, "[data-table=samples] tbody tr")) == 2, 30)
        screenshot(driver, "run")
        Select(css(driver, '[data-control="step-a"]')).select_by_value("0")
        Select(css(driver, '[data-control="step-b"]')).select_by_value("20")
        css(driver, '[data-control="compare-steps"]').click()
        wait(driver, lambda d: len(css_all(d, ".traj[data-ready=true]")) == 2, 60, "compare view")
        shown = [int(e.text) for e in css_all(driver, '.traj [data-stat="trained"]')]
        best = [max(samples[s], key=lambda t: t.reward) for s in (0, 20)]
        assert shown == [mask_sum(t) for t in best]
        assert [e.text for e in css_all(driver, '.traj [data-field="id"]')] == [
            t.session_id for t in best
        ]
        screenshot(driver, "compare")
    finally:
        site.run(server.stop())


def test_the_list_pages_10000_sessions(site, driver):
    gw = site.gw
    for i in range(10_000):
        sid, _ = gw.create_session({"agent": f"bulk-{i % 5}"}, session_id=f"bulk-{i:05d}")
        if i % 2:
            gw.attach_reward(sid, i / 10_000)
    start = time.perf_counter()
    open_page(site, driver, "/ui", ADMIN)
    wait_css(driver, '#app[data-ready=true] tr[data-session="bulk-09999"]')
    took = time.perf_counter() - start
    total = len(gw.sessions.all())
    assert css(driver, '[data-field="range"]').text == f"1\u201350 of {total}"
    css(driver, '[data-control="next"]').click()
    wait(driver, lambda d: css(d, '[data-field="range"]').text == f"51\u2013100 of {total}", 30)
    assert css_all(driver, "tbody tr")[0].get_attribute("data-session") == "bulk-09949"
    print(f"\nlist of {total} sessions: page ready {took:.2f} s after navigation")
