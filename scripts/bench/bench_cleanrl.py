"""cleanrl's dqn_atari.py data path into `FrameOnceReplayBuffer`, beside SB3's own buffer.

    python scripts/bench/bench_cleanrl.py                       # 200k steps, 1M buffer (~2 min)
    python scripts/bench/bench_cleanrl.py --steps 20000 --sb3-steps 5000 --cartpole-steps 20000

Sections, in one process, each on buffers of its own:

    rss       `--steps` cleanrl-style adds (one env, ``(4, 84, 84)`` stacks padded with the
              first frame, ``real_next_obs`` replaced on truncation only, gymnasium ``infos``)
              into a buffer of `--buffer-size` transitions: RSS growth (VmRSS, RssAnon,
              RssFile, peak; the buffer commits the store every `--flush-every` adds) and
              the store's disk bytes. Measured after a first use of the compiled kernels
              (a short run through a small buffer, its growth recorded apart: the
              libraries a process loads once, whatever the buffer's size).
              Frames: real Breakout frames (`ale_frames`, `--distinct-frames` recorded,
              cycled), episodes cut at `--max-episode-steps` (truncations) and at the
              recording's own ends.
    sb3_rss   SB3's ``ReplayBuffer(optimize_memory_usage=True, handle_timeout_termination=False)``
              of `--sb3-steps` transitions filled with the same stream: RSS growth, and that
              growth per step times `--buffer-size` (SB3 at 1M would hold 28 GB of stacks).
    add       the same stream, `--sb3-steps` adds, into a fresh `--buffer-size` adapter and an
              SB3 buffer of `--sb3-steps`, timed in turns of `--block` calls: µs per add.
    cartpole  SB3-style adds of ``(4,)`` float32 observations (one env, an episode end every
              200 steps with ``terminal_observation`` in ``infos`` and a fresh obs after it),
              adapter and SB3 ``ReplayBuffer`` in turns of `--block` calls: µs per add (the
              adapter's recording of its staged steps included).

Figures only (medians, 90th percentiles, means; ratios of medians to SB3 in the same
process); nothing is asserted. Writes `--out` (JSON).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import AleFrames, record_frames
from benchlib.harness import (
    machine_info,
    memory_growth,
    memory_status,
    write_json,
)
from common import dir_bytes, run_main

STACK = 4


@dataclass
class Args:
    steps: int = 200_000
    """cleanrl-style adds into the `--buffer-size` buffer (rss)"""
    buffer_size: int = 1_000_000
    """the adapter's buffer_size, cleanrl's default"""
    sb3_steps: int = 20_000
    """SB3's buffer size and adds (sb3_rss, add); at 1M it would allocate 28 GB"""
    distinct_frames: int = 20_000
    """real Breakout frames recorded (cached under data/cache) and cycled"""
    max_episode_steps: int = 400
    """episodes are truncated at this length (a TimeLimit), besides the recording's ends"""
    flush_every: int = 100_000
    """the adapter's ``flush_every`` (0: it commits the store only when closed)"""
    cartpole_steps: int = 100_000
    """adds per buffer in the cartpole section"""
    block: int = 500
    """calls per block when two buffers are timed in turns"""
    sections: str = "rss,sb3_rss,add,cartpole"
    """comma-separated sections to run"""
    seed: int = 0
    """seed of the recording and of the streams"""
    work_dir: str = ""
    """where the stores go (default: a temporary folder)"""
    out: str = "data/bench/cleanrl.json"
    """where the JSON goes"""


# -- the cleanrl stream ------------------------------------------------------------------------
def cleanrl_stream(rec: AleFrames, steps: int, max_len: int,
                   seed: int) -> Iterator[tuple[Any, ...]]:
    """``(obs, real_next_obs, actions, rewards, terminations, infos)`` per step, as cleanrl's
    loop hands them to ``rb.add`` on a gymnasium ``SyncVectorEnv`` (same-step autoreset) of
    one ``FrameStackObservation`` env: the frames of `rec`, cycled; an episode ends at the
    recording's ends (terminated) or after `max_len` steps (truncated)."""
    rng = np.random.default_rng(seed)
    frames, n = rec.frames, len(rec.frames)
    i, length = 0, 0
    obs = np.repeat(frames[0][None], STACK, axis=0)[None]  # the reset stack: o_0 four times
    for _ in range(steps):
        i = (i + 1) % n
        nxt = np.concatenate([obs[0, 1:], frames[i][None]])[None]
        length += 1
        term = bool(rec.terminated[i])
        trunc = not term and (length >= max_len or bool(rec.is_first[(i + 1) % n]))
        infos: dict[str, Any] = {}
        if term or trunc:
            i = (i + 1) % n  # the next episode's first frame
            reset = np.repeat(frames[i][None], STACK, axis=0)[None]
            infos = {"final_obs": np.array([nxt[0]]), "_final_obs": np.array([True])}
            real_next, after, length = (reset if term else nxt), reset, 0
        else:
            real_next, after = nxt, nxt
        yield (obs, real_next, rng.integers(0, 4, 1), np.array([float(rec.rewards[i])]),
               np.array([term]), infos)
        obs = after


