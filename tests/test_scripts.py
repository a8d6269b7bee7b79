"""Smoke tests: every script runs with tiny arguments and leaves sensible output.

Scripts run as a user runs them (cleanrl ``tests/test_atari_gymnasium.py``): as subprocesses
where the script starts worker processes of its own (`run_script`), else in this process
(`script_runner.run_here`), which pays their imports once per test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ale_py")
pytest.importorskip("gymnasium")
pytest.importorskip("cv2")

import zarr  # noqa: E402
from script_runner import run_here  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402

pytestmark = pytest.mark.integration  # script and benchmark smoke runs

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run `scripts/<name>` with the repository importable, as `pip install -e .` would make it."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], env={**os.environ, "PYTHONPATH": path},
        capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.fixture
def ale_frames(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`scripts/bench/ale_frames.py`, imported the way `bench.py` imports it."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "bench"))
    import ale_frames

    return ale_frames


def test_record_atari_writes_a_store_that_reopens(tmp_path: Path) -> None:
    out = tmp_path / "store"
    steps = 200
    proc = run_here("record_atari.py", "--steps", str(steps), "--out", str(out), "--seed", "1",
                    "--capacity", "1000")
    assert proc.returncode == 0, proc.stderr
    assert "sample(32)" in proc.stdout

    frames = zarr.open_array(str(out / "frames"), mode="r")
    assert frames.shape == (1, 1000, 84, 84)
    assert frames.dtype == np.uint8
    with ReplayStore.open(out, mode="r") as store:
        counts = store.counts
        # Every step writes its next_obs and every episode its o_0.
        assert counts.transitions == steps
        assert counts.episodes >= 1
        assert counts.frames_written == counts.frames_kept == steps + counts.episodes
        assert 0 < counts.sampleable == len(store) <= steps
        batch = store.sample(8)
        assert tuple(batch.obs.shape) == (8, 4, 84, 84)
        assert tuple(batch.next_obs.shape) == (8, 4, 84, 84)
        assert int(batch.obs.max()) > 0  # real pixels, not padding only
    printed = dict(line.split(maxsplit=1) for line in proc.stdout.splitlines()[1:6])
    assert printed["frames"].startswith(f"{counts.frames_kept} kept")
    assert printed["episodes"] == str(counts.episodes)


def test_record_atari_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "store"
    assert run_here("record_atari.py", "--steps", "20", "--out", str(out)).returncode == 0
    again = run_here("record_atari.py", "--steps", "20", "--out", str(out))
    assert again.returncode != 0
    assert "--overwrite" in again.stderr
    forced = run_here("record_atari.py", "--steps", "30", "--out", str(out), "--overwrite")
    assert forced.returncode == 0, forced.stderr
    with ReplayStore.open(out, mode="r") as store:
        assert len(store) <= 30


@pytest.fixture(scope="module")
def ale_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench smoke runs' `--cache-dir`, one for the module: `ale_frames` keys a recording
    by (game, frames, seed), so the 2000 Breakout frames that `bench.py --quick`, bench_scale
    and bench_sequences all ask for are recorded once (by the first of them)."""
    return tmp_path_factory.mktemp("ale_cache")


@pytest.fixture(scope="module")
def bench_quick(tmp_path_factory: pytest.TempPathFactory,
                ale_cache: Path) -> tuple[str, dict[str, Any]]:
    """`bench.py --quick` run once for the module: (its stdout, its JSON result)."""
    tmp_path = tmp_path_factory.mktemp("bench_quick")
    out_dir = tmp_path / "bench"
    proc = run_script("bench/bench.py", "--quick", "--out-dir", str(out_dir),
                      "--cache-dir", str(ale_cache))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads((out_dir / "core_quick.json").read_text())


def test_bench_quick_writes_positive_figures(bench_quick: tuple[str, dict[str, Any]]) -> None:
    stdout, result = bench_quick

    assert {"machine", "config", "record", "add", "sample", "sample_reopened", "disk",
            "numpy_floor", "naive_zarr", "ratios"} <= set(result)
    assert result["machine"]["cpu_count"] >= 1
    assert result["record"]["frames"] == 2000
    assert result["add"]["steps_per_s"] > 0
    wrapped = result["add_wrapped"]  # three laps past a quarter-size ring
    assert wrapped["steps_per_s"] > 0 and wrapped["adds"] > 2 * wrapped["capacity"]
    for name in ("sample", "sample_reopened", "numpy_floor", "naive_zarr", "naive_zarr_format1"):
        assert 0 < result[name]["median_ms"] <= result[name]["p90_ms"]
    assert result["disk"]["file_mib"] < result["disk"]["raw_mib"]  # zstd compresses Atari
    assert result["sample"]["obs_shape"] == [32, 4, 84, 84]
    assert result["naive_zarr"]["array_shape"] == [1, 2000, 84, 84]
    assert all(ratio > 0 for ratio in result["ratios"].values())
    assert "naive_zarr" in stdout


