"""The sections of `scripts/bench/bench.py`, one module each, over a small shared harness.

    harness    latency, feeding a store from recorded frames, RSS, page-cache eviction,
               machine info, JSON output (what every bench script measures with)
    config     the bench's `Args`, its section names and the `--quick` sizes
    core       add / sample / disk / numpy floor / naive zarr on recorded frames
    baselines  the buffers the ram section compares (mmreplay, cpprb, numpy, SB3, TorchRL)
    workers    figures about a process, each from a fresh ``bench.py _worker JOB``
    scale      ram, cold, open, flush and disk: the parent side and their tables
    targets    each figure beside the goal it is read against (PASS / SHORT)
    gpu_learner  the DQN update of `bench/bench_gpu.py`, eager or in a CUDA graph

The other bench scripts (`bench_scale.py`, `bench_sequences.py`, `bench_prioritized.py`, ...)
import what they share from here.
"""