def timed(add: Callable[..., object], stream: Iterator[tuple[Any, ...]],
          spent: np.ndarray) -> np.ndarray:
    """Seconds of each ``add`` over `stream`, into `spent` (allocated by the caller, before
    it reads the RSS: a list of a million floats would be 30 MiB of the growth)."""
    clock = time.perf_counter
    n = 0
    for step in stream:
        begin = clock()
        add(*step)
        spent[n] = clock() - begin
        n += 1
    return spent[:n]


def summary(seconds: list[float] | np.ndarray) -> dict[str, float]:
    us = np.asarray(seconds) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
            "mean_us": float(us.mean()), "calls": int(us.size)}


def ratios(figures: dict[str, dict[str, float]], base: str) -> dict[str, Any]:
    return {name: {**f, "ratio_to_" + base: f["median_us"] / figures[base]["median_us"]}
            for name, f in figures.items()}


def atari_buffers(args: Args, root: Path, name: str, sb3_size: int) -> tuple[Any, Any]:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer

    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    space, act = spaces.Box(0, 255, (STACK, 84, 84), np.uint8), spaces.Discrete(4)
    ours = FrameOnceReplayBuffer(args.buffer_size, space, act, "cpu", optimize_memory_usage=True,
                                 handle_timeout_termination=False, path=root / name,
                                 frame_stack=STACK, channels_order="first", seed=args.seed,
                                 flush_every=args.flush_every or None)
    theirs = None
    if sb3_size:
        theirs = ReplayBuffer(sb3_size, space, act, "cpu", optimize_memory_usage=True,
                              handle_timeout_termination=False)
    return ours, theirs


# -- sections ----------------------------------------------------------------------------------
def first_use(args: Args, rec: AleFrames, root: Path) -> dict[str, float]:
    """RSS the process gains the first time it records and samples at all (compiled kernels
    and the libraries they load, once per process, whatever the buffer size): a
    `--block`-step run through a small buffer."""
    gc.collect()
    before = memory_status()
    small, _ = atari_buffers(Args(**{**asdict(args), "buffer_size": 10 * args.block}), root,
                             "first_use", 0)
    for step in cleanrl_stream(rec, args.block, args.max_episode_steps, args.seed):
        small.add(*step)
    small.sample(32)
    small.close()
    return memory_growth(before, memory_status())


def rss_section(args: Args, rec: AleFrames, root: Path) -> dict[str, Any]:
    once = first_use(args, rec, root)
    spent = np.full(args.steps, np.nan)  # touched now, not while measured
    gc.collect()
    before = memory_status()
    ours, _ = atari_buffers(args, root, "rss", 0)
    start = time.perf_counter()
    spent = timed(ours.add, cleanrl_stream(rec, args.steps, args.max_episode_steps, args.seed),
                  spent)
    wall = time.perf_counter() - start
    counts = ours.store.counts
    adding = memory_growth(before, memory_status())
    ours.store.flush()  # the buffer commits every `flush_every` adds; this is the last one
    grown = memory_growth(before, memory_status())
    disk = dir_bytes(root / "rss")
    ours.close()
    print(f"rss: {args.steps} adds into a {args.buffer_size} buffer: RSS +{grown['VmRSS']:.0f} "
          f"MiB (anon +{grown.get('RssAnon', 0):.0f}, peak +{grown['VmHWM']:.0f}; first use of "
          f"the kernels before it: +{once['VmRSS']:.0f} MiB), add median "
          f"{np.median(spent) * 1e6:.1f} us, disk {disk / 2**20:.0f} MiB", flush=True)
    return {"steps": args.steps, "buffer_size": args.buffer_size, "rss_growth_mib": grown,
            "rss_growth_before_last_flush_mib": adding,
            "first_use_rss_growth_mib": once, "add": summary(spent), "wall_s": wall,
            "disk_bytes": disk, "frames_written": counts.frames_written,
            "transitions": counts.transitions, "episodes": counts.episodes}


