"""Per-call overhead, side by side with the buffers a user would otherwise pick.

    python scripts/bench/bench_overhead.py                          # this checkout
    git archive main mmreplay | tar -x -C /tmp/mmreplay-main  # an older version beside it:
    python scripts/bench/bench_overhead.py --baseline /tmp/mmreplay-main

Each code tree (this checkout, then ``--baseline`` if given) runs in a fresh subprocess that
imports mmreplay from that tree and measures, in that one process:

    sb3     a (4,)-float observation, one env, a Discrete(2) action: `FrameOnceReplayBuffer`
            ``add`` and ``sample(64)`` against SB3's own ``ReplayBuffer`` (same stream, calls
            interleaved block by block), and `ReplayStore` ``add``/``sample(64)`` directly;
            ``add`` also timed per block of 512 calls, staged steps' recording included
    per     a prioritized store of `--frames` real frames of `--games` (84x84, 4-stacks + next
            stacks): ``sample(32)`` + ``update_priorities`` of the 32 ids, ``sample(32)``
            alone, and the update alone, against cpprb's ``PrioritizedReplayBuffer``
            (next_of + stack_compress) filled with the same stream
    uniform a uniform store of `--frames` real frames of `--games`: ``sample(32)`` against cpprb's
            ``ReplayBuffer`` (next_of + stack_compress), then against the floor: numpy's fancy
            index of 32 five-frame windows from an in-RAM array of the same frames
            (per and uniform, unless ``--no-numpy-rows``: also ``sample_arrays(32)``, numpy out
            as cpprb gives, and cpprb's batch turned into torch tensors, as ``sample`` gives)
    dqn     SB3's DQN on CartPole-v1 (rl-baselines3-zoo's hyperparameters, `--dqn-steps` steps,
            same seed) with SB3's ``ReplayBuffer`` and with `FrameOnceReplayBuffer`, run in
            turns (`--dqn-rounds` each): env steps per second of ``learn``

per and uniform also time a copy of the store opened with a decoded-chunk cache that holds the
whole store (``mmreplay_decoded_in_ram``: every frame decoded in RAM, as cpprb keeps them) and
one with a partial cache (``mmreplay_partial_cache``, `--partial-cache-mib`), warmed before
timing (every chunk read once), in the same interleaved run; their ``cache_bytes``, warm-up
seconds and RSS growth are recorded (``cached``) beside cpprb's RSS growth.

Figures are medians, 90th percentiles and means in microseconds per call (a mean includes the
rare calls that record a block of staged steps), plus the ratio of medians to the baseline
buffer of the same process, so a machine that drifts or is shared moves both
sides alike. Writes `--out` (JSON). Figures only: nothing is asserted.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from common import dir_bytes, run_main

ADD_BLOCK = 512  # adds per timed block in `add_blocks` (two of the adapter's stages)
SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parents[1]


@dataclass
class Args:
    frames: int = 200_000
    """frames in the prioritized store and in cpprb's buffer (per section)"""
    small_steps: int = 20_000
    """steps added (and timed) into the small-observation buffers before sampling"""
    reps: int = 3000
    """timed calls per sampling figure"""
    block: int = 50
    """calls per block when two buffers are timed in turns"""
    partial_cache_mib: int = 512
    """per, uniform: also time a copy opened with a decoded-chunk cache of this many MiB
    (``mmreplay_partial_cache``; 0: not timed)"""
    warmup: int = 200
    """per, uniform: untimed calls of each buffer first (the first touches of mapped files
    and of the buffers' arrays are not what a learner's step costs)"""
    baseline: str = ""
    """a directory holding an older `mmreplay` package, measured after this checkout"""
    dqn_steps: int = 20_000
    """env steps of each CartPole DQN run"""
    dqn_rounds: int = 2
    """CartPole DQN runs per buffer, in turns"""
    sections: str = "sb3,per,uniform,dqn"
    """comma-separated sections to run"""
    baseline_sections: str = ""
    """sections to run on `--baseline` (default: `--sections`)"""
    numpy_rows: bool = True
    """per, uniform: also time ``sample_arrays(32)`` (numpy out, as cpprb's ``sample``) and
    cpprb's ``sample(32)`` turned into torch tensors (as mmreplay's ``sample``)"""
    lz4hc: bool = False
    """per, uniform: also time a store filled from the same stream with ``codec="lz4hc"``
    (``mmreplay_lz4hc``; the same seed, so the same draws as the default store)"""
    games: str = "ALE/Breakout-v5,ALE/Pong-v5,ALE/Seaquest-v5"
    """per, uniform: the real frames recorded, `--distinct-frames` of each game, cycled"""
    distinct_frames: int = 1500
    """per, uniform: frames recorded per game (cached under data/cache)"""
    seed: int = 0
    """seed of the streams and of every buffer's sampling"""
    out: str = "data/bench/overhead.json"
    """where the JSON goes"""


