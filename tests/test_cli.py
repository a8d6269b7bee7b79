"""The `mmreplay` command: every subcommand on tiny stores, damage found by `verify`, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from conftest import frame
from PIL import Image

from mmreplay import ReplayStore
from mmreplay.storage.manifest import write_manifest
from mmreplay.tools import render, show_labels
from mmreplay.tools import verify as verify_mod
from mmreplay.tools.cli import main
from mmreplay.tools.plots import plot_store
from mmreplay.tools.steps import episode_steps, transition
from mmreplay.tools.verify import disk_chunks

OBS = (8, 8)
K, N = 4, 3  # frame_stack, n_step
CAPACITY = 40
CHUNK = 4
# (steps, end) per episode; reward of every step of episode e is e + 1
EPISODES = ((6, "terminated"), (9, "truncated"), (5, "terminated"), (12, "truncated"),
            (8, "running"))


@dataclass(frozen=True)
class Recorded:
    """What the test recorded: the reference the command's output must match."""

    path: Path
    first_frame: tuple[int, ...]  # frame number of each episode's o_0
    first_id: tuple[int, ...]


def record(path: Path, **kw: object) -> Recorded:
    """Five episodes, 45 frames into 40 slots: episode 0 is partly evicted.

    A file per chunk unless `shard_chunks` says otherwise, so tests can damage a chunk by name.
    """
    kw.setdefault("shard_chunks", 1)
    store = ReplayStore.create(path, capacity=CAPACITY, obs_shape=OBS, frame_stack=K, n_step=N,
                               seed=0, chunk_frames=CHUNK, block_slots=8, **kw)
    n, tid, firsts, ids = 0, 0, [], []
    for e, (steps, end) in enumerate(EPISODES):
        firsts.append(n)
        ids.append(tid)
        store.reset(frame(n, OBS))
        for t in range(steps):
            n, tid = n + 1, tid + 1
            last = t == steps - 1
            store.add(t % 3, e + 1.0, frame(n, OBS), last and end == "terminated",
                      last and end == "truncated")
        n += 1
    store.close()
    return Recorded(path, tuple(firsts), tuple(ids))


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    return record(tmp_path_factory.mktemp("cli") / "store")


@pytest.fixture
def fresh(tmp_path: Path) -> Recorded:
    """A store of its own, for tests that damage it."""
    return record(tmp_path / "store")


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- info ----------------------------------------------------------------------------------
def test_info_json_numbers(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "info", rec.path, "--json")
    assert code == 0
    info = json.loads(out)
    with ReplayStore.open(rec.path, mode="r") as store:
        sampleable = len(store)
    assert info["counts"] == {"frames_written": 45, "frames_kept": CAPACITY,
                              "transitions": sum(s for s, _ in EPISODES), "episodes": 5,
                              "sampleable": sampleable}
    assert info["episodes_running"] == 1 and info["sampler"] == "uniform"
    assert info["format_version"] == 1 and info["generation"] >= 1
    assert info["spec"]["frame_stack"] == K and info["spec"]["obs_shape"] == list(OBS)
    disk = info["disk"]
    assert disk["frames_in_tail"] == 45 % CHUNK
    assert disk["frames_in_chunks"] + disk["frames_in_tail"] == CAPACITY
    frames_dir = sum(p.stat().st_size for p in (rec.path / "frames").rglob("*") if p.is_file())
    assert disk["frames_bytes"] == frames_dir
    all_files = sum(p.stat().st_size for p in rec.path.rglob("*") if p.is_file())
    assert disk["total_bytes"] == all_files
    assert disk["compression_ratio"] == pytest.approx(CAPACITY * 64 / all_files)
    ram = info["ram"]
    assert ram["steps_bytes"] > 0 and ram["tail_bytes"] == CHUNK * 64
    assert ram["total_bytes"] == sum(ram[k] for k in ("steps_bytes", "masks_bytes",
                                                      "sampler_bytes", "tail_bytes"))
    assert info["priorities"] is None


def test_info_text(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "info", rec.path)
    assert code == 0 and err == ""
    assert "frames written  45" in out and "episodes        5 (1 running)" in out
    assert "compression" in out and "mmreplay v1" in out


