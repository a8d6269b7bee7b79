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
