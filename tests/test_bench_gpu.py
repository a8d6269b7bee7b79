"""scripts/bench/bench_gpu.py: without CUDA it says so and exits 0; ``--device cpu`` runs
its feeds and the eager learner on the CPU with tiny sizes and writes gpu.json."""

from __future__ import annotations

import json

import pytest
import torch
from script_runner import run_here


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the bench would measure")
def test_bench_gpu_without_cuda_says_so_and_exits_0():
    outcome = run_here("bench/bench_gpu.py")
    assert outcome.returncode == 0, outcome.stderr
    assert "CUDA is not available" in outcome.stdout


@pytest.mark.integration
def test_bench_gpu_runs_its_feeds_on_the_cpu(tmp_path):
    outcome = run_here("bench/bench_gpu.py", "--device", "cpu", "--quick", "--games", "",
                       "--batch-sizes", "4", "--steps", "2", "--warmup", "1", "--frames",
                       "1200", "--distinct-frames", "600", "--workers", "2",
                       "--out-dir", str(tmp_path))
    assert outcome.returncode == 0, outcome.stderr
    result = json.loads((tmp_path / "gpu.json").read_text())
    feeds = {(a["sampler"], a["feed"]) for a in result["arms"]}
    assert {("uniform", "ceiling"), ("uniform", "store_sample"), ("uniform", "prefetch"),
            ("uniform", "device_batches"), ("uniform", "device_batches_shared"),
            ("uniform", "processes"),
            ("prioritized", "device_batches"),
            ("prioritized", "device_store"), ("prioritized", "device_store_late")} <= feeds
    assert all(a["updates_per_s"] > 0 for a in result["arms"])
    scaling = result["sampling_batches_per_s_by_workers"]
    for kind in ("read_only", "processes", "writable"):  # views; processes; reads shared
        assert set(scaling[kind]) == {"32", "256"}
        assert all(set(by) == {"1", "2"} and min(by.values()) > 0
                   for by in scaling[kind].values())
    assert result["wrong_batches"] == {}  # the check needs CUDA


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: it would measure")
def test_gpu_check_runs_every_step_and_keeps_their_logs(tmp_path):
    """scripts/bench/gpu_check.sh without CUDA: every step runs (the tests, whose CUDA ones
    skip; the benches, which say CUDA is absent), each log is kept, and it exits 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(root / "scripts/bench/gpu_check.sh")], cwd=root,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable,
                               "QUICK": "1"},
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    for step in ("cuda_tests", "bench_gpu", "device_frames"):
        assert f"{step}: exit" in done.stdout
    assert " passed" in (out / "cuda_tests.log").read_text()
    assert "needs CUDA" in (out / "cuda_tests.log").read_text()
    assert "CUDA is not available" in (out / "bench_gpu.log").read_text()
    assert "needs CUDA" in (out / "device_frames.log").read_text()
    assert (out / "machine.txt").exists()
