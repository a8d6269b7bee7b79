"""`mmreplay view` in a real browser (headless Chromium driven by selenium).

Each view loads without console errors; the player shows the right frame (pixels read
back from the page and compared with the store's frame) when scrubbed, stepped with the
keyboard, played and deep-linked; a page on a store being written shows the new episode
without a reload; traversal attempts get 404.

Figures: each test prints how long the page took to open a view and to answer an
interaction. With ``MMREPLAY_VIEWER_RECORD=1`` the Breakout test also writes the
screenshots of ``docs/viewer.md`` to ``docs/img/`` and the figures to
``data/bench/viewer.json``.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from viewer_support import chromium, frame, record_episodes, serving, small_store

from mmreplay import ReplayStore
from mmreplay.tools import inspection as ins
from mmreplay.tools.steps import episode_frames, episode_steps

ROOT = Path(__file__).resolve().parents[1]
BREAKOUT = ROOT / "data" / "breakout_store"
RECORD = os.environ.get("MMREPLAY_VIEWER_RECORD") == "1"
TIMINGS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


def wait_for(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def console_errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def open_view(driver: Any, url: str, view: str) -> float:
    """Load `url` (after a blank page, with the console log drained) and wait until the page
    says `view` is drawn; returns seconds taken."""
    driver.get("about:blank")
    driver.get_log("browser")
    start = time.perf_counter()
    driver.get(url)
    ready = wait_for(lambda: driver.execute_script("return document.body.dataset.ready"),
                     f"view {view} to be drawn")
    assert ready == view, f"view {view}: {driver.find_element('id', 'error-text').text}"
    return time.perf_counter() - start


def shown_frame(driver: Any) -> tuple[int, np.ndarray]:
    """(frame index the page says it shows, its pixels as the browser decoded them)."""
    t, pixels = driver.execute_script("""
        const img = document.getElementById('frame');
        const c = document.createElement('canvas');
        c.width = img.naturalWidth; c.height = img.naturalHeight;
        const ctx = c.getContext('2d');
        ctx.drawImage(img, 0, 0);
        const d = ctx.getImageData(0, 0, c.width, c.height).data;
        const out = [];
        for (let i = 0; i < d.length; i += 4) out.push(d[i]);
        return [Number(img.dataset.t), [c.height, c.width, out]];""")
    h, w, values = pixels
    return t, np.asarray(values, np.uint8).reshape(h, w)


def shown_index(driver: Any) -> int:
    return int(driver.execute_script(
        "return document.getElementById('frame').dataset.t || -1"))


def frame_settled(driver: Any, t: int) -> Callable[[], bool]:
    return lambda: driver.execute_script(
        "const i = document.getElementById('frame');"
        "return i.complete && i.naturalWidth > 0 && i.dataset.t === arguments[0];", str(t))


def timed(name: str, seconds: float) -> None:
    TIMINGS.setdefault(name, []).append(round(seconds * 1000, 1))
    print(f"{name}: {seconds * 1000:.1f} ms")


# -- a store whose frames say their number ------------------------------------------------
@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("viewer") / "store"
    small_store(path, [6, 20, 9]).close()
    yield path


def test_scrub_keys_and_play_show_the_right_frame(browser: Any, numbered: Path) -> None:
    with ins.open_readonly(numbered) as store:
        want = episode_frames(store, 1)
    with serving(numbered) as server:
        timed("open player", open_view(browser, server.url + "#/episode/1", "episode"))
        body = browser.find_element("tag name", "body")
        for expected, keys in ((1, "\ue014"), (2, "\ue014"), (12, "\ue008\ue014"),
                               (11, "\ue012")):  # right, right, shift+right, left
            start = time.perf_counter()
            body.send_keys(keys)
            wait_for(frame_settled(browser, expected), f"frame {expected}")
            timed("key step to frame drawn", time.perf_counter() - start)
            t, pixels = shown_frame(browser)
            assert t == expected and np.array_equal(pixels, want[t]), t
        start = time.perf_counter()
        browser.execute_script("const s = document.getElementById('scrub'); s.value = 17;"
                               "s.dispatchEvent(new Event('input'));")
        wait_for(frame_settled(browser, 17), "frame 17 after scrubbing")
        timed("scrub to frame drawn", time.perf_counter() - start)
        assert np.array_equal(shown_frame(browser)[1], want[17])
        assert browser.execute_script("return location.hash") == "#/episode/1?t=17"
        browser.execute_script("const s = document.getElementById('scrub'); s.value = 0;"
                               "s.dispatchEvent(new Event('input'));")
        wait_for(frame_settled(browser, 0), "frame 0")
        body.send_keys(" ")  # play
        wait_for(lambda: shown_index(browser) >= 5, "playback to reach frame 5")
        body.send_keys(" ")  # pause
        time.sleep(0.3)
        t = int(browser.find_element("id", "scrub").get_attribute("value"))
        wait_for(frame_settled(browser, t), "the paused frame")
        time.sleep(0.3)
        assert shown_index(browser) == t, "playback did not pause"
        assert 5 <= t < len(want) and np.array_equal(shown_frame(browser)[1], want[t])
        assert console_errors(browser) == []


def test_deep_link_opens_episode_at_step(browser: Any, numbered: Path) -> None:
    with ins.open_readonly(numbered) as store:
        want = episode_frames(store, 2)
        steps = episode_steps(store, 2)
    with serving(numbered) as server:
        open_view(browser, server.url + "#/episode/2?t=4", "episode")
        wait_for(frame_settled(browser, 4), "deep-linked frame 4")
        assert np.array_equal(shown_frame(browser)[1], want[4])
        fields = browser.find_element("id", "player").text
        assert f"transition id\n{steps.ids[4]}" in fields.replace(" \n", "\n") or \
            str(steps.ids[4]) in fields
        browser.execute_script("location.hash = '#/episode/2?t=7'")  # same episode, new step
        wait_for(frame_settled(browser, 7), "frame 7 after the hash changed")
        assert np.array_equal(shown_frame(browser)[1], want[7])
        stack = browser.find_element("id", "obs-stack")
        wait_for(lambda: browser.execute_script(
            "return arguments[0].complete && arguments[0].naturalWidth", stack), "stack image")
        assert browser.execute_script("return arguments[0].naturalWidth", stack) == \
            4 * frame(0).shape[1] + 3 * 2  # frame_stack frames, 2 px apart
        assert console_errors(browser) == []


def timeline_at(driver: Any) -> tuple[int, dict[str, Any], list[int]]:
    """(frame the timeline marks, its values there by series name, the RGB of the canvas
    pixel on its cursor line, halfway down the first series)."""
    t, values, rgb = driver.execute_script("""
        const c = document.getElementById('timeline');
        const r = window.devicePixelRatio || 1;
        const x = Math.floor(Number(c.dataset.cursorX) * r), y = Math.floor(40 * r);
        const px = c.getContext('2d').getImageData(x, y, 1, 1).data;
        return [Number(c.dataset.t), JSON.parse(c.dataset.values), [px[0], px[1], px[2]]];""")
    return t, values, rgb


def test_timeline_follows_the_frame_with_every_step_field(browser: Any, tmp_path: Path) -> None:
    """Reward, n-step return, discount, action, terminated, truncated, priority and an extra
    on the timeline, at the frame shown, equal the store's (``ReplayStore.get``)."""
    path = tmp_path / "fields"
    with ReplayStore.create(path, capacity=128, obs_shape=frame(0).shape, frame_stack=2,
                            n_step=3, gamma=0.9, seed=0, chunk_frames=8, sampler="prioritized",
                            extras={"logp": ((), np.float32)}) as store:
        n = 0
        for e, steps in enumerate([5, 12]):
            store.reset(frame(n))
            for t in range(steps):
                n += 1
                store.add(t % 3, float(t * (e + 1)), frame(n), t == steps - 1, False,
                          extras={"logp": np.float32(-0.25 * t)})
            n += 1
        ids = store.valid_ids()
        store.update_priorities(ids, 0.5 + ids % 7)
        store.flush()
        steps = episode_steps(store, 1)
        batch = store.get(steps.ids[steps.sampleable])
        with serving(path) as server:
            open_view(browser, server.url + "#/episode/1?t=2", "episode")
            body = browser.find_element("tag name", "body")
            for t, keys in ((2, ""), (3, "\ue014"), (9, "\ue014" * 6), (10, "\ue014"),
                            (12, "\ue014\ue014"), (8, "\ue012" * 4)):
                body.send_keys(keys) if keys else None
                wait_for(lambda t=t: timeline_at(browser)[0] == t, f"timeline at frame {t}")
                wait_for(frame_settled(browser, t), f"frame {t}")
                shown, values, rgb = timeline_at(browser)
                assert rgb == [255, 255, 255], "no cursor line at the frame shown"
                has = steps.ids[t] >= 0
                assert values["reward"] == (float(steps.reward[t]) if has else 0.0)
                assert values["action"] == (int(steps.action[t]) if has else 0)
                assert values["terminated"] == int(steps.terminated[t])
                assert values["truncated"] == 0 and values["logp"] == (-0.25 * t if has else 0)
                if steps.sampleable[t]:
                    i = int(np.flatnonzero(steps.ids[steps.sampleable] == steps.ids[t])[0])
                    assert values["discount"] == pytest.approx(float(batch.discount[i]))
                    assert values["3-step return"] == pytest.approx(float(batch.reward[i]))
                    assert values["priority"] == pytest.approx(0.5 + steps.ids[t] % 7)
                else:
                    assert values["discount"] is None and values["priority"] is None
                fields = browser.find_element("id", "player").text
                assert "discount" in fields and "3-step return" in fields
            assert set(values) == {"reward", "3-step return", "discount", "action",
                                   "terminated", "truncated", "priority", "logp"}
            assert console_errors(browser) == []


