"""How fast `mmreplay view` answers on a large store: server start, each endpoint, and (with
Chromium) each view and interaction as the browser sees them.

    python scripts/bench_viewer.py                        # 1M frames, 16 envs (~3 min to build)
    python scripts/bench_viewer.py --frames 20000 --no-browser

The store holds 84x84 synthetic frames (a moving block: they compress like Atari frames
do, well). Each endpoint is timed cold (first request of the generation: tables built,
frames decoded) and warm (cached). Browser figures: from navigation to the view drawn, and
from a click or key to the page redrawn (the frame decoded and shown, for the player).
The browser goes first, on the freshly started server (its first view may wait for the
warm-up, as a user's would). Figures only, one run; writes JSON (default
data/bench/viewer_large.json).
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
               "sampling + batch of 8": "/api/sampling?batch=8&seed=1"}
    out = {}
    for name, target in targets.items():
        times = []
        for _ in range(2):
            start = time.perf_counter()
            get(target)
            times.append(round((time.perf_counter() - start) * 1000, 1))
        out[name] = {"cold_ms": times[0], "warm_ms": times[1]}
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


def _wait(check: Callable[[], Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not answer in time")
        time.sleep(0.005)


def _browse(driver: Any, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    js = driver.execute_script
    renders = lambda: int(js("return document.body.dataset.renders || 0"))  # noqa: E731

    def timed(name: str, act: Callable[[], None], done: Callable[[], Any]) -> None:
        start = time.perf_counter()
        act()
        _wait(done)
        out[name] = round((time.perf_counter() - start) * 1000, 1)

    for view in ("overview", "episodes", "episode", "sampling"):
        driver.get("about:blank")
        timed(f"open {view}", lambda v=view: driver.get(f"{url}#/{v}"),
              lambda v=view: js("return document.body.dataset.ready") == v)
        if view == "episode":
            n = int(js("return document.getElementById('scrub').max"))
            for key, target in (("scrub to the middle", n // 2), ("scrub to the end", n)):
                timed(key, lambda t=target: js(
                    "const s = document.getElementById('scrub'); s.value = arguments[0];"
                    "s.dispatchEvent(new Event('input'));", t),
                    lambda t=target: js("const i = document.getElementById('frame');"
                                        "return i.complete && i.dataset.t === String(arguments[0])",
                                        t))
        if view == "episodes":
            for name, selector in (("sort by return", "th[data-key=return]"),
                                   ("next page", "#next")):
                before = renders()
                timed(name, lambda s=selector: js(f"document.querySelector('{s}').click()"),
                      lambda b=before: renders() > b)
        if view == "sampling":
            before = renders()
            timed("draw a batch of 8", lambda: js("document.getElementById('draw').click()"),
                  lambda b=before: renders() > b and js(
                      "return [...document.querySelectorAll('#batch-items img')]"
                      ".every(m => m.complete)"))
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
            "server_start_ms": round(started * 1000, 1)}
        browser = not args.no_browser and Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()
        if browser:  # first, while the server may still be warming up, as a user would
            result["browser_ms"] = browser_timings(server.url, tmp / "profile")
            result["start_to_overview_ms"] = round(
                result["server_start_ms"] + result["browser_ms"]["open overview"], 1)
        result["http"] = http_timings(server)
        return result
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
