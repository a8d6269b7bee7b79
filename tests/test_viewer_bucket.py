"""`mmreplay view URL`: a store read from object storage (``file://`` and SeaweedFS ``s3://``).

The viewer opens the bucket read-only, serves the same JSON and frames as for the local
store, lists the bucket's objects in the overview, follows a push of a new generation, and
says that the health check needs a directory.
"""

from __future__ import annotations

import io
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import S3Server  # noqa: E402
from test_viewer_server import get, get_json  # noqa: E402
from viewer_support import record_episodes, serving, small_store  # noqa: E402

from mmreplay.tools.steps import episode_frames, episode_steps  # noqa: E402

pytest_plugins = ["s3_server"]  # the fixtures s3, s3_proxy, s3_session


def check_served_like_the_store(url: str, local: Path) -> None:
    """Every endpoint the page uses answers for `url` as for the local store it came from;
    then a new generation pushed to the bucket reaches the page."""
    writer = small_store(local, [6, 20, 9], shard_chunks=4)
    try:
        writer.push(url)
        steps = episode_steps(writer, 1)
        frames = episode_frames(writer, 1)
        with serving(url) as server:  # type: ignore[arg-type]
            # the first answer waits for the warm-up (compiled read path, first frame)
            assert get(server, "/api/status", timeout=120)[0] == 200
            info = get_json(server, "/api/overview")
            assert info["path"] == url and info["url"] is True
            assert "manifest.json" in {e["name"] for e in info["entries"]}
            assert get_json(server, "/api/episodes")["total"] == 3
            ep = get_json(server, "/api/episode/1")
            assert ep["ids"] == steps.ids.tolist()
            code, kind, body = get(server, "/api/episode/1/frame/7.png")
            assert (code, kind) == (200, "image/png")
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(body))), frames[7])
            assert get_json(server, "/api/sampling?batch=4&seed=1")["batch"]["ids"]
            assert get_json(server, "/api/health?run=1")["state"] == "unavailable"
            before = get_json(server, "/api/status")["generation"]
            record_episodes(writer, [5], first_frame=200)
            writer.push(url)
            deadline = time.monotonic() + 30
            while (status := get_json(server, "/api/status"))["episodes"] != 4:
                assert time.monotonic() < deadline, status
                time.sleep(0.2)
            assert status["generation"] > before and status["follow_error"] is None
    finally:
        writer.close()


def test_view_a_file_url(tmp_path: Path) -> None:
    check_served_like_the_store(f"file://{tmp_path}/bucket", tmp_path / "local")


def test_view_an_s3_bucket(s3: S3Server, tmp_path: Path) -> None:
    check_served_like_the_store(s3.url(f"view-{uuid.uuid4().hex[:8]}"), tmp_path / "local")


def test_view_command_takes_a_url(tmp_path: Path) -> None:
    """`mmreplay view file://...` starts and names the URL (no file path from it)."""
    import subprocess

    url = f"file://{tmp_path}/bucket"
    writer = small_store(tmp_path / "local", [4, 3], shard_chunks=4)
    writer.push(url)
    writer.close()
    proc = subprocess.Popen([sys.executable, "-m", "mmreplay", "view", url, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith(f"serving {url} at http://127.0.0.1:"), line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])

        class Server:
            server_address: Any = ("127.0.0.1", port)

        assert json.loads(get(Server, "/api/status")[2])["episodes"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=20)