def test_health_card_verifies_on_demand(browser: Any, tmp_path: Path) -> None:
    """The overview's "verify now" runs verify: a sound store says so; one with a damaged
    frame chunk lists the problem and raises the error panel."""
    path = tmp_path / "health"
    small_store(path, [6, 20, 9]).close()
    health = lambda: browser.execute_script(  # noqa: E731
        "return document.body.dataset.health")
    for damaged in (False, True):
        if damaged:
            victim = max((p for p in (path / "frames").rglob("*") if p.is_file()),
                         key=lambda p: p.stat().st_size)
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
        with serving(path) as server:
            open_view(browser, server.url + "#/overview", "overview")
            assert health() == "never" and not browser.find_element("id", "error").is_displayed()
            browser.find_element("id", "verify").click()
            wait_for(lambda: health() in ("ok", "problems", "failed", "stopped"), "verify")
            card = browser.find_element("id", "health").text
            panel = browser.find_element("id", "error")
            if damaged:
                assert health() == "problems" and victim.name in card, card
                assert panel.is_displayed() and "verify found" in panel.text
            else:
                assert health() == "ok" and "sound" in card and not panel.is_displayed()
            assert console_errors(browser) == []


def test_live_store_gains_an_episode_without_reload(browser: Any, tmp_path: Path) -> None:
    path = tmp_path / "live"
    writer = small_store(path, [5, 7])
    try:
        with serving(path) as server:
            open_view(browser, server.url + "#/episodes", "episodes")
            total = lambda: browser.execute_script(  # noqa: E731
                "return document.getElementById('page-info').dataset.total")
            assert total() == "2"
            browser.execute_script("window.sameDocument = true")
            done = threading.Event()

            def write() -> None:
                record_episodes(writer, [4], first_frame=100)
                writer.flush()
                done.set()

            start = time.perf_counter()
            threading.Thread(target=write, daemon=True).start()
            assert done.wait(30)
            wait_for(lambda: total() == "3", "the new episode to appear", timeout=20)
            timed("new episode on the page after flush", time.perf_counter() - start)
            assert browser.execute_script("return window.sameDocument") is True
            rows = browser.find_elements("css selector", "#episodes tbody tr")
            assert [r.get_attribute("data-episode") for r in rows] == ["0", "1", "2"]
            assert console_errors(browser) == []
    finally:
        writer.close()


