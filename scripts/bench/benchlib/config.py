"""The bench's arguments (`Args`), its sections and the `--quick` sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import CACHE_DIR
from common import UsageError

SECTIONS = ("core", "ram", "disk", "cold", "open", "flush")


SCALE_SECTIONS = {"ram", "cold", "open", "flush"}  # these need the scale store


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames the core and scale sections use"""
    frames: int = 100_000
    """core: frames recorded and held by the store that `sample` is timed on"""
    add_steps: int = 20_000
    """core: frames (steps plus episode starts) fed to a fresh store to time `add`"""
    batch_size: int = 32
    """transitions per sampled batch"""
    reps: int = 500
    """timed calls per warm latency figure"""
    warmup: int = 20
    """untimed calls before each latency figure"""
    seed: int = 0
    """seed of the recordings, the stores and the baselines' index draws"""
    out_dir: str = "data/bench"
    """directory of the JSON result"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""
    quick: bool = False
    """tiny run for smoke tests (few frames, few reps, two workers at a time); writes
    core_quick.json"""
    sections: str = ",".join(SECTIONS)
    """comma-separated sections to run (see the module docstring)"""
    scale_frames: int = 1_000_000
    """ram/cold/open/flush: frames held by the scale stores"""
    distinct_frames: int = 200_000
    """real frames recorded for the scale stores, cycled to reach --scale-frames"""
    small_frames: int = 100_000
    """ram: frames held by SB3 and TorchRL (4-stacks per step) and by mmreplay/cpprb beside them"""
    disk_games: str = "Pong,Breakout,MsPacman,Seaquest,SpaceInvaders"
    """disk: ALE games (ALE/<Game>-v5), random policy"""
    disk_frames: int = 30_000
    """disk: real frames recorded and stored per game"""
    cold_reps: int = 200
    """cold: timed sample calls with cache_bytes=1, page cache warm"""
    page_cold_reps: int = 50
    """cold: timed sample calls after the frame files left the page cache"""
    naive_reps: int = 100
    """cold: timed naive-zarr calls on the scale store (slow)"""
    flush_steps: int = 10_000
    """flush: steps added before each timed flush"""
    flush_small: int = 100_000
    """flush: capacity of the small store the scale store is compared with"""
    flush_rounds: int = 3
    """flush: timed (add --flush-steps, flush) rounds per store; the median counts"""
    drop_caches: bool = False
    """also write 3 to /proc/sys/vm/drop_caches (whole machine, needs root) when evicting"""
    steady_malloc: bool = True
    """pin glibc's mmap/trim thresholds (see `steady_malloc`) in every bench process"""


# every latency figure still gets a median and a p90 of several calls (the tests check both)
QUICK = {"frames": 2000, "add_steps": 2000, "reps": 10, "warmup": 2, "scale_frames": 3000,
         "distinct_frames": 2000, "small_frames": 1000, "disk_frames": 300, "cold_reps": 10,
         "page_cold_reps": 5, "naive_reps": 3, "flush_steps": 500, "flush_small": 1000,
         "flush_rounds": 2}


def parse_args(description: str) -> Args:
    """`Args` from the command line (tyro), with `--quick`'s sizes applied and the sections
    checked."""
    args = tyro.cli(Args, description=description)
    if args.quick:
        args = replace(args, disk_games="Pong,Breakout",
                       **{name: min(getattr(args, name), value) for name, value in QUICK.items()})
    unknown = set(sections_of(args)) - set(SECTIONS)
    if unknown:
        raise UsageError(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


def sections_of(args: Args) -> list[str]:
    return [name.strip() for name in args.sections.split(",") if name.strip()]