# -- timing ------------------------------------------------------------------------------------
def summary(seconds: list[float]) -> dict[str, float]:
    us = np.asarray(seconds) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "mean_us": float(us.mean())}


def interleaved(calls: dict[str, Callable[[int], object]], reps: int,
                block: int) -> dict[str, dict[str, float]]:
    """Time ``call(i)`` for i in 0..reps-1 on every buffer, in turns of `block` calls, so a
    machine that slows down mid-run slows every buffer alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    clock = time.perf_counter
    for start in range(0, reps, block):
        for name, call in calls.items():
            spent = times[name]
            for i in range(start, min(start + block, reps)):
                begin = clock()
                call(i)
                spent.append(clock() - begin)
    return {name: summary(spent) for name, spent in times.items()}


def with_ratios(figures: dict[str, dict[str, float]], baseline: str) -> dict[str, Any]:
    base = figures[baseline]["median_us"]
    return {name: {**f, "ratio_to_" + baseline: f["median_us"] / base}
            for name, f in figures.items()}


def cached_copies(args: Args, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decoded-in-RAM copy of the closed store at `path` and, with
    `--partial-cache-mib`, a copy with a partial cache: stores and their figures, by row."""
    stores, info = {}, {}
    stores["mmreplay_decoded_in_ram"], info["mmreplay_decoded_in_ram"] = decoded_in_ram(path)
    if args.partial_cache_mib:
        stores["mmreplay_partial_cache"], info["mmreplay_partial_cache"] = decoded_in_ram(
            path, args.partial_cache_mib << 20)
    return stores, info


def filled_store(args: Args, rec: Any, path: str, **options: Any) -> float:
    """A store at `path` (84x84 frames in 4-stacks, `--frames` slots, `--seed`, `options`)
    filled from `rec` and closed; the seconds spent inside its ``reset``/``add`` calls."""
    from benchlib.harness import feed_timed

    from mmreplay import ReplayStore

    store = ReplayStore.create(path, capacity=args.frames, obs_shape=(84, 84), frame_stack=4,
                               seed=args.seed, **options)
    _, spent = feed_timed(store, rec, 0, args.frames + 100, desc="fill", progress=False)
    store.close()
    return spent


def lz4hc_twin(args: Args, rec: Any, path: str, info: dict[str, Any],
               **options: Any) -> dict[str, Any]:
    """With `--lz4hc`: the store at `path` filled again from the same stream with
    ``codec="lz4hc"``, opened, by row; its frame bytes and fill time go into `info` beside
    the lz4 store's frame bytes. A tree whose store has no lz4hc codec (an older
    ``--baseline``) gets no such row and says so in `info`."""
    if not args.lz4hc:
        return {}
    from mmreplay import ReplayStore
    from mmreplay.spec import CODECS

    if "lz4hc" not in CODECS:
        info["mmreplay_lz4hc"] = {"skipped": "this tree's stores have no lz4hc codec"}
        return {}

    twin = f"{path}-lz4hc"
    spent = filled_store(args, rec, twin, codec="lz4hc", **options)
    info["mmreplay_lz4hc"] = {"add_s": spent, "frame_bytes": dir_bytes(Path(twin) / "frames"),
                              "lz4_frame_bytes": dir_bytes(Path(path) / "frames")}
    return {"mmreplay_lz4hc": ReplayStore.open(twin)}


