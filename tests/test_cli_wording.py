"""What the `mmreplay` command says: one compression figure (the one `record_atari.py` prints),
no prioritized options or empty cache on a uniform store, no progress-bar debris in a log,
errors that name what is wrong, and GIF frame counts that match the file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from script_runner import run_here

from mmreplay import ReplayStore
from mmreplay.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def info_value(out: str, key: str) -> str:
    found = [line.split(maxsplit=len(key.split()))[-1] for line in out.splitlines()
             if line.startswith(f"  {key} ")]
    assert len(found) == 1, out
    return found[0]


@pytest.fixture
def uniform_store(tmp_path: Path) -> Path:
    """Small frames that all fit the chunk cache, one episode with repeated frames."""
    path = tmp_path / "u"
    with ReplayStore.create(path, capacity=64, obs_shape=(6, 6), chunk_frames=4,
                            seed=0) as store:
        store.reset(np.zeros((6, 6), np.uint8))
        for i in range(20):  # frames 1..20 as pairs: 1,1,2,2,...: Pillow merges each pair
            store.add(0, 0.0, np.full((6, 6), 10 * (1 + i // 2), np.uint8), i == 19, False)
    return path


def test_info_shows_one_compression_figure_defined_once(uniform_store: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    code, out, _ = run(capsys, "info", uniform_store)
    files = sum(p.stat().st_size for p in uniform_store.rglob("*") if p.is_file())
    raw = 21 * 36  # every kept frame
    assert code == 0
    assert info_value(out, "compression").startswith(f"{raw / files:.1f}x")
    assert out.count("compression") == 1


def test_info_on_a_uniform_store_lists_no_priority_options(uniform_store: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    _, out, _ = run(capsys, "info", uniform_store)
    assert "alpha" not in out and "priority_eps" not in out
    with ReplayStore.create(tmp_path / "p", capacity=64, obs_shape=(6, 6), seed=0,
                            sampler="prioritized"):
        pass
    _, out, _ = run(capsys, "info", tmp_path / "p")
    assert info_value(out, "alpha") == "0.6"


def test_info_never_says_a_cache_of_zero_bytes(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big"  # 2048 x 256 KiB frames: past the automatic cache's 256 MiB
    ReplayStore.create(path, capacity=2048, obs_shape=(512, 512), seed=0).close()
    _, out, _ = run(capsys, "info", path)
    assert "0 B" not in info_value(out, "chunk cache")
    assert info_value(out, "chunk cache").startswith("none")


def test_verify_draws_no_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "many"  # 300 chunks: past the 256 a bar is drawn for on a terminal
    with ReplayStore.create(path, capacity=1200, obs_shape=(2,), chunk_frames=4,
                            seed=0) as store:
        store.reset(np.zeros(2, np.uint8))
        for i in range(1199):
            store.add(0, 0.0, np.full(2, i % 256, np.uint8), False, False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mmreplay", "verify", str(path)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0 and "300 frame chunks" in proc.stdout
    assert proc.stderr == ""


@pytest.mark.parametrize("extra", [[], ["--checkpoints", "0-3"]])
def test_import_dopamine_of_a_missing_directory_says_so(tmp_path: Path, extra: list[str],
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    code, _, err = run(capsys, "import-dopamine", tmp_path / "nope", tmp_path / "out", *extra)
    assert code == 2
    assert err.strip().endswith(f"{tmp_path / 'nope'} does not exist (expected Dopamine's "
                                f"replay_logs directory)")
    assert "$store$" not in err and not (tmp_path / "out").exists()


def test_gif_says_how_many_frames_it_holds(uniform_store: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    out_path = tmp_path / "e.gif"
    code, out, _ = run(capsys, "show", uniform_store, "--episode", 0, "--gif", "--out", out_path)
    with Image.open(out_path) as gif:
        written = gif.n_frames
    assert code == 0 and written < 21  # Pillow merged the repeated frames
    said = re.search(r"(\d+) GIF frames of its (\d+) kept frames", out)
    assert said is not None, out
    assert (int(said.group(1)), int(said.group(2))) == (written, 21)


def test_record_atari_reports_the_compression_info_reports(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    out = tmp_path / "store"
    proc = run_here("record_atari.py", "--steps", "300", "--out", str(out), "--seed", "1",
                    "--capacity", "1000")  # in this process: its output is what is checked
    assert proc.returncode == 0, proc.stderr
    printed = re.search(r"^compression\s+([\d.]+)x", proc.stdout, re.MULTILINE)
    assert printed is not None, proc.stdout
    _, info, _ = run(capsys, "info", out)
    assert info_value(info, "compression").split("x")[0] == printed.group(1)