def test_info_prioritized_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path / "p", sampler="prioritized").path
    with ReplayStore.open(path) as store:
        ids = store.valid_ids()
        store.update_priorities(ids, np.arange(1, ids.size + 1) / 4)
    code, out, _ = run(capsys, "info", path, "--json")
    stats = json.loads(out)["priorities"]
    assert code == 0 and stats["count"] == ids.size
    assert stats["min"] == 0.25 and stats["max"] == ids.size / 4
    assert stats["mean"] == pytest.approx((ids.size + 1) / 8)
    assert "priority mean" in run(capsys, "info", path)[1]
    code, out, _ = run(capsys, "plot", path, "--out", tmp_path / "p.png")
    assert code == 0 and "priority" in out


# -- episodes ------------------------------------------------------------------------------
def test_episodes_match_recording(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "episodes", rec.path, "--json")
    rows = json.loads(out)
    assert code == 0 and [r["episode"] for r in rows] == [0, 1, 2, 3, 4]
    for r, (steps, end), first_id in zip(rows, EPISODES, rec.first_id, strict=True):
        assert (r["env"], r["length"], r["status"]) == (0, steps, end)
        if r["episode"] > 0:
            assert r["fully_kept"] and r["first_id"] == first_id
            assert r["last_id"] == first_id + steps - 1
            assert r["episode_return"] == steps * (r["episode"] + 1)
    evicted = 45 - CAPACITY  # frames 0..4 are gone: episode 0 keeps its steps at frames 5
    assert not rows[0]["fully_kept"] and rows[0]["kept_steps"] == EPISODES[0][0] - evicted
    assert rows[0]["first_id"] == evicted and rows[0]["last_id"] == EPISODES[0][0] - 1


def test_episodes_sort_limit_and_table(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "episodes", rec.path, "--sort", "return", "--json")
    assert [r["episode"] for r in json.loads(out)] == [3, 4, 1, 2, 0]  # returns 48 40 18 15 1
    _, out, _ = run(capsys, "episodes", rec.path, "--sort", "length", "--limit", "2", "--json")
    assert [r["episode"] for r in json.loads(out)] == [3, 1]
    code, out, _ = run(capsys, "episodes", rec.path)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["env", "episode", "first_id", "last_id", "length",
                                              "return", "status", "kept"]
    assert len(lines) == 2 + 5 + 1 and lines[-1].startswith("5 of 5 episodes")
    assert len({len(line) for line in lines[1:3]}) == 1  # header rule spans the columns
    assert lines[2 + 4].split() == ["0", "4", "32", "39", "8", "40", "running", "yes"]