def test_error_panel_for_a_missing_episode(browser: Any, numbered: Path) -> None:
    with serving(numbered) as server:
        open_view_error = server.url + "#/episode/77"
        browser.get(open_view_error)
        wait_for(lambda: browser.execute_script("return document.body.dataset.ready"),
                 "the page to settle")
        panel = browser.find_element("id", "error")
        assert panel.is_displayed() and "episode 77" in panel.text
        open_view(browser, server.url + "#/overview", "overview")  # the page still works
        assert not browser.find_element("id", "error").is_displayed()


def test_vector_store_views_have_no_frames_and_no_errors(browser: Any, tmp_path: Path) -> None:
    path = tmp_path / "vec"
    with ReplayStore.create(path, capacity=64, obs_shape=(4,), obs_dtype=np.float32,
                            extras={"value": ((2,), np.float32)}) as store:
        store.reset(np.zeros(4, np.float32))
        for t in range(12):
            store.add(t % 2, 0.5, np.full(4, t, np.float32), t == 11, False,
                      extras={"value": np.array([t, -t], np.float32)})
    with serving(path) as server:
        for view, fragment in VIEWS[:2] + (("episode", "#/episode/0?t=3"), VIEWS[3]):
            open_view(browser, server.url + fragment, view)
            time.sleep(0.2)
            assert console_errors(browser) == [], view
        open_view(browser, server.url + "#/episode/0?t=3", "episode")
        text = browser.find_element("id", "player").text
        assert "not images" in text and "value" in text  # the extra, as its mean
        assert browser.find_elements("id", "frame") == []


@pytest.mark.parametrize("target", [
    "/static/../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
    "/static/..%2f..%2fetc%2fpasswd", "/../../etc/passwd", "/static//etc/passwd",
    "/static/", "/api/../static/app.js", "/static/app.js/..", "/etc/passwd", "//etc/passwd",
    "/api/episode/1/frame/..%2f..%2fmanifest.json", "/manifest.json", "/static/server.py"])
