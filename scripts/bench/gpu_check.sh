#!/usr/bin/env bash
# The GPU paths' checks in one command, sized for about 8 minutes on one NVIDIA GPU host:
#   1. the CUDA tests (and the CPU tests of the same modules, which run other branches where
#      CUDA is available), log in cuda_tests.log;
#   2. bench_gpu.py: the wrong-batch check with a lagging GPU, the learner ratios (eager and
#      CUDA graph, batch 32 and 256, uniform and prioritized), the sampling throughput by
#      workers; gpu.json, rewritten after each section;
#   3. bench_device_frames.py: a 1M-frame device store's open + fill and sample(32) to GPU
#      tensors; device_frames.json.
# Each step has its own time limit, so one slow step leaves the others their time; every
# figure is kept in OUT (default data/bench/gpu_check), with each step's log.
#
#   bash scripts/bench/gpu_check.sh                 # real ALE frames (data/cache) if cached
#   GAMES="" bash scripts/bench/gpu_check.sh        # synthetic frames
#   QUICK=1 bash scripts/bench/gpu_check.sh         # bench_gpu at --quick sizes
#
# Needs the package's dependencies, pytest, tyro and cpprb importable (PYTHONPATH may point
# at them). Exits 0 after every step ran; the logs say what failed.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-data/bench/gpu_check}
GAMES=${GAMES-ALE/Breakout-v5,ALE/Pong-v5,ALE/Seaquest-v5}
mkdir -p "$OUT"
py=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, say how it ended
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit s)"
    tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi -L; nproc; "$py" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

step cuda_tests 150 "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/test_pinned_batches.py tests/test_device_batches.py tests/test_device_frames.py \
    tests/test_late_priorities.py tests/test_sb3_device.py tests/test_sampling_processes.py \
    tests/test_read_threads.py tests/test_sb3_stage.py

quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
step bench_gpu 270 "$py" scripts/bench/bench_gpu.py ${quick[@]+"${quick[@]}"} --games "$GAMES" \
    --distinct-frames 30000 --out-dir "$OUT" --out-name gpu.json

step device_frames 120 "$py" scripts/bench/bench_device_frames.py --device cuda \
    --frames 1000000 --samplers uniform --repeats 1 --samples 2000 --out-dir "$OUT"
exit 0