# -- show ----------------------------------------------------------------------------------
def test_show_transition_png(rec: Recorded, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    out_file, scale, gap = tmp_path / "t.png", 3, 2
    tid = rec.first_id[3] + 1  # episode 3, step 1: stack = [0, 0, o_0, o_1]
    code, out, _ = run(capsys, "show", rec.path, tid, "--out", out_file, "--scale", scale,
                       "--no-labels")
    assert code == 0 and str(out_file) in out
    image = np.asarray(Image.open(out_file))
    cell = OBS[0] * scale
    assert image.shape == (2 * cell + gap, K * cell + (K - 1) * gap)
    f0 = rec.first_frame[3]
    want = [[0, 0, f0, f0 + 1], [f0 + 1, f0 + 2, f0 + 3, f0 + 4]]  # obs; next_obs (n=3)
    for row in range(2):
        for col in range(K):
            y, x = row * (cell + gap), col * (cell + gap)
            assert (image[y:y + cell, x:x + cell] == want[row][col]).all(), (row, col)


def test_show_default_name_and_episode_gif(rec: Recorded, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "show", rec.path, rec.first_id[2])[0] == 0
    assert Image.open(tmp_path / f"transition_{rec.first_id[2]}.png").format == "PNG"
    code, out, _ = run(capsys, "show", rec.path, "--episode", 3, "--gif", "--scale", 2)
    gif = Image.open(tmp_path / "episode_3.gif")
    assert code == 0 and gif.format == "GIF" and gif.size == (16, 16)
    assert gif.n_frames == EPISODES[3][0] + 1
    assert run(capsys, "show", rec.path, "--episode", 1, "--no-labels")[0] == 0
    assert Image.open(tmp_path / "episode_1.png").size == (10 * 8 + 9 * 2, 8)


def test_show_labels_each_frame_at_a_readable_size(rec: Recorded, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "t.png"
    tid = rec.first_id[3] + 1  # episode 3, step 1: stack = [0, 0, o_0, o_1]
    code, out, _ = run(capsys, "show", rec.path, tid, "--out", out_file)
    image = np.asarray(Image.open(out_file).convert("RGB"))
    side = render.default_scale(*OBS) * OBS[0]
    assert code == 0 and side >= 160 and image.shape[1] > K * side
    f0 = rec.first_frame[3]
    want = [0, 0, f0, f0 + 1, f0 + 1, f0 + 2, f0 + 3, f0 + 4]  # obs; next_obs (n=3)
    top = render.PAD + render.LINE_PX + render.PAD  # below the title
    cell = (side + 2 * render.LINE_PX, side)
    for i, value in enumerate(want):
        x, y = render.cell_origin(i, cols=K, cell=cell, top=top)
        assert (image[y:y + side, x:x + side] == value).all(), i
        label = image[y + side:y + side + render.LINE_PX, x:x + side]
        assert (label != render.BACKGROUND).any(), f"frame {i} has no label"
    assert (image[:top - render.PAD, :200] != render.BACKGROUND).any(), "no title"
    with ReplayStore.open(rec.path, mode="r") as store:
        labels = show_labels.transition_labels(transition(store, tid), store.spec)
    n_step_return = 4 * (1 + 0.99 + 0.99 ** 2)  # episode 3's rewards are 4, n_step 3
    assert labels[3] == ["obs[3]  t", f"id {tid}  a 1  R3 {n_step_return:.4g}"]
    assert labels[7] == ["next[3]  t+3", ""]


def test_show_episode_labels_steps(rec: Recorded, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "e.png"
    code, _, _ = run(capsys, "show", rec.path, "--episode", 2, "--out", out_file)
    image = Image.open(out_file)
    side = render.default_scale(*OBS) * OBS[0]
    assert code == 0 and image.width >= 6 * side and image.height >= side
    with ReplayStore.open(rec.path, mode="r") as store:
        labels = show_labels.episode_labels(episode_steps(store, 2))
    assert labels[0] == ["t=0  id " + str(rec.first_id[2]), "a 0  r 3"]
    assert labels[EPISODES[2][0] - 1][1].endswith("terminated")
    assert labels[-1] == [f"t={EPISODES[2][0]}", "no step (last)"]


def test_show_refuses_a_vector_store(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "vec"
    with ReplayStore.create(path, capacity=16, obs_shape=(4,), obs_dtype=np.float32) as store:
        store.reset(np.zeros(4, np.float32))
        for t in range(3):
            store.add(0, 1.0, np.full(4, t, np.float32), t == 2, False)
    monkeypatch.chdir(tmp_path)
    for argv in (("show", path, 0), ("show", path, "--episode", 0),
                 ("show", path, "--episode", 0, "--gif")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert "shape (4,), which are not images" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vec"]  # nothing written


# -- plot, sample --------------------------------------------------------------------------
def test_plot_writes_png(rec: Recorded, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plot.png"
    code, out, _ = run(capsys, "plot", rec.path, "--out", target)
    assert code == 0 and "reward" in out and "priority" not in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Image.open(target).width > 100


def test_plot_has_no_empty_panel_and_the_sampler_view(rec: Recorded) -> None:
    with ReplayStore.open(rec.path, mode="r") as store:
        result = plot_store(store)
    axes = result.figure.axes
    assert len(axes) == len(result.drawn) == 5 and result.skipped == ()
    assert result.drawn[0].startswith("P(draw) over the ring") and "age" in result.drawn[1]
    for ax, title in zip(axes, result.drawn, strict=True):
        assert ax.get_title() == title and (ax.patches or ax.lines), title
    widths = [ax.get_position().width for ax in axes]
    assert widths[-1] > 1.8 * widths[0]  # the odd last panel spans the row


def test_plot_leaves_out_panels_without_data(tmp_path: Path) -> None:
    path = tmp_path / "p"
    with ReplayStore.create(path, capacity=16, obs_shape=OBS, sampler="prioritized") as store:
        store.reset(frame(0, OBS))
        for t in range(4):
            store.add(0, 1.0, frame(t + 1, OBS), False, False)  # one running episode
    with ReplayStore.open(path, mode="r") as store:
        result = plot_store(store)
    assert result.skipped == ("episode length (complete episodes)",
                              "episode return (complete episodes)")
    assert [t.split(" (")[0].split(",")[0] for t in result.drawn] == \
        ["P(draw) over the ring by id", "age of a drawn transition", "priority",
         "per-step reward"]
    assert len(result.figure.axes) == 4 and all(ax.patches or ax.lines
                                                for ax in result.figure.axes)


def test_sample_prints_shapes(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "sample", rec.path, "--batch-size", 5, "--seed", 1)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert code == 0 and rows["obs"][1:3] == ["(5,", "4,"] and rows["obs"][5] == "uint8"
    assert rows["reward"][1:3] == ["(5,)", "float32"] and rows["ids"][2] == "int64"
    assert set(rows) == {"obs", "action", "reward", "next_obs", "terminated", "truncated",
                         "discount", "weights", "ids", "steps"}
    assert run(capsys, "sample", rec.path, "--batch-size", 5, "--seed", 1)[1] == out


# -- verify --------------------------------------------------------------------------------
def test_verify_sound_store(rec: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", rec.path)
    assert code == 0, out
    assert out.splitlines()[0] == "ok" and "sampleable" in out and err == ""


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _kept_chunk(path: Path) -> Path:
    """A chunk file that holds kept frames (not the one the tail is filling)."""
    m = _manifest(path)
    chunk = disk_chunks(m["kept_from"][0], 44, CAPACITY, CHUNK)[1]
    return path / "frames" / f"c.0.{chunk}.0.0"


def _flip_chunk_byte(path: Path) -> str:
    target = _kept_chunk(path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target.relative_to(path).as_posix()


def _delete_chunk(path: Path) -> str:
    target = _kept_chunk(path)
    target.unlink()
    return target.relative_to(path).as_posix()


def _fifo_chunk(path: Path) -> str:
    """A FIFO in place of a chunk: reading it would block forever."""
    target = _kept_chunk(path)
    target.unlink()
    os.mkfifo(target)
    return target.relative_to(path).as_posix()


def _truncate_block(path: Path) -> str:
    name = _manifest(path)["blocks"][1]
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    return name


def _edit_manifest_crc(path: Path) -> str:
    m = _manifest(path)
    name = m["blocks"][0]
    m["files"][name] ^= 1
    write_manifest(path, m, path / "tmp", durable=False)
    return name


def _empty_tail(path: Path) -> str:
    name = _manifest(path)["tail"]
    (path / name).write_bytes(b"")
    return name


def _stray_file(path: Path) -> str:
    (path / "steps" / "b000009.g00000099.npy").write_bytes(b"x")
    return "steps/b000009.g00000099.npy"


def _broken_episode(path: Path) -> str:
    """A mid-episode terminated flag, with the block's crc updated: only invariants see it."""
    m = _manifest(path)
    name = m["blocks"][3]  # slots 24..31: inside episode 3 (frames 23..35)
    block = np.load(path / name)
    block["terminated"][0, 2] = True
    np.save(path / name, block)
    m["files"][name] = zlib.crc32((path / name).read_bytes())
    write_manifest(path, m, path / "tmp", durable=False)
    return "env 0 frame 26"


@pytest.mark.parametrize("damage", [_flip_chunk_byte, _delete_chunk, _truncate_block,
                                    _edit_manifest_crc, _empty_tail, _stray_file,
                                    _broken_episode])
def test_verify_names_each_problem(fresh: Recorded, damage, capsys) -> None:
    named = damage(fresh.path)
    code, out, err = run(capsys, "verify", fresh.path)
    assert code == 1, out
    assert out.splitlines() == [out.strip()] and named in out  # one problem, one line
    assert "problem" in err and "Traceback" not in out + err


def test_verify_does_not_block_on_a_fifo(fresh: Recorded, capsys) -> None:
    named = _fifo_chunk(fresh.path)
    code, out, err = run(capsys, "verify", fresh.path)  # would hang if the FIFO were opened
    assert code == 1 and named in out and "FIFO" in out
    assert "Traceback" not in out + err


def test_verify_detail_messages(fresh: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    flipped, block = _flip_chunk_byte(fresh.path), _truncate_block(fresh.path)
    code, out, _ = run(capsys, "verify", fresh.path)
    lines = out.splitlines()
    assert code == 1 and len(lines) == 2
    assert any(flipped in line and "crc32c" in line for line in lines)
    assert any(block in line and "crc32" in line for line in lines)


def test_verify_racing_a_writer_keeps_only_lasting_problems(
        fresh: Recorded, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every pass sees a new generation and one pass-specific problem; damage persists."""
    flipped = _flip_chunk_byte(fresh.path)
    generations = iter(range(1000))
    passes = iter(range(1000))
    once = verify_mod._verify_once

    def racing_pass(root, progress):
        report = once(root, progress)
        return replace(report, problems=(*report.problems, f"transient {next(passes)}"))

    monkeypatch.setattr(verify_mod, "committed_generation", lambda root: next(generations))
    monkeypatch.setattr(verify_mod, "_verify_once", racing_pass)
    code, out, err = run(capsys, "verify", fresh.path)
    assert code == 1 and out.splitlines() == [f"frame chunk {flipped} fails its crc32c checksum"]
    assert "a writer committed during each of 4 passes" in err


def test_commands_safe_while_a_writer_holds_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path / "live").path
    with ReplayStore.open(path) as writer:  # holds the writer lock throughout
        writer.reset(frame(1, OBS))
        for i in range(30):  # writes chunks past the committed generation
            writer.add(0, 1.0, frame(i, OBS), False, False)
        assert run(capsys, "verify", path)[0] == 0
        writer.flush()
        code, out, _ = run(capsys, "info", path, "--json")
        assert code == 0 and json.loads(out)["counts"]["frames_written"] == 45 + 31
        assert run(capsys, "verify", path)[0] == 0
        assert run(capsys, "sample", path, "--seed", 0)[0] == 0
        writer.add(0, 1.0, frame(0, OBS), False, False)  # still writable: no lock was taken


# -- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["info", "{missing}"], ["episodes", "{empty}"], ["verify", "{missing}"],
    ["sample", "{empty}"], ["show", "{store}"], ["show", "{store}", "999"],
    ["show", "{store}", "--episode", "99", "--gif"], ["info"], ["nonsense", "{store}"],
    ["episodes", "{store}", "--limit", "0"], ["info", "{broken}"],
])
def test_user_mistakes_exit_2_with_one_line(argv: list[str], rec: Recorded, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    broken = record(tmp_path / "broken").path
    _empty_tail(broken)
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "store": rec.path,
             "broken": broken}
    code, out, err = run(capsys, *[a.format(**paths) for a in argv])
    assert code == 2 and "Traceback" not in out + err
    assert err.strip().splitlines()[-1].startswith(("mmreplay: error:", "mmreplay "))
    if argv[0] != "nonsense" and argv != ["info"] and "--limit" not in argv:
        assert len(err.strip().splitlines()) == 1 and err.startswith("mmreplay: error: ")


def test_sample_empty_store_is_a_clear_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ReplayStore.create(tmp_path / "s", capacity=8, obs_shape=OBS).close()
    code, _, err = run(capsys, "sample", tmp_path / "s")
    assert code == 2 and "no sampleable transition" in err
    assert run(capsys, "verify", tmp_path / "s")[0] == 0
    footer = run(capsys, "episodes", tmp_path / "s")[1].splitlines()[-1]
    assert footer == "0 of 0 episodes with kept frames"


def test_disk_chunks_wraps() -> None:
    assert disk_chunks(5, 5, 40, 4) == []
    assert disk_chunks(5, 44, 40, 4) == list(range(10))
    assert disk_chunks(38, 45, 40, 4) == [0, 1, 9]
    assert disk_chunks(6, 10, 50, 8) == [0, 1]


def test_python_dash_m_entry_point(rec: Recorded) -> None:
    done = subprocess.run([sys.executable, "-m", "mmreplay", "info", str(rec.path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "frames written  45" in done.stdout and done.stderr == ""


def test_verify_names_the_damaged_chunk_of_a_shard_file(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = record(tmp_path / "sharded", shard_chunks=0).path
    shard = path / "frames" / "c.0.0.0.0"  # the ring's one shard file
    data = bytearray(shard.read_bytes())
    data[8] ^= 0xFF  # inside chunk 0, which holds kept frames
    shard.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and out.splitlines() == [
        "frame chunk frames/c.0.0.0.0 (chunk 0) fails its crc32c checksum"]
    data[-6] ^= 0xFF  # the index
    shard.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "frames/c.0.0.0.0: its index fails its crc32c checksum" in out
    shard.unlink()
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and "frame file frames/c.0.0.0.0 is missing" in out
