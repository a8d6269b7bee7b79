"""The viewer's server without a browser: endpoints against `inspection`, pagination,
sorting and filters, errors as JSON with the right status, hostile and changing stores,
and the ``mmreplay view`` command."""

from __future__ import annotations

import http.client
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_stores import save_manifest
from PIL import Image
from script_runner import run_here
from viewer_support import OBS, frame, record_episodes, serving, small_store

from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError
from mmreplay.tools import inspection as ins
from mmreplay.tools.distributions import sampling_view
from mmreplay.tools.images import tile
from mmreplay.tools.steps import episode_frames, episode_steps, transition
from mmreplay.tools.view import make_server
from mmreplay.tools.view.data import StoreData

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [6, 20, 9, 3, 14, 7, 11]


def get(server: Any, target: str, method: str = "GET",
        timeout: float = 60.0) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=timeout)
    try:
        conn.request(method, target)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        conn.close()


def get_json(server: Any, target: str, status: int = 200) -> Any:
    code, kind, body = get(server, target)
    assert (code, kind) == (status, "application/json"), (target, code, body[:300])
    return json.loads(body)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("viewer-server") / "store"
    _with_extras(path)
    return path


def _with_extras(path: Path) -> None:
    """A prioritized store with a scalar extra, 64 slots (the oldest episodes evicted)."""
    store = ReplayStore.create(path, capacity=64, obs_shape=OBS, frame_stack=4, n_step=2,
                               seed=0, chunk_frames=8, sampler="prioritized",
                               extras={"logp": ((), np.float32)})
    n = 0
    for e, steps in enumerate(LENGTHS):
        store.reset(frame(n))
        for t in range(steps):
            n += 1
            store.add(t % 4, float(e + 1), frame(n), t == steps - 1, False,
                      extras={"logp": np.float32(-0.5 * t)})
        n += 1
    ids = store.valid_ids()
    store.update_priorities(ids, 1.0 + (ids % 5))
    store.close()


@pytest.fixture(scope="module")
def server(store_path: Path) -> Any:
    with serving(store_path) as srv:
        yield srv


