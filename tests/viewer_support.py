"""Shared parts of the viewer tests: a small store whose frames say their own number, a
served viewer (a thread, always stopped), and headless Chromium (Debian's, via selenium).

Chromium is a system package: without it the browser tests skip with the install command,
and under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmreplay import ReplayStore
from mmreplay.tools.view import ViewerServer, make_server

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900", "--hide-scrollbars")
OBS = (12, 16)


def frame(n: int) -> np.ndarray:
    """Frame number `n`: distinct rows and columns, so a wrong or shifted frame shows."""
    rows = np.arange(OBS[0], dtype=np.int64)[:, None]
    cols = np.arange(OBS[1], dtype=np.int64)[None, :]
    return ((n * 37 + rows * 11 + cols * 5) % 251).astype(np.uint8)


def record_episodes(store: ReplayStore, lengths: list[int], *, first_frame: int = 0) -> int:
    """Episodes of these lengths (episode e's rewards are e + 1, the last step terminates);
    returns the next frame number."""
    n = first_frame
    for e, steps in enumerate(lengths):
        store.reset(frame(n))
        for t in range(steps):
            n += 1
            store.add(t % 4, float(e + 1), frame(n), t == steps - 1, False)
        n += 1
    return n


def small_store(path: Path, lengths: list[int], **kw: Any) -> ReplayStore:
    store = ReplayStore.create(path, capacity=kw.pop("capacity", 512), obs_shape=OBS,
                               frame_stack=4, n_step=2, seed=0, chunk_frames=8, **kw)
    record_episodes(store, lengths)
    store.flush()
    return store


@contextmanager
def serving(path: Path) -> Iterator[ViewerServer]:
    """A viewer of `path` on a free port of 127.0.0.1, stopped and closed on exit."""
    server = make_server(path, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def require_chromium() -> None:
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return
    message = f"the browser tests need Chromium and its driver: {INSTALL}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A headless Chromium with a fresh profile, its console log readable, always quit."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or CHROMEDRIVER),
                              options=options)
    try:
        driver.set_page_load_timeout(30)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()