def settled_rss() -> int:
    """`rss_bytes` once earlier rows' garbage is collected and the C heap's free pages are
    given back (glibc's ``malloc_trim``): else a fill that reuses freed heap grows the
    process less than it holds (a growth of 0 for cpprb's 2,000-frame buffer in the smoke
    run, whose earlier rows had filled and closed a store)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: the heap stays as it is
        pass
    return rss_bytes()


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def decoded_in_ram(path: str, budget: int = 0) -> tuple[Any, dict[str, Any]]:
    """A copy of the closed store at `path`, opened with a decoded-chunk cache holding all of
    it (or `budget` bytes of it) and warmed (every chunk read once through `get`); and what
    that cost."""
    import shutil

    from mmreplay import ReplayStore

    copy = f"{path}-decoded{budget or ''}"
    shutil.copytree(path, copy)
    before = settled_rss()
    store = ReplayStore.open(copy)
    spec = store.spec
    cache_bytes = budget or spec.decoded_bytes
    store.close()
    store = ReplayStore.open(copy, cache_bytes=cache_bytes)
    begin = time.perf_counter()
    ids = store.valid_ids()[::spec.chunk_frames]  # a transition in every chunk
    for lo in range(0, ids.size, 512):
        store.get(ids[lo:lo + 512])
    warm_s = time.perf_counter() - begin
    cache = store.views.memory().cache
    return store, {"cache_bytes": cache_bytes, "warm_up_s": warm_s,
                   "cached_chunks": cache.chunks, "cached_bytes": cache.nbytes,
                   "rss_growth_bytes": rss_bytes() - before}


# -- sb3: small observations -------------------------------------------------------------------
def sb3_section(args: Args) -> dict[str, Any]:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer

    from mmreplay import ReplayStore
    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    rng = np.random.default_rng(args.seed)
    n = args.small_steps
    space, act = spaces.Box(-10, 10, (4,), np.float32), spaces.Discrete(2)
    tmp = tempfile.mkdtemp(prefix="mmreplay-overhead-")
    ours = FrameOnceReplayBuffer(n + 10, space, act, device="cpu", path=f"{tmp}/sb3",
                                 seed=args.seed)
    theirs = ReplayBuffer(n + 10, space, act, device="cpu")
    store = ReplayStore.create(f"{tmp}/store", capacity=n + 10, obs_shape=(4,),
                               obs_dtype=np.float32, seed=args.seed)
    obs = rng.standard_normal((n + 1, 1, 4)).astype(np.float32)
    done = rng.random(n) < 0.005  # CartPole-like episodes of ~200 steps
    actions, reward = rng.integers(0, 2, (n, 1, 1)), np.ones((n, 1), np.float32)
    store.reset(obs[0, 0])

    def sb3_add(buf: Any) -> Callable[[int], object]:
        return lambda i: buf.add(obs[i], obs[i + 1], actions[i], reward[i], done[i:i + 1], [{}])

    def store_add(i: int) -> None:
        store.add(int(actions[i, 0, 0]), 1.0, obs[i + 1, 0], bool(done[i]), False)
        if done[i]:
            store.reset(obs[i + 1, 0])

    add = interleaved({"mmreplay_sb3_adapter": sb3_add(ours), "sb3_ReplayBuffer": sb3_add(theirs),
                       "mmreplay_ReplayStore": store_add}, n, args.block)
    blocks = add_blocks(args, space, act, obs, actions, reward, done)
    sample = interleaved({"mmreplay_sb3_adapter": lambda i: ours.sample(64),
                          "sb3_ReplayBuffer": lambda i: theirs.sample(64),
                          "mmreplay_ReplayStore": lambda i: store.sample(64)},
                         args.reps, args.block)
    ours.close()
    store.close()
    return {"add": with_ratios(add, "sb3_ReplayBuffer"),
            "add_per_call_in_blocks": blocks,
            "sample64": with_ratios(sample, "sb3_ReplayBuffer")}


def add_blocks(args: Args, space: Any, act: Any, obs: np.ndarray, actions: np.ndarray,
               reward: np.ndarray, done: np.ndarray) -> dict[str, Any]:
    """``add`` timed per block of `ADD_BLOCK` calls (fewer for short runs; every cost of the
    calls included, the adapter's recording of staged steps too), fresh buffers, blocks
    alternated; the first block of each (kernel loading) is left out. Figures: per-call time
    of a block."""
    from stable_baselines3.common.buffers import ReplayBuffer

    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    n = args.small_steps
    block = min(ADD_BLOCK, max(n // 8, 1))
    tmp = tempfile.mkdtemp(prefix="mmreplay-overhead-")
    bufs = {"mmreplay_sb3_adapter": FrameOnceReplayBuffer(n + 10, space, act, device="cpu",
                                                          path=f"{tmp}/blocks", seed=args.seed),
            "sb3_ReplayBuffer": ReplayBuffer(n + 10, space, act, device="cpu")}
    times: dict[str, list[float]] = {name: [] for name in bufs}
    for lo in range(0, n - block + 1, block):
        for name, buf in bufs.items():
            begin = time.perf_counter()
            for i in range(lo, lo + block):
                buf.add(obs[i], obs[i + 1], actions[i], reward[i], done[i:i + 1], [{}])
            times[name].append((time.perf_counter() - begin) / block)
    bufs["mmreplay_sb3_adapter"].close()
    figures = {name: summary(spent[1:]) for name, spent in times.items()}
    return {"block": block, "figures": with_ratios(figures, "sb3_ReplayBuffer")}


# -- real frames -------------------------------------------------------------------------------
def recording(args: Args) -> Any:
    """`--distinct-frames` recorded frames of each of `--games`, one stream after another."""
    sys.path.insert(0, str(SCRIPTS))
    from ale_frames import AleFrames, record_frames

    recs = [record_frames(game, args.distinct_frames, seed=args.seed)
            for game in args.games.split(",") if game]
    return AleFrames(args.games, args.seed, *(
        np.concatenate([getattr(r, name) for r in recs])
        for name in ("frames", "is_first", "actions", "rewards", "terminated", "truncated")))


# -- per: prioritized sample + update with frames ----------------------------------------------
def per_section(args: Args) -> dict[str, Any]:
    sys.path.insert(0, str(SCRIPTS))
    from benchlib.baselines import stacked_steps
    from cpprb import PrioritizedReplayBuffer

    from mmreplay import ReplayStore

    rec = recording(args)
    rng = np.random.default_rng(args.seed)
    path = tempfile.mkdtemp(prefix="mmreplay-overhead-") + "/per"
    filled_store(args, rec, path, sampler="prioritized", alpha=0.6)
    cached, cached_info = cached_copies(args, path)
    store = ReplayStore.open(path)
    before = settled_rss()
    rb: Any = PrioritizedReplayBuffer(
        args.frames, {"obs": {"shape": (84, 84, 4), "dtype": np.uint8},
                      "act": {"dtype": np.int64}, "rew": {}, "done": {}},
        next_of="obs", stack_compress="obs", alpha=0.6)
    for step in stacked_steps(rec, args.frames + 100, channels_last=True, desc="fill cpprb"):
        if step.new_episode and rb.get_stored_size():
            rb.on_episode_end()
        rb.add(obs=step.obs, act=step.action, rew=step.reward, next_obs=step.next_obs,
               done=float(step.terminated))
    cpprb_rss = rss_bytes() - before
    cached.update(lz4hc_twin(args, rec, path, cached_info, sampler="prioritized", alpha=0.6))
    new = rng.random((args.reps, 32))

    def ours(buf: Any) -> Callable[[int], None]:
        return lambda i: buf.update_priorities(buf.sample(32, beta=0.4).ids, new[i])

    def cpprb(i: int) -> None:
        rb.update_priorities(rb.sample(32, beta=0.4)["indexes"], new[i])

    stores = {"mmreplay_ReplayStore": store, **cached}
    for i in range(min(args.warmup, args.reps)):
        cpprb(i)
        for buf in stores.values():
            ours(buf)(i)

    both = interleaved({**{name: ours(buf) for name, buf in stores.items()},
                        "cpprb_PrioritizedReplayBuffer": cpprb}, args.reps, args.block)
    theirs: dict[str, Callable[[int], object]] = {
        "cpprb_PrioritizedReplayBuffer": lambda i: rb.sample(32, beta=0.4)}
    if args.numpy_rows:
        theirs["cpprb_PrioritizedReplayBuffer_to_torch"] = lambda i: to_torch(
            rb.sample(32, beta=0.4))
    sample = interleaved({**{name: sampler(buf, 0.4) for name, buf in stores.items()},
                          **numpy_rows(stores, args.numpy_rows, 0.4), **theirs},
                         args.reps, args.block)
    for buf in cached.values():
        buf.close()
    drawn = [store.sample(32).ids for _ in range(args.reps)]
    indexes = [rb.sample(32)["indexes"] for _ in range(args.reps)]
    update = interleaved({
        "mmreplay_ReplayStore": lambda i: store.update_priorities(drawn[i], new[i]),
        "cpprb_PrioritizedReplayBuffer": lambda i: rb.update_priorities(indexes[i], new[i])},
        args.reps, args.block)
    store.close()
    return {"sample32_plus_update32": with_ratios(both, "cpprb_PrioritizedReplayBuffer"),
            "sample32": with_ratios(sample, "cpprb_PrioritizedReplayBuffer"),
            "update32": with_ratios(update, "cpprb_PrioritizedReplayBuffer"),
            "cached": cached_info, "cpprb_rss_growth_bytes": cpprb_rss,
            "frames": args.frames}


def sampler(store: Any, beta: float | None = None) -> Callable[[int], object]:
    """``store.sample(32)`` as a timed call."""
    if beta is None:
        return lambda i: store.sample(32)
    return lambda i: store.sample(32, beta=beta)


# -- uniform: uniform sample with frames, and the numpy floor -----------------------------------
def uniform_section(args: Args) -> dict[str, Any]:
    sys.path.insert(0, str(SCRIPTS))
    from benchlib.harness import numpy_gather

    from mmreplay import ReplayStore

    rec = recording(args)
    path = tempfile.mkdtemp(prefix="mmreplay-overhead-") + "/uniform"
    filled_store(args, rec, path)
    cached, cached_info = cached_copies(args, path)
    store = ReplayStore.open(path)

    def rows() -> dict[str, Callable[[int], object]]:  # called once cpprb's RSS is measured
        cached.update(lz4hc_twin(args, rec, path, cached_info))
        return {"mmreplay_ReplayStore": sampler(store),
                **{name: sampler(buf) for name, buf in cached.items()},
                **numpy_rows({"mmreplay_ReplayStore": store, **cached}, args.numpy_rows)}

    sample, cpprb_rss = uniform_vs_cpprb(args, rec, rows)  # cpprb's RAM back before the floor's
    for buf in cached.values():
        buf.close()  # their RAM back too
    ours = {"mmreplay_ReplayStore": sampler(store)}
    frames = rec.frames[np.arange(args.frames) % len(rec)]  # the stream's frames, in RAM
    rng = np.random.default_rng(args.seed)
    floor = interleaved({**ours, "numpy_floor": lambda i: numpy_gather(frames, rng, 32)},
                        args.reps, args.block)
    store.close()
    return {"sample32": with_ratios(sample, "cpprb_ReplayBuffer"),
            "sample32_vs_floor": with_ratios(floor, "numpy_floor"),
            "cached": cached_info, "cpprb_rss_growth_bytes": cpprb_rss,
            "frames": args.frames}


def uniform_vs_cpprb(args: Args, rec: Any, rows: Callable[[], dict[str, Callable[[int], object]]]
                     ) -> tuple[dict[str, dict[str, float]], int]:
    """The calls `rows()` makes (after cpprb's buffer is filled) alternated with ``sample(32)``
    of cpprb's ``ReplayBuffer`` filled with the same stream (freed on return); and the RSS
    growth of filling cpprb's buffer."""
    from benchlib.baselines import stacked_steps
    from cpprb import ReplayBuffer

    before = settled_rss()
    rb: Any = ReplayBuffer(
        args.frames, {"obs": {"shape": (84, 84, 4), "dtype": np.uint8},
                      "act": {"dtype": np.int64}, "rew": {}, "done": {}},
        next_of="obs", stack_compress="obs")
    for step in stacked_steps(rec, args.frames + 100, channels_last=True, desc="fill cpprb"):
        if step.new_episode and rb.get_stored_size():
            rb.on_episode_end()
        rb.add(obs=step.obs, act=step.action, rew=step.reward, next_obs=step.next_obs,
               done=float(step.terminated))
    grown = rss_bytes() - before
    ours = rows()
    for _ in range(args.warmup):
        rb.sample(32)
        for call in ours.values():
            call(0)
    theirs: dict[str, Callable[[int], object]] = {"cpprb_ReplayBuffer": lambda i: rb.sample(32)}
    if args.numpy_rows:
        theirs["cpprb_ReplayBuffer_to_torch"] = lambda i: to_torch(rb.sample(32))
    return interleaved({**ours, **theirs}, args.reps, args.block), grown


def numpy_rows(stores: dict[str, Any], on: bool, beta: float | None = None
               ) -> dict[str, Callable[[int], object]]:
    """``sample_arrays(32)`` of each store as timed calls named ``<name>_arrays``: numpy
    arrays out, as cpprb hands them (``sample`` adds the torch tensors); none unless `on`."""
    if not on:
        return {}
    kwargs = {} if beta is None else {"beta": beta}

    def call(buf: Any) -> Callable[[int], object]:
        return lambda i: buf.sample_arrays(32, **kwargs)

    return {f"{name}_arrays": call(buf) for name, buf in stores.items()}


def to_torch(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """cpprb's batch as CPU tensors (``torch.from_numpy`` of each array), as `sample` gives."""
    import torch

    return {name: torch.from_numpy(array) for name, array in batch.items()}


# -- dqn: CartPole steps/s through the adapter ---------------------------------------------------
def dqn_section(args: Args) -> dict[str, Any]:
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.env_util import make_vec_env

    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    torch.set_num_threads(1)
    hp = dict(policy="MlpPolicy", learning_rate=2.3e-3, batch_size=64, buffer_size=100_000,
              learning_starts=1000, gamma=0.99, target_update_interval=10, train_freq=256,
              gradient_steps=128, exploration_fraction=0.16, exploration_final_eps=0.04,
              policy_kwargs=dict(net_arch=[256, 256]))  # rl-baselines3-zoo, CartPole-v1
    rates: dict[str, list[float]] = {"sb3_ReplayBuffer": [], "mmreplay_sb3_adapter": []}
    for round_ in range(args.dqn_rounds):
        for name in rates:
            extra: dict[str, Any] = {}
            if name == "mmreplay_sb3_adapter":
                path = tempfile.mkdtemp(prefix="mmreplay-overhead-") + f"/dqn{round_}"
                extra = dict(replay_buffer_class=FrameOnceReplayBuffer,
                             replay_buffer_kwargs=dict(path=path))
            model = DQN(env=make_vec_env("CartPole-v1", n_envs=1, seed=args.seed),
                        seed=args.seed, device="cpu", **hp, **extra)
            begin = time.perf_counter()
            model.learn(args.dqn_steps)
            rates[name].append(args.dqn_steps / (time.perf_counter() - begin))
            if isinstance(model.replay_buffer, FrameOnceReplayBuffer):
                model.replay_buffer.close()
    result: dict[str, Any] = {name: {"steps_per_s_each": r, "steps_per_s_median":
                                     float(np.median(r))} for name, r in rates.items()}
    result["ratio_adapter_to_sb3"] = (result["mmreplay_sb3_adapter"]["steps_per_s_median"]
                                      / result["sb3_ReplayBuffer"]["steps_per_s_median"])
    result["steps"] = args.dqn_steps
    return result


SECTIONS = {"sb3": sb3_section, "per": per_section, "uniform": uniform_section,
            "dqn": dqn_section}


# -- one code tree per subprocess ----------------------------------------------------------------
def worker(args: Args, out: str) -> None:
    import mmreplay

    result: dict[str, Any] = {"mmreplay_from": str(Path(mmreplay.__file__).parent)}
    for name in args.sections.split(","):
        result[name] = SECTIONS[name](args)
        print(json.dumps({name: result[name]}, indent=1), flush=True)
    Path(out).write_text(json.dumps(result))


def run_tree(tree: Path, argv: list[str]) -> dict[str, Any]:
    out = tempfile.mktemp(prefix="mmreplay-overhead-", suffix=".json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(SCRIPTS)])}
    subprocess.run([sys.executable, __file__, "_worker", out, *argv], env=env, check=True)
    return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        worker(tyro.cli(Args, args=sys.argv[3:], description=__doc__), sys.argv[2])
        return
    args = tyro.cli(Args, description=__doc__)
    argv = sys.argv[1:]
    trees = {"this_checkout": run_tree(ROOT, argv)}
    if args.baseline:
        more = ["--sections", args.baseline_sections] if args.baseline_sections else []
        trees["baseline"] = run_tree(Path(args.baseline).resolve(), argv + more)
    report = {"command": "python scripts/bench/bench_overhead.py " + " ".join(argv),
              "args": asdict(args), "machine": platform.platform(),
              "cpus": os.cpu_count(), "load_average": os.getloadavg(), "trees": trees,
              "note": "medians and p90 per call in microseconds; ratios are to the baseline "
                      "buffer measured in the same process, calls interleaved in blocks"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