def test_traversal_attempts_get_404(numbered: Path, target: str) -> None:
    with serving(numbered) as server:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        try:
            conn.request("GET", target)  # sent as written: no client-side normalisation
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
    assert response.status == 404, (target, body[:200])
    assert b"root:" not in body and json.loads(body)["error"]


# -- Breakout: every view, screenshots and figures ---------------------------------------
VIEWS = (("overview", "#/overview"), ("episodes", "#/episodes"),
         ("episode", "#/episode/3?t=60"), ("sampling", "#/sampling"))


def test_every_view_of_a_breakout_store(browser: Any, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the page names the store as given: data/breakout_store
    store = BREAKOUT.relative_to(ROOT)  # served in place: the viewer writes nothing
    before = sorted((p.name, p.stat().st_mtime_ns) for p in BREAKOUT.rglob("*"))
    shots = ROOT / "docs" / "img" if RECORD else tmp_path / "img"
    shots.mkdir(parents=True, exist_ok=True)
    with serving(store) as server:
        timed("first view on a fresh server (it is still warming up)",
              open_view(browser, server.url + "#/overview", "overview"))
        for view, fragment in VIEWS:
            timed(f"open {view}", open_view(browser, server.url + fragment, view))
            timed(f"open {view} (page clock)", float(browser.execute_script(
                "return document.body.dataset.readyMs")) / 1000)
            if view == "episode":
                wait_for(frame_settled(browser, 60), "frame 60")
            if view == "overview":  # the health card with verify's result
                browser.find_element("id", "verify").click()
                wait_for(lambda: browser.execute_script("return document.body.dataset.health")
                         == "ok", "verify to find the Breakout store sound", timeout=60)
            time.sleep(0.2)  # images after the JSON
            assert console_errors(browser) == [], view
            save_page(browser, shots / f"viewer_{view}.png")
        _interactions(browser, server.url)
    assert all((shots / f"viewer_{v}.png").stat().st_size > 10_000 for v, _ in VIEWS)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in BREAKOUT.rglob("*")) == before
    if RECORD:
        _write_figures()


def save_page(driver: Any, out: Path) -> None:
    """A screenshot of the whole page (up to 1600 px high), not just the window."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": 1280, "height": min(max(900, height), 1600), "deviceScaleFactor": 1,
        "mobile": False})
    try:
        time.sleep(0.3)  # the page redraws its canvases at the new width
        driver.save_screenshot(str(out))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def _interactions(browser: Any, url: str) -> None:
    """Time what a user does most: sort and page the episodes, draw a batch."""
    renders = lambda: int(browser.execute_script(  # noqa: E731
        "return document.body.dataset.renders || 0"))
    open_view(browser, url + "#/episodes", "episodes")
    before = renders()
    browser.execute_script("const s = document.getElementById('f-limit'); s.value = '10';"
                           "s.dispatchEvent(new Event('change'));")
    wait_for(lambda: renders() > before, "pages of 10")
    for action, selector in (("sort episodes by return", "th[data-key=return]"),
                             ("sort episodes by return, descending", "th[data-key=return]"),
                             ("next page of episodes", "#next")):
        before = renders()
        start = time.perf_counter()
        browser.execute_script(f"document.querySelector('{selector}').click()")
        wait_for(lambda before=before: renders() > before, action)
        timed(action, time.perf_counter() - start)
    before = renders()
    browser.execute_script("document.querySelector('#prev').click()")
    wait_for(lambda: renders() > before, "the first page again")
    shown = [float(c.text) for c in
             browser.find_elements("css selector", "#episodes tbody td:nth-child(6)")]
    assert shown and shown == sorted(shown, reverse=True)
    open_view(browser, url + "#/sampling", "sampling")
    before = renders()
    start = time.perf_counter()
    browser.execute_script("document.getElementById('draw').click()")
    wait_for(lambda: renders() > before and browser.execute_script(
        "return [...document.querySelectorAll('#batch-items img')]"
        ".every(m => m.complete && m.naturalWidth > 0)"), "a new batch")
    timed("draw a batch (8 stacked states)", time.perf_counter() - start)


def _write_figures() -> None:
    out = ROOT / "data" / "bench" / "viewer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = {"store": "data/breakout_store", "browser": "headless Chromium (selenium)",
               "machine": platform.machine(), "cpus": os.cpu_count(),
               "note": "milliseconds, one run on a shared machine; no timed asserts",
               "milliseconds": TIMINGS}
    out.write_text(json.dumps(figures, indent=2) + "\n")


def test_writer_and_frames_agree(tmp_path: Path) -> None:
    """The helper's frames are distinct (up to 251 frames, more than these stores write),
    so a pixel check tells frames apart."""
    assert len({frame(n).tobytes() for n in range(251)}) == 251
    with ReplayStore.create(tmp_path / "s", capacity=64, obs_shape=frame(0).shape) as store:
        assert record_episodes(store, [3, 2]) == 7