def test_ale_frames_stream_is_consistent_and_cached(ale_frames: ModuleType, tmp_path: Path) -> None:
    rec = ale_frames.record_frames("ALE/Breakout-v5", 400, seed=3, cache_dir=tmp_path)
    assert rec.frames.shape == (400, 84, 84)
    assert rec.frames.dtype == np.uint8
    assert rec.is_first[0]
    # An episode ends exactly where the next one starts.
    ended = rec.terminated | rec.truncated
    np.testing.assert_array_equal(rec.is_first[1:], ended[:-1])
    assert not rec.actions[rec.is_first].any() and not ended[rec.is_first].any()

    path = ale_frames.cache_path("ALE/Breakout-v5", 400, 3, tmp_path)
    assert path.exists()
    again = ale_frames.record_frames("ALE/Breakout-v5", 400, seed=3, cache_dir=tmp_path)
    for name in ale_frames.FIELDS:
        np.testing.assert_array_equal(getattr(again, name), getattr(rec, name))
    fresh = ale_frames.record("ALE/Breakout-v5", 400, seed=3)  # same seed, same stream
    np.testing.assert_array_equal(fresh.frames, rec.frames)


def test_bench_quick_measures_ram_disk_cold_open_flush(
        bench_quick: tuple[str, dict[str, Any]]) -> None:
    stdout, result = bench_quick
    config = result["config"]
    scale, small = config["scale_frames"], config["small_frames"]
    assert (scale, small) == (3000, 1000)

    ram = {(row["system"], row["frames"]): row for row in result["ram"]}
    assert set(ram) == {("mmreplay", scale), ("cpprb", scale), ("numpy", scale),
                        ("mmreplay", small), ("cpprb", small), ("sb3", small),
                        ("torchrl", small)}
    for row in ram.values():
        if "skipped" in row:  # an optional baseline that is not installed says why
            assert row["system"] in ("cpprb", "sb3", "torchrl") and "pip" in row["skipped"]
            continue
        assert row["adds"] > 0 and row["steps_per_s"] > 0
        assert 0 < row["sample"]["median_ms"] <= row["sample"]["p90_ms"]
        assert row["growth_mib"]["VmHWM"] >= row["growth_mib"]["VmRSS"] - 1
    # The numpy floor touches every frame it holds: ~7 KB per 84x84 frame.
    assert ram[("numpy", scale)]["growth_mib"]["VmRSS"] * 2**20 >= 0.9 * scale * 84 * 84
    assert ram[("mmreplay", scale)]["file_pct"] < 100  # the scale store compressed

    games = [row["game"] for row in result["disk_games"]]
    assert games == ["Pong", "Breakout"]
    for row in result["disk_games"]:
        assert row["frames"] == 300
        assert 0 < row["file_pct"] < 100 and row["allocated_mib"] >= row["frame_file_mib"]

    cold = result["cold"]
    for name in ("warm", "page_cold", "naive_warm", "naive_page_cold"):
        assert 0 < cold[name]["median_ms"] <= cold[name]["p90_ms"]
    fraction = cold["evicted"]["resident_fraction"]
    assert fraction is None or 0 <= fraction <= 1
    # shard files of 512 8-frame chunks (4,096 frames): a 3000-frame store is one file
    assert cold["chunk_files"] == -(-scale // 4096)

    assert result["open"]["cold"]["total_s"] > 0 and result["open"]["warm"]["total_s"] > 0
    flush = result["flush"]
    assert (flush["big"]["capacity"], flush["small"]["capacity"]) == (scale, 1000)
    assert len(flush["big"]["flush_s"]) == config["flush_rounds"] and flush["ratio"] > 0

    figures = " ".join(row["figure"] for row in result["targets"])
    for word in ("add: mmreplay steps/s", "sample: naive zarr", "disk: Pong", "open", "flush"):
        assert word in figures
    assert {row["verdict"] for row in result["targets"]} <= {"PASS", "SHORT"}
    assert "targets" in stdout and "malloc" in stdout


def test_bench_quick_compares_with_cpprb_when_installed(
        bench_quick: tuple[str, dict[str, Any]]) -> None:
    """cpprb comes with the `bench` extra (the README's test command installs it); without it
    the bench says why it skipped the baseline and prints no ratio against it."""
    _, result = bench_quick
    scale = result["config"]["scale_frames"]
    cpprb_row = next(row for row in result["ram"]
                     if (row["system"], row["frames"]) == ("cpprb", scale))
    figures = [row["figure"] for row in result["targets"]]
    ratio_rows = [f for f in figures if "cpprb" in f]
    try:
        import cpprb  # noqa: F401
    except ImportError:
        assert "pip install" in cpprb_row["skipped"] and ratio_rows == []
        pytest.skip("cpprb not installed (bench extra): ratio rows checked absent only")
    assert "skipped" not in cpprb_row and cpprb_row["steps_per_s"] > 0
    for word in ("RAM: RSS growth mmreplay / cpprb", "add: mmreplay / cpprb",
                 "sample: mmreplay cold / cpprb"):
        assert any(word in f for f in ratio_rows), (word, ratio_rows)


def test_bench_scale_smoke(tmp_path: Path, ale_cache: Path) -> None:
    out_dir = tmp_path / "bench"
    proc = run_here("bench/bench_scale.py", "--frames", "3000", "--distinct-frames", "2000",
                    "--reps", "6", "--warmup", "1", "--report-every", "1000",
                    "--compare-frames", "2000", "--rounds", "2", "--ab-cache-mib", "1",
                    "--out-dir", str(out_dir), "--cache-dir", str(ale_cache))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out_dir / "scale.json").read_text())
    fill = result["fill"]
    assert [row["frames"] for row in fill["progress"]] == [1000, 2000, 3000]
    assert fill["adds"] > 0 and fill["steps_per_s"] > 0
    assert result["sampleable"] > 0
    assert 0 < result["sample_live"]["median_ms"] <= result["sample_live"]["p90_ms"]
    assert result["disk"]["file_mib"] < result["disk"]["raw_mib"]
    assert result["reopened"]["open_s"] > 0 and result["reopened"]["sample"]["median_ms"] > 0
    assert "VmRSS" in result["rss"]["growth_mib"]
    assert "RSS growth" in proc.stdout and "reopened" in proc.stdout
    ab = result["ab"]  # the 3k store and a 2k one, live and read with and without a cache
    assert set(ab["arms"]) == {"live 3k", "live 2k", "reader 3k, cache 0 MiB",
                               "reader 3k, cache 1 MiB", "reader 2k, cache 0 MiB",
                               "reader 2k, cache 1 MiB"}
    assert all(row["reps"] == 6 and row["minflt_per_call"] >= 0 for row in ab["arms"].values())
    assert ab["fill_compared"]["adds"] > 0
    assert ab["ratios"]["live 3k / live 2k"]["median"] > 0
    assert "reader 3k: cache 1 / 0 MiB" in ab["ratios"] and "A/B" in proc.stdout