# -- endpoints against inspection ----------------------------------------------------------
def test_status_and_overview(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        counts, info = store.counts, ins.store_info(store)
    status = get_json(server, "/api/status")
    assert status["generation"] == info.generation and status["follow_error"] is None
    assert status["episodes"] == counts.episodes == len(LENGTHS)
    assert status["sampleable"] == counts.sampleable
    overview = get_json(server, "/api/overview")
    assert overview["counts"]["frames_kept"] == counts.frames_kept == 64
    assert overview["spec"]["extras"] and overview["images"] is True
    names = {e["name"]: e for e in overview["entries"]}
    assert names["manifest.json"]["bytes"] == (store_path / "manifest.json").stat().st_size
    assert names["frames/"]["files"] >= 2


def test_episode_pages_sort_and_filter(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        rows = ins.episode_table(store)
    everything = get_json(server, "/api/episodes?limit=500")
    assert everything["total"] == len(rows) and [r["episode"] for r in everything["rows"]] == \
        [r.episode for r in rows]
    pages = [get_json(server, f"/api/episodes?limit=2&offset={o}&sort=return&order=desc")
             for o in range(0, len(rows), 2)]
    by_return = [r["episode"] for p in pages for r in p["rows"]]
    assert by_return == [r.episode for r in ins.sort_episodes(rows, "return")]
    assert all(len(p["rows"]) <= 2 for p in pages)
    by_length = get_json(server, "/api/episodes?sort=length")["rows"]
    assert [r["length"] for r in by_length] == sorted(r.length for r in rows)
    partial = get_json(server, "/api/episodes?kept=partial")
    assert partial["matching"] == sum(not r.fully_kept for r in rows) >= 1
    running = get_json(server, "/api/episodes?status=terminated&env=0")
    assert running["matching"] == sum(r.status == "terminated" for r in rows)
    beyond = get_json(server, "/api/episodes?offset=1000")
    assert beyond["rows"] == [] and beyond["total"] == len(rows)


def test_series_has_ended_episodes(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        ended = [r for r in ins.episode_table(store) if r.status != "running"]
    series = get_json(server, "/api/series")
    assert series["bucket"] == 1 and series["episode"] == [r.episode for r in ended]
    assert series["return"] == [r.episode_return for r in ended]


def test_episode_steps_and_frames(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        steps = episode_steps(store, 5)
        frames = episode_frames(store, 5)
    ep = get_json(server, "/api/episode/5")
    assert ep["frames"] == len(frames) == LENGTHS[5] + 1
    assert ep["ids"] == steps.ids.tolist() and ep["ids"][-1] == -1
    assert ep["reward"][:-1] == [6.0] * LENGTHS[5] and ep["terminated"][-2] is True
    assert ep["extras"]["logp"]["values"][:3] == [0.0, -0.5, -1.0]
    assert ep["priority"][-1] is None and ep["priority"][0] == 1.0 + steps.ids[0] % 5
    for t in (0, 3, len(frames) - 1):
        code, kind, body = get(server, f"/api/episode/5/frame/{t}.png")
        assert (code, kind) == (200, "image/png")
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(body))), frames[t])


def test_episode_discount_and_n_step_return_match_the_store(tmp_path: Path) -> None:
    """Per-step discount and n-step return, as a batch holds them (``ReplayStore.get``), for
    episodes ending terminated, truncated and still running, some partly evicted."""
    path = tmp_path / "nstep"
    with ReplayStore.create(path, capacity=48, obs_shape=OBS, n_step=3, gamma=0.9,
                            frame_stack=2, chunk_frames=8) as store:
        n = 0
        for e, (steps, how) in enumerate([(9, "term"), (4, "trunc"), (2, "term"), (13, "trunc"),
                                          (7, "term"), (5, "running")]):
            store.reset(frame(n))
            for t in range(steps):
                n += 1
                last = t == steps - 1
                store.add(0, float(t + e), frame(n), last and how == "term",
                          last and how == "trunc")
            n += 1
        store.flush()
        rows = ins.episode_table(store)
        checked = 0
        with serving(path) as srv:
            for row in rows:
                ep = get_json(srv, f"/api/episode/{row.episode}")
                ids = np.asarray(ep["ids"])
                ok = np.asarray(ep["sampleable"]) & (ids >= 0)
                assert [v is None for v in ep["discount"]] == (~ok).tolist()
                if ok.any():
                    batch = store.get(ids[ok])
                    got = np.asarray(ep["discount"], dtype=np.float64)[ok]
                    assert np.allclose(got, batch.discount.numpy())
                    assert np.allclose(np.asarray(ep["n_step_return"], np.float64)[ok],
                                       batch.reward.numpy())
                    checked += int(ok.sum())
        assert checked > 20 and {r.status for r in rows} >= {"terminated", "truncated",
                                                             "running"}


def test_transition_stacks_and_gif(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        tid = int(store.valid_ids()[-3])
        view = transition(store, tid)
    fields = get_json(server, f"/api/transition/{tid}")
    assert fields["id"] == tid and fields["reward"] == pytest.approx(view.reward)
    for which, stack in (("obs", view.obs), ("next", view.next_obs)):
        code, _, body = get(server, f"/api/transition/{tid}/{which}.png")
        image = np.asarray(Image.open(io.BytesIO(body)))
        assert code == 200 and np.array_equal(image, tile(stack, cols=4))
    code, kind, body = get(server, "/api/episode/6.gif?fps=10&scale=2")
    gif = Image.open(io.BytesIO(body))
    assert (code, kind) == (200, "image/gif") and gif.size == (OBS[1] * 2, OBS[0] * 2)


def decode_mp4(body: bytes) -> tuple[np.ndarray, Any]:
    """Every frame of an MP4 as RGB ``(N, H, W, 3)``, and its video stream's codec context."""
    import av

    with av.open(io.BytesIO(body)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        return np.stack(frames), container.streams.video[0].codec_context


@pytest.mark.parametrize("episode", [5, 6])
def test_episode_mp4_decodes_to_the_store_s_frames(server: Any, store_path: Path,
                                                   episode: int) -> None:
    with ins.open_readonly(store_path) as store:
        want = episode_frames(store, episode).astype(np.int64)
    big = want.repeat(2, axis=1).repeat(2, axis=2)[..., None]  # scale=2, gray in each channel
    code, kind, body = get(server, f"/api/episode/{episode}.mp4?fps=10&scale=2&lossless=1")
    frames, codec = decode_mp4(body)
    assert (code, kind, codec.name) == (200, "video/mp4", "h264")
    assert frames.shape == (len(want), OBS[0] * 2, OBS[1] * 2, 3)
    assert np.array_equal(frames, np.broadcast_to(big, frames.shape))  # lossless: exact
    code, kind, body = get(server, f"/api/episode/{episode}.mp4?fps=10&scale=2")
    frames, codec = decode_mp4(body)  # the default: yuv420p, which browsers play; lossy
    assert (code, codec.pix_fmt, frames.shape[0]) == (200, "yuv420p", len(want))
    error = np.abs(frames.astype(np.int64) - big)
    assert error.mean() < 4 and np.percentile(error, 99) < 24, (error.mean(), error.max())
    others = np.roll(big, 1, axis=0)  # each frame against its neighbour: far off
    assert np.abs(frames.astype(np.int64) - others).mean() > 4 * error.mean() + 10


def wait_health(srv: Any, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = get_json(srv, "/api/health")
        if state["state"] != "running":
            return state  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def corrupt_a_chunk(root: Path) -> str:
    """Flip one byte in the middle of the largest frame chunk file; returns its name."""
    victim = max((p for p in (root / "frames").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim.name


def test_health_runs_verify_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "good"
    small_store(path, [6, 20, 9, 30]).close()
    with serving(path) as srv:
        assert get_json(srv, "/api/health")["state"] == "never"  # nothing runs unasked
        started = get_json(srv, "/api/health?run=1")
        assert started["state"] in ("running", "done")
        done = wait_health(srv)
        report = done["report"]
        assert done["state"] == "done" and report["ok"] and report["problems"] == []
        assert report["chunks_checked"] > 0 and report["generation"] == done["generation"]
        again = get_json(srv, "/api/health?run=1")  # same generation: the same result
        assert again["state"] == "done" and again["elapsed_s"] == done["elapsed_s"]
    name = corrupt_a_chunk(path)
    with serving(path) as srv:  # the viewer opens it (frames are read lazily) ...
        get_json(srv, "/api/health?run=1")
        done = wait_health(srv)  # ... and verify finds the damage
        assert done["state"] == "done" and not done["report"]["ok"]
        assert any(name in p for p in done["report"]["problems"]), done["report"]["problems"]


def test_health_run_stops_at_its_time_limit(tmp_path: Path) -> None:
    path = tmp_path / "slow"
    small_store(path, [60] * 8, capacity=1024).close()
    server = make_server(path, verify_limit_s=0.0)
    try:
        server.data.health.run()
        deadline = time.monotonic() + 60
        while (state := server.data.health.state())["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert state["state"] == "stopped" and "time limit" in state["error"]
        assert state["chunks_done"] < state["chunks_total"]
    finally:
        server.server_close()


def test_sampling_view_and_batch(server: Any, store_path: Path) -> None:
    with ins.open_readonly(store_path) as store:
        view = sampling_view(store)
    s = get_json(server, "/api/sampling?batch=5&seed=3&beta=0.5")
    p = view.probabilities
    assert s["sampleable"] == view.ids.size and s["sampler"] == "prioritized"
    assert s["effective_sample_size"] == pytest.approx(1 / np.square(p).sum())
    assert s["effective_sample_size"] < view.ids.size  # priorities differ
    assert sum(s["ages"]["probability"]) == pytest.approx(1.0)
    assert len(s["batch"]["ids"]) == 5 and set(s["batch"]["ids"]) <= set(view.ids.tolist())
    again = get_json(server, "/api/sampling?batch=5&seed=3&beta=0.5")
    assert again["batch"] == s["batch"]  # a seed repeats the draw
    weights = np.asarray(s["batch"]["weights"])
    assert ((weights > 0) & (weights <= 1)).all()
    code, _, _ = get(server, f"/api/transition/{s['batch']['ids'][0]}/obs.png")
    assert code == 200


def test_probabilities_of_a_uniform_store(tmp_path: Path) -> None:
    small_store(tmp_path / "u", [5, 5]).close()
    with ins.open_readonly(tmp_path / "u") as store:
        view = sampling_view(store)
    assert view.probabilities == pytest.approx(np.full(view.ids.size, 1 / view.ids.size))
    assert view.effective_sample_size == pytest.approx(view.ids.size)


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("target", "status", "says"), [
    ("/api/episode/99", 404, "episode 99 has no kept frame"),
    ("/api/episode/0", 404, "episode 0 has no kept frame"),  # evicted
    ("/api/episode/5/frame/99.png", 404, "frame 99"),
    ("/api/transition/0", 404, "not (or no longer) sampleable"),
    ("/api/transition/99999/obs.png", 404, "not (or no longer) sampleable"),
    ("/api/episodes?limit=0", 400, "limit must be in 1..500, got 0"),
    ("/api/episodes?limit=x", 400, "limit must be an integer"),
    ("/api/episodes?sort=nope", 400, "sort must be one of"),
    ("/api/episodes?status=lost", 400, "status must be one of"),
    ("/api/sampling?batch=1000", 400, "batch must be in 1..64"),
    ("/api/sampling?beta=abc", 400, "beta must be a number"),
    ("/api/sampling?beta=-1", 400, "beta"),
    ("/api/episode/5.gif?fps=0", 400, "fps must be in 1..60"),
    ("/api/episode/5.mp4?lossless=2", 400, "lossless must be in 0..1"),
    ("/api/episode/99.mp4", 404, "episode 99"),
    ("/api/nothing", 404, "no such endpoint"),
    ("/api/episode/-1", 404, "no such endpoint"),
    ("/api/episode/99999999999999999999", 404, "no such endpoint"),
])
def test_errors_are_json_with_a_status(server: Any, target: str, status: int,
                                       says: str) -> None:
    assert says in get_json(server, target, status)["error"]


@pytest.mark.parametrize(("host", "status"), [
    ("evil.example", 403), ("evil.example:{port}", 403), ("127.0.0.1:1", 403), ("", 403),
    ("127.0.0.1:{port}", 200), ("localhost:{port}", 200), ("LOCALHOST:{port}", 200)])
def test_only_this_machine_s_names_are_answered(server: Any, host: str, status: int) -> None:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        conn.putrequest("GET", "/api/status", skip_host=True)
        if host:
            conn.putheader("Host", host.format(port=server.server_address[1]))
        conn.endheaders()
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == status, body[:200]
    assert (b"generation" in body) == (status == 200)


def test_too_many_query_parameters_is_a_bad_request(server: Any) -> None:
    target = "/api/episodes?" + "&".join(f"k{i}=1" for i in range(40))
    assert "at most 32" in get_json(server, target, 400)["error"]


def test_methods_and_static(server: Any) -> None:
    code, kind, body = get(server, "/")
    assert code == 200 and kind.startswith("text/html") and b"/static/app.js" in body
    code, kind, body = get(server, "/static/app.js")
    assert code == 200 and kind.startswith("text/javascript") and b"use strict" in body
    assert get(server, "/static/app.js", "HEAD")[::2] == (200, b"")
    assert get(server, "/api/status", "POST")[0] == 501
    assert get(server, "/api/status", "DELETE")[0] == 501


def test_static_files_ship_with_the_package() -> None:
    from mmreplay.tools.view.server import load_static

    static = load_static()
    assert {"index.html", "app.js", "style.css"} <= set(static)
    text = static["index.html"][1].decode() + static["app.js"][1].decode()
    assert "http://" not in text.replace("http://127", "") and "https://" not in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"mmreplay.tools.view" = ["static/*"]' in pyproject


def test_vector_store_serves_no_frames(tmp_path: Path) -> None:
    path = tmp_path / "vec"
    with ReplayStore.create(path, capacity=32, obs_shape=(4,), obs_dtype=np.float32) as store:
        store.reset(np.zeros(4, np.float32))
        for t in range(5):
            store.add(0, 1.0, np.full(4, t, np.float32), t == 4, False)
    with serving(path) as srv:
        ep = get_json(srv, "/api/episode/0")
        assert ep["images"] is False and ep["frames"] == 6
        assert "are not images" in get_json(srv, "/api/episode/0/frame/0.png", 400)["error"]
        assert get_json(srv, "/api/overview")["images"] is False


# -- hostile and changing stores ----------------------------------------------------------------
def test_not_a_store_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")
    with pytest.raises(InvalidStoreError):
        make_server(tmp_path / "junk")


def test_damage_after_start_keeps_the_last_generation(tmp_path: Path) -> None:
    path = tmp_path / "s"
    writer = small_store(path, [4, 4])
    with serving(path) as srv:
        before = get_json(srv, "/api/status")
        record_episodes(writer, [3], first_frame=50)
        writer.flush()
        assert get_json(srv, "/api/status")["episodes"] == 3  # followed
        manifest = path / "manifest.json"
        good = manifest.read_bytes()
        body = json.loads(good)
        body["generation"] += 1
        name = sorted(body["files"])[0]
        body["files"][name] = (body["files"][name] + 1) % (1 << 32)
        save_manifest(path, body)  # a newer manifest whose file checksum is wrong
        status = get_json(srv, "/api/status")
        assert status["episodes"] == 3 and status["generation"] == before["generation"] + 1
        assert f"generation {body['generation']}: " in status["follow_error"]
        assert get_json(srv, "/api/episodes")["total"] == 3  # still served
        manifest.write_bytes(good[:len(good) // 2])  # half a manifest
        status = get_json(srv, "/api/status")
        assert "cannot be read" in status["follow_error"] and status["episodes"] == 3
        manifest.write_bytes(good)
        assert get_json(srv, "/api/status")["follow_error"] is None
    writer.close()


def test_store_removed_under_the_server_answers_with_errors(tmp_path: Path) -> None:
    path = tmp_path / "gone"
    small_store(path, [40, 40]).close()
    with serving(path) as srv:
        get_json(srv, "/api/status")
        shutil.rmtree(path)
        for target in ("/api/overview", "/api/episode/1", "/api/episode/1/frame/2.png",
                       "/api/sampling?batch=4"):  # the generation it holds, or an error
            code, kind, body = get(srv, target)
            assert code == 200 or (code == 500 and json.loads(body)["error"]), target
        get_json(srv, "/api/health?run=1")
        assert wait_health(srv)["state"] == "failed"  # verify: no store there any more
        status = get_json(srv, "/api/status")  # the generation it has, and why it stays
        assert "cannot be read" in status["follow_error"]


def test_store_data_caches_per_generation(tmp_path: Path) -> None:
    path = tmp_path / "s"
    writer = small_store(path, [4])
    data = StoreData(path)
    try:
        first = data.episodes({})
        assert data.episodes({}) == first
        png = data.frame_png(0, 1)
        assert data.frame_png(0, 1) is png  # cached
        table = data.cached("table", lambda s: None)
        for i in range(300):  # more per-item entries than any cache holds
            data.cached(("episode-like", i), lambda s, i=i: i, item=True)
        assert data.cached("table", lambda s: None) is table  # items never evict the table
        record_episodes(writer, [2], first_frame=10)
        writer.flush()
        assert data.episodes({})["total"] == 2 and data.frame_png(0, 1) is not png
    finally:
        data.close()
        writer.close()


# -- the command ---------------------------------------------------------------------------------
@pytest.mark.integration
def test_view_command_prints_the_url_and_serves(store_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "mmreplay.tools.cli", "view", str(store_path),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("serving ") and "http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/api/status")
        assert json.loads(conn.getresponse().read())["episodes"] == len(LENGTHS)
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.integration
def test_view_command_on_a_missing_store_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "mmreplay.tools.cli", "view",
                          str(tmp_path / "none")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("mmreplay: error:")


@pytest.mark.integration
def test_bench_viewer_script_smoke(tmp_path: Path) -> None:
    out = tmp_path / "viewer.json"
    proc = run_here("bench/bench_viewer.py", "--frames", "2000", "--envs", "2", "--no-browser",
                    "--out", str(out))  # in this process: the figures it writes are checked
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["frames_kept"] == 2000 and figures["episodes"] >= 2
    assert set(figures["http"]) >= {"status", "episodes page (sorted by return)", "frame png"}
    timed = [v for k, v in figures["http"].items() if not k.startswith("health")]
    assert all(v["cold_ms"] > 0 and v["warm_ms"] > 0 for v in timed)
    health = figures["http"]["health: verify the whole store"]
    assert health["state"] == "done" and health["ok"] is True and health["chunks"] > 0
    assert len(figures["load_average_at_start"]) == 3