def sb3_rss_section(args: Args, rec: AleFrames, root: Path) -> dict[str, Any]:
    spent = np.full(args.sb3_steps, np.nan)
    gc.collect()
    before = memory_status()
    _, theirs = atari_buffers(args, root, "unused", args.sb3_steps)
    spent = timed(theirs.add, cleanrl_stream(rec, args.sb3_steps, args.max_episode_steps,
                                             args.seed), spent)
    grown = memory_growth(before, memory_status())
    per_step = grown["VmRSS"] / args.sb3_steps
    del theirs
    print(f"sb3_rss: {args.sb3_steps} adds: RSS +{grown['VmRSS']:.0f} MiB, "
          f"{per_step * 2**10:.1f} KiB/step, x{args.buffer_size}: "
          f"{per_step * args.buffer_size / 2**10:.1f} GiB", flush=True)
    return {"steps": args.sb3_steps, "rss_growth_mib": grown, "add": summary(spent),
            "rss_mib_per_step": per_step,
            "rss_gib_at_buffer_size": per_step * args.buffer_size / 2**10}


def add_section(args: Args, rec: AleFrames, root: Path) -> dict[str, Any]:
    ours, theirs = atari_buffers(args, root, "add", args.sb3_steps)
    steps = list(cleanrl_stream(rec, args.sb3_steps, args.max_episode_steps, args.seed))
    figures = in_turns({"mmreplay_sb3_adapter": ours.add, "sb3_ReplayBuffer": theirs.add},
                       steps, args.block)
    ours.close()
    return report("add", ratios(figures, "sb3_ReplayBuffer"))


def cartpole_stream(steps: int, seed: int) -> list[tuple[Any, ...]]:
    """SB3-style adds of one CartPole-like env: an episode ends (terminated) every 200 steps,
    ``next_obs`` then its terminal observation (also in ``infos``) and ``obs`` a fresh one."""
    rng = np.random.default_rng(seed)
    out, obs = [], rng.standard_normal((1, 4)).astype(np.float32)
    for t in range(steps):
        nxt = rng.standard_normal((1, 4)).astype(np.float32)
        end = t % 200 == 199
        infos = [{"terminal_observation": nxt[0].copy()} if end else {}]
        out.append((obs, nxt, rng.integers(0, 2, (1, 1)), np.ones(1, np.float32),
                    np.array([end]), infos))
        obs = rng.standard_normal((1, 4)).astype(np.float32) if end else nxt
    return out


def cartpole_section(args: Args, root: Path) -> dict[str, Any]:
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer

    from mmreplay.integrations.sb3 import FrameOnceReplayBuffer

    space, act = spaces.Box(-10, 10, (4,), np.float32), spaces.Discrete(2)
    n = args.cartpole_steps
    ours = FrameOnceReplayBuffer(n + 10, space, act, "cpu", path=root / "cartpole",
                                 seed=args.seed)
    theirs = ReplayBuffer(n + 10, space, act, "cpu")
    figures = in_turns({"mmreplay_sb3_adapter": ours.add, "sb3_ReplayBuffer": theirs.add},
                       cartpole_stream(n, args.seed), args.block)
    assert ours.store.counts.transitions == n  # the stream went in (and was recorded)
    ours.close()
    return report("cartpole", ratios(figures, "sb3_ReplayBuffer"))


def in_turns(adds: dict[str, Callable[..., object]], steps: list[tuple[Any, ...]],
             block: int) -> dict[str, dict[str, float]]:
    """Each buffer's ``add`` over `steps`, `block` calls at a time in turns, timed per block
    (so a staged adapter's block recording is counted): figures per call."""
    per_call: dict[str, list[float]] = {name: [] for name in adds}
    clock = time.perf_counter
    for lo in range(0, len(steps), block):
        chunk = steps[lo:lo + block]
        for name, add in adds.items():
            begin = clock()
            for step in chunk:
                add(*step)
            per_call[name].append((clock() - begin) / len(chunk))
    return {name: summary(spent[1:] or spent) for name, spent in per_call.items()}


def report(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = figures["mmreplay_sb3_adapter"], figures["sb3_ReplayBuffer"]
    print(f"{name}: adapter {ours['median_us']:.1f} us/add, SB3 {theirs['median_us']:.1f} "
          f"us/add (x{ours['ratio_to_sb3_ReplayBuffer']:.2f})", flush=True)
    return figures


def main() -> None:
    import stable_baselines3  # noqa: F401  (imported before any RSS is read)

    import mmreplay.integrations.sb3  # noqa: F401

    args = tyro.cli(Args, description=__doc__)
    sections = args.sections.split(",")
    rec = record_frames("ALE/Breakout-v5", args.distinct_frames, seed=args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench_cleanrl_", dir=args.work_dir or None))
    try:
        result: dict[str, Any] = {"args": asdict(args), "machine": machine_info()}
        for name, run in (("rss", rss_section), ("sb3_rss", sb3_rss_section),
                          ("add", add_section)):
            if name in sections:
                result[name] = run(args, rec, root)
        if "cartpole" in sections:
            result["cartpole"] = cartpole_section(args, root)
        out = Path(args.out)
        path = write_json(result, out.parent, out.name)
        print(f"wrote {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
