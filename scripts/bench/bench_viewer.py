"""How fast `mmreplay view` answers on a large store: server start, each endpoint, and (with
Chromium) each view and interaction as the browser sees them.

    python scripts/bench/bench_viewer.py                      # 1M frames, 16 envs (~3 min to build)
    python scripts/bench/bench_viewer.py --frames 20000 --no-browser

The store holds 84x84 synthetic frames (a moving block: they compress like Atari frames
do, well). Each endpoint is timed cold (first request of the generation: tables built,
frames decoded) and warm (cached). Browser figures: from navigation to the view drawn, and
from a click or key to the page redrawn (the frame decoded and shown, for the player).
The browser goes first, on the freshly started server (its first view may wait for the
warm-up, as a user's would); then each view is opened 5 more times, timed by the page's
own clock (``performance.now()`` from navigation start to the view drawn). Last, the
health card's verify of the whole store. Figures only, one run, with the load average;
writes JSON (default data/bench/viewer_large.json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay import ReplayStore
from mmreplay.tools.view import ViewerServer, make_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900")


def build_store(path: Path, frames: int, envs: int) -> float:
    """`frames` frames over `envs` envs (episodes of ~200 steps); returns seconds taken."""
    start = time.perf_counter()
    rng = np.random.default_rng(0)
    base = np.zeros((envs, 84, 84), np.uint8)
    store = ReplayStore.create(path, capacity=frames, obs_shape=(84, 84), num_envs=envs,
                               frame_stack=4, seed=0)
    store.reset(base)
    for i in range(frames // envs - 1):
        obs = base.copy()
        obs[:, (i * 3) % 80:(i * 3) % 80 + 4, 10 + i % 60:14 + i % 60] = 200
        end = rng.random(envs) < 1 / 200
        store.add(rng.integers(0, 4, envs), (rng.random(envs) < 0.05).astype(np.float32), obs,
                  end, np.zeros(envs, bool))
        if end.any():
            store.reset(base[end], env_ids=np.flatnonzero(end))
    store.close()
    return time.perf_counter() - start


def http_timings(server: ViewerServer) -> dict[str, dict[str, float]]:
    host, port = server.server_address[:2]

    def get(target: str) -> dict[str, Any]:
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.request("GET", target)
        body = conn.getresponse().read()
        conn.close()
        return json.loads(body) if body[:1] == b"{" else {}

    page = get("/api/episodes?limit=50&sort=length&order=desc")
    ep = page["rows"][0]["episode"]
    tid = get(f"/api/episode/{ep}")["ids"][10]
    targets = {"status": "/api/status", "overview": "/api/overview",
               "episodes page (sorted by return)": "/api/episodes?sort=return&order=desc",
               "episodes page 100": "/api/episodes?offset=5000&limit=50",
               "series": "/api/series", "episode (steps)": f"/api/episode/{ep}",
               "frame png": f"/api/episode/{ep}/frame/20.png",
               "stacked state png": f"/api/transition/{tid}/obs.png",
               "sampling + batch of 8": "/api/sampling?batch=8&seed=1",
               "first episode (player without a number)": "/api/episode/first",
               "episode as GIF": f"/api/episode/{ep}.gif",
               "episode as MP4": f"/api/episode/{ep}.mp4"}
    out = {}
    for name, target in targets.items():
        times = []
        for _ in range(2):
            start = time.perf_counter()
            get(target)
            times.append(round((time.perf_counter() - start) * 1000, 1))
        out[name] = {"cold_ms": times[0], "warm_ms": times[1]}
    start = time.perf_counter()
    get("/api/health?run=1")
    while get("/api/health")["state"] == "running":
        time.sleep(0.05)
    report = get("/api/health")
    out["health: verify the whole store"] = {
        "ms": round((time.perf_counter() - start) * 1000, 1), "state": report["state"],
        "ok": (report.get("report") or {}).get("ok"),
        "chunks": (report.get("report") or {}).get("chunks_checked")}
    return out


def browser_timings(url: str, profile: Path) -> dict[str, float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        return _browse(driver, url)
    finally:
        driver.quit()


VIEWS = ("overview", "episodes", "episode", "sampling")
REPEATS = 5


def _reopen(driver: Any, url: str, view: str) -> list[float]:
    """Milliseconds from navigation start to the view drawn, by the page's own clock
    (``performance.now()`` when it sets ``data-ready``), for `REPEATS` fresh loads."""
    times = []
    for _ in range(REPEATS):
        driver.get("about:blank")
        driver.get(f"{url}#/{view}")
        _wait(lambda: driver.execute_script("return document.body.dataset.ready") == view)
        times.append(float(driver.execute_script("return document.body.dataset.readyMs")))
    return times


def _switch(driver: Any, url: str, view: str) -> list[float]:
    """Milliseconds from a click on the nav bar (a new ``#/view`` address: no page load) to
    the view drawn, by the page's clock, `REPEATS` times, each from another view."""
    js, times = driver.execute_script, []
    driver.get("about:blank")
    driver.get(f"{url}#/{view}")
    for _ in range(REPEATS):
        other = VIEWS[(VIEWS.index(view) + 1) % len(VIEWS)]
        js(f"location.hash = '#/{other}'")
        _wait(lambda o=other: js("return document.body.dataset.ready") == o)
        js("window.clickedAt = performance.now();"
           f"document.querySelector('nav a[data-nav={view}]').click();")
        _wait(lambda: js("return document.body.dataset.ready") == view)
        times.append(round(float(js("return document.body.dataset.readyMs - window.clickedAt")),
                           1))
    return times


FRAME_AT = ("const i = document.getElementById('frame');"
            "return i.complete && i.naturalWidth > 0 && i.dataset.t === '{t}';")
RENDERED = "return Number(document.body.dataset.renders || 0) > before{extra};"
IMAGES = (" && [...document.querySelectorAll('#batch-items img')]"
          ".every(m => m.complete && m.naturalWidth > 0)")
SCRUB = ("const s = document.getElementById('scrub');"
         "window.target = Math.floor(Number(s.max) * {f}); s.value = window.target;"
         "s.dispatchEvent(new Event('input'));")
# What a user does in each view: (name, the action, when the page has answered), as JS.
INTERACTIONS = {
    "episodes": [
        ("sort by return", "document.querySelector('th[data-key=return]').click()",
         RENDERED.format(extra="")),
        ("next page", "document.getElementById('next').click()", RENDERED.format(extra=""))],
    "episode": [
        ("step one frame (arrow key)",
         "document.dispatchEvent(new KeyboardEvent('keydown', {key: 'ArrowRight'}))",
         FRAME_AT.format(t=1)),
        ("scrub to the middle", SCRUB.format(f=0.5), FRAME_AT.format(t="' + window.target + '")),
        ("scrub to the end", SCRUB.format(f=1), FRAME_AT.format(t="' + window.target + '"))],
    "sampling": [
        ("draw a batch of 8", "document.getElementById('draw').click()",
         RENDERED.format(extra=IMAGES))],
}


def _in_page(driver: Any, act: str, done: str) -> float:
    """Milliseconds from `act` to `done` being true, both run and timed in the page
    (``performance.now()``; `done` is checked every millisecond)."""
    return round(float(driver.execute_async_script(
        "const finish = arguments[arguments.length - 1];"
        "const before = Number(document.body.dataset.renders || 0);"
        f"const start = performance.now(); {act};"
        f"const check = () => {{ {done} }};"
        "(function poll() { if (check()) finish(performance.now() - start);"
        " else setTimeout(poll, 1); })();")), 1)


def _wait(check: Callable[[], Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not answer in time")
        time.sleep(0.005)


def _browse(driver: Any, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    js = driver.execute_script

    def timed(name: str, act: Callable[[], None], done: Callable[[], Any]) -> None:
        start = time.perf_counter()
        act()
        _wait(done)
        out[name] = round((time.perf_counter() - start) * 1000, 1)

    for view in VIEWS:  # the first open of each view, on the fresh server
        driver.get("about:blank")
        timed(f"open {view}", lambda v=view: driver.get(f"{url}#/{v}"),
              lambda v=view: js("return document.body.dataset.ready") == v)
        out[f"open {view} (page clock)"] = float(js("return document.body.dataset.readyMs"))
    for view in VIEWS:
        out[f"open {view}, {REPEATS} more (page clock)"] = _reopen(driver, url, view)
    for view in VIEWS:
        out[f"switch to {view} from the nav bar (page clock)"] = _switch(driver, url, view)
    for view in VIEWS:
        driver.get("about:blank")
        driver.get(f"{url}#/{view}")
        _wait(lambda v=view: js("return document.body.dataset.ready") == v)
        for name, act, done in INTERACTIONS.get(view, ()):
            out[name] = _in_page(driver, act, done)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000, help="frames in the store")
    parser.add_argument("--envs", type=int, default=16, help="envs writing them")
    parser.add_argument("--store", type=Path, default=None,
                        help="reuse (or build once) the store here instead of a temp dir")
    parser.add_argument("--no-browser", action="store_true", help="HTTP figures only")
    parser.add_argument("--out", type=Path, default=Path("data/bench/viewer_large.json"))
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_viewer_"))
    path = args.store or tmp / "store"
    try:
        built = None if path.exists() else build_store(path, args.frames, args.envs)
        result = measure(path, args, tmp)
        result["build_s"] = None if built is None else round(built, 1)
        print(json.dumps(result, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(path: Path, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    start = time.perf_counter()
    server = make_server(path)
    started = time.perf_counter() - start
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        counts = server.data.status()
        result: dict[str, Any] = {
            "frames_kept": counts["frames_kept"], "episodes": counts["episodes"],
            "envs": args.envs, "machine": platform.machine(), "cpus": os.cpu_count(),
            "server_start_ms": round(started * 1000, 1),
            "load_average_at_start": [round(v, 2) for v in os.getloadavg()]}
        browser = not args.no_browser and Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()
        if browser:  # first, while the server may still be warming up, as a user would
            result["browser_ms"] = browser_timings(server.url, tmp / "profile")
            result["start_to_overview_ms"] = round(
                result["server_start_ms"] + result["browser_ms"]["open overview"], 1)
        result["http"] = http_timings(server)
        result["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
        return result
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