def test_bench_sequences_smoke(tmp_path: Path, ale_cache: Path) -> None:
    out_dir = tmp_path / "bench"
    proc = run_here("bench/bench_sequences.py", "--frames", "3000", "--distinct-frames", "2000",
                    "--reps", "3", "--warmup", "1", "--length", "20", "--torchrl-frames", "0",
                    "--out-dir", str(out_dir), "--cache-dir", str(ale_cache))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out_dir / "sequences.json").read_text())["mmreplay"]
    for mode in ("within_episodes", "across_episodes"):
        figures = result[mode]
        assert figures["frame_reads_per_batch"] == 1
        assert figures["frames_in_batch"] == 32 * 20 * 4 + 32 * 4
        assert 0 < figures["distinct_frames"] <= figures["frames_decoded"]
        assert figures["median_ms"] > 0


def test_bench_overhead_smoke(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = run_script("bench/bench_overhead.py", "--frames", "2000", "--small-steps", "300",
                      "--reps", "40", "--block", "10", "--dqn-steps", "100", "--dqn-rounds",
                      "1", "--partial-cache-mib", "1", "--lz4hc", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    tree = json.loads(out.read_text())["trees"]["this_checkout"]
    assert tree["mmreplay_from"] == str(ROOT / "mmreplay")
    blocks = tree["sb3"]["add_per_call_in_blocks"]
    assert blocks["block"] == 300 // 8
    for figures in (tree["sb3"]["add"], tree["sb3"]["sample64"], blocks["figures"],
                    tree["per"]["sample32_plus_update32"], tree["per"]["update32"],
                    tree["uniform"]["sample32"], tree["uniform"]["sample32_vs_floor"]):
        for row in figures.values():
            assert 0 < row["median_us"] <= row["p90_us"]
    dqn = tree["dqn"]
    assert dqn["steps"] == 100 and dqn["ratio_adapter_to_sb3"] > 0
    assert len(dqn["mmreplay_sb3_adapter"]["steps_per_s_each"]) == 1
    assert tree["sb3"]["add"]["sb3_ReplayBuffer"]["ratio_to_sb3_ReplayBuffer"] == 1.0
    assert "cpprb_PrioritizedReplayBuffer" in tree["per"]["update32"]
    assert tree["uniform"]["sample32_vs_floor"]["numpy_floor"]["ratio_to_numpy_floor"] == 1.0
    assert "cpprb_ReplayBuffer" in tree["uniform"]["sample32"]
    for section in ("per", "uniform"):  # decoded chunks in RAM, timed beside cpprb
        assert {"mmreplay_decoded_in_ram", "mmreplay_partial_cache", "mmreplay_lz4hc",
                "mmreplay_lz4hc_arrays"} <= set(tree[section]["sample32"])
        twin = tree[section]["cached"]["mmreplay_lz4hc"]
        assert 0 < twin["frame_bytes"] < twin["lz4_frame_bytes"] and twin["add_s"] > 0
        info = tree[section]["cached"]["mmreplay_decoded_in_ram"]
        assert info["cache_bytes"] == 2000 * 84 * 84 and info["warm_up_s"] > 0
        assert info["cached_bytes"] == info["cache_bytes"]  # every chunk read once
        partial = tree[section]["cached"]["mmreplay_partial_cache"]
        assert partial["cache_bytes"] == 1 << 20 and 0 < partial["cached_bytes"] <= 1 << 20
        assert tree[section]["cpprb_rss_growth_bytes"] > 0
    like_for_like = {"mmreplay_ReplayStore_arrays", "mmreplay_decoded_in_ram_arrays",
                     "cpprb_ReplayBuffer_to_torch"}  # numpy out beside cpprb, tensors beside ours
    assert like_for_like <= set(tree["uniform"]["sample32"])
    assert "cpprb_PrioritizedReplayBuffer_to_torch" in tree["per"]["sample32"]
    assert "mmreplay_ReplayStore_arrays" not in tree["uniform"]["sample32_vs_floor"]


def test_bench_codec_smoke(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    proc = run_here("bench/bench_codec.py", "--games", "Pong", "--frames", "600",
                    "--dict-train-chunks", "8", "--sample-plan", "Pong:1200",
                    "--c4-sizes", "1200", "--push-steps", "300", "--reps", "10",
                    "--out", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    pong = result["games"]["Pong"]
    assert pong["gzip9_ratio"] > 1 and len(pong["codecs"]) == 11
    for row in pong["codecs"].values():
        assert row["bytes"] > row["chunk_bytes"] > 0 and row["decode_us_per_chunk"] > 0
    lz4, zd = pong["codecs"]["lz4 c8"], pong["codecs"]["zstd-dict c8 64K l5"]
    assert lz4["codec"] == "lz4" and zd["dict_bytes"] == 64 << 10 and zd["codec_level"] == 5
    row = result["sampling"]["Pong:1200"]
    assert set(row) == {"lz4 c8", "zstd-dict c8 l1", "zstd-dict c8 l3", "zstd-dict c4 l1"}
    assert row["lz4 c8"]["sample_vs_lz4"] == row["lz4 c8"]["sample_cpu_vs_lz4"] == 1.0
    assert all(r["sample_median_ms"] > 0 and r["sample_cpu_median_ms"] > 0
               and r["add_steps_per_s"] > 0 for r in row.values())
    assert "zstd-dict c8 64K l1" in result["targets"]
    push = result["transport"]["Pong"]["push"]
    assert set(push) == {"lz4 c8", "zstd-dict c8 l3"}
    assert all(p["first_push_bytes"] > 0 and p["steps"] == 300 for p in push.values())
    assert result["transport"]["Pong"]["ray_block_64"]["lz4"]["bytes_per_step"] > 0


def test_bench_chunk_layout_smoke(tmp_path: Path, ale_cache: Path) -> None:
    """Every layout's batches read back the frames encoded (the script checks them before
    timing and fails otherwise), and each row has its figures."""
    proc = run_here("bench/bench_chunk_layout.py", "--frames", "2000", "--batches", "100",
                    "--block", "50", "--out-dir", str(tmp_path), "--cache-dir", str(ale_cache))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "chunk_layout.json").read_text())["layouts"]
    assert set(rows) == {"chained-8", "chained-4", "keyed-8", "dict-8", "hc3-8", "hc9-8"}
    assert rows["chained-8"]["bytes_vs_chained_8"] == rows["chained-8"]["gather_vs_chained_8"] == 1
    for row in rows.values():
        assert row["bytes_per_frame"] > 0 and row["encode_us_per_frame"] > 0
        assert 0 < row["gather_us"]["p25"] <= row["gather_us"]["median"] <= row["gather_us"]["p90"]
