"""How fast each way of feeding a GPU learner runs, as a ratio to the learner's ceiling.

    python scripts/bench/bench_gpu.py                        # needs CUDA: says so and exits 0
    python scripts/bench/bench_gpu.py --quick                # small sizes, a minute or two
    python scripts/bench/bench_gpu.py --device cpu --quick --games ""   # the loops on the CPU

The learner is the Nature-CNN DQN update (online + target network, Huber loss, Adam), run
eagerly and captured in a CUDA graph (static inputs, ``Adam(capturable=True)``,
``torch.cuda.graph``: what a GPU user writes once the loop matters). Each feed hands it
batches of `--batch-sizes`, uniform and prioritized (``update_priorities(ids, |td|)`` every
step, which brings |td| back to the host):

    ceiling          one batch already on the device, reused (the learner alone)
    cpprb            cpprb ``sample`` + copy (stack_compress, channels last, permuted there)
    store_sample     ``store.sample`` + copy
    prefetch         ``store.batches(prefetch=4)`` + copy
    pinned           ``store.batches(prefetch=4, pin_memory=True)`` + ``non_blocking`` copy
    device_batches   ``store.batches(prefetch=4, device=...)``: copied by the prefetch thread
    device_batches_workers  the same from a read-only view, ``workers=--workers``
    device_batches_shared   the same from the writable store, ``workers=--workers``: one
                     prefetch thread, each read shared by the workers
    processes        ``batches(workers=--workers, processes=True, device=...)`` of the
                     read-only view: sampled by processes into shared memory, copied to
                     the device by a prefetch thread
    device_store     ``ReplayStore.create(..., device=...)``, where this mmreplay has it;
                     prioritized: |td| brought to the host every step (the learner waits)
    device_store_late  the same store, prioritized, ``update_priorities(batch.ids, |td|)``
                     with the device tensors: queued without a wait, applied by a later
                     draw (at most 2 late; docs/guides/device_frames.md)

Sampling throughput alone (no learner): ``batches(32)`` and ``batches(256)`` of a read-only
view (threads, and processes), and of the writable store, with 1, 2, 4, ... up to
`--workers` workers. Then the
wrong-batch check: batches copied ``non_blocking`` (or delivered on the device) with the GPU
kept behind (``torch.cuda._sleep``) and never synchronized; each batch's bytes on the GPU
compared with its CPU copy at the end.
`--sections` picks among the learner arms, the sampling throughput and the wrong-batch
check (``--device cpu --sections scaling``: the throughput on any machine). Writes
``gpu.json`` (`--out-name`) under `--out-dir`, again after each section (the wrong-batch
check first, then the learner, then the throughput), so a run cut short keeps what it
measured. Frames: real ALE frames of `--games` (recorded
once, cached), or synthetic ones.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import torch
import tyro
from benchlib.gpu_learner import (
    ACTIONS,
    STACK,
    DeviceBatch,
    Learner,
    example_batch,
    from_store,
)
from common import run_main

from mmreplay import InvalidInputError, ReplayStore

FEEDS = ("ceiling", "cpprb", "store_sample", "prefetch", "pinned", "device_batches",
         "device_batches_workers", "device_batches_shared", "processes", "device_store")
PRIORITIZED_FEEDS = ("cpprb", "store_sample", "prefetch", "pinned", "device_batches",
                     "device_store", "device_store_late")


@dataclass
class Args:
    device: str = "cuda"
    """where the learner runs ("cpu" runs the eager loops, as a check of this script)"""
    quick: bool = False
    """small sizes: a store of 20k frames, 40 timed steps an arm"""
    frames: int = 200_000
    """frames in each store (the recording cycled)"""
    games: str = "ALE/Breakout-v5,ALE/Pong-v5,ALE/Seaquest-v5"
    """real frames of these games (comma-separated; "" for synthetic frames)"""
    distinct_frames: int = 30_000
    """frames recorded per game (cached under data/cache)"""
    batch_sizes: str = "32,256"
    """batch sizes measured"""
    steps: int = 300
    """timed learner steps an arm"""
    warmup: int = 20
    """untimed steps before each arm"""
    check_batches: int = 400
    """batches of the wrong-batch check, per path"""
    workers: int = 16
    """most sampling threads"""
    sections: str = "learner,scaling,wrong"
    """what to run: the learner arms, the sampling throughput, the wrong-batch check"""
    seed: int = 0
    """seed of the stores, cpprb and the networks"""
    out_dir: str = "data/bench"
    """directory of the result"""
    out_name: str = "gpu.json"
    """file name of the result"""


# -- frames and buffers ----------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """Recorded steps in the order an agent saw them (see scripts/bench/ale_frames.py)."""

    frames: np.ndarray
    is_first: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray


def load_stream(args: Args) -> Stream:
    games = [g for g in args.games.split(",") if g]
    if not games:
        return synthetic_stream(args.distinct_frames, args.seed)
    from ale_frames import record_frames

    recs = [record_frames(game, args.distinct_frames, args.seed) for game in games]
    return Stream(*(np.concatenate([getattr(r, f) for r in recs])
                    for f in ("frames", "is_first", "actions", "rewards", "terminated")))


def synthetic_stream(n: int, seed: int) -> Stream:
    """Frames of a few bright blocks on black (compressible, each frame different)."""
    rng = np.random.default_rng(seed)
    frames = np.zeros((n, 84, 84), np.uint8)
    for i, (y, x) in enumerate(rng.integers(0, 76, (n, 2))):
        frames[i, y:y + 8, x:x + 8] = 40 + i % 200
    is_first = np.arange(n) % 400 == 0
    terminated = np.roll(is_first, -1) & ~is_first
    return Stream(frames, is_first, rng.integers(0, ACTIONS, n), rng.random(n, np.float32),
                  terminated)


def fill_store(store: ReplayStore, stream: Stream, count: int) -> None:
    n = len(stream.frames)
    for i in range(count):
        j = i % n
        if stream.is_first[j] or i == 0:
            store.reset(stream.frames[j])
        else:
            store.add(int(stream.actions[j]), float(stream.rewards[j]), stream.frames[j],
                      bool(stream.terminated[j]), False)
    store.flush()


def make_cpprb(stream: Stream, count: int, prioritized: bool) -> Any:
    """cpprb's buffer of the same steps (stack_compress), or None without cpprb."""
    try:
        import cpprb
    except ImportError:
        return None

    kind = cpprb.PrioritizedReplayBuffer if prioritized else cpprb.ReplayBuffer
    rb = kind(count, {"obs": {"shape": (84, 84, STACK), "dtype": np.uint8},
                      "act": {"dtype": np.int64}, "rew": {}, "done": {}},
              next_of="obs", stack_compress="obs")
    stack, n = np.zeros((84, 84, STACK), np.uint8), len(stream.frames)
    for i in range(count):
        j = i % n
        nxt = np.concatenate([stack[..., 1:], stream.frames[j][..., None]], axis=-1)
        if stream.is_first[j] or i == 0:
            if rb.get_stored_size():
                rb.on_episode_end()
            stack = np.concatenate([np.zeros((84, 84, STACK - 1), np.uint8),
                                    stream.frames[j][..., None]], axis=-1)
            continue
        rb.add(obs=stack, act=int(stream.actions[j]), rew=float(stream.rewards[j]),
               next_obs=nxt, done=float(stream.terminated[j]))
        stack = nxt
    return rb


def cpprb_batch(sample: dict[str, np.ndarray], device: torch.device) -> DeviceBatch:
    def move(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)
    weights = sample.get("weights", np.ones(len(sample["rew"]), np.float32))
    return DeviceBatch(obs=move(sample["obs"]).permute(0, 3, 1, 2).contiguous(),
                       next_obs=move(sample["next_obs"]).permute(0, 3, 1, 2).contiguous(),
                       action=move(sample["act"]).view(-1).long(),
                       reward=move(sample["rew"]).view(-1).float(),
                       discount=0.99 * (1 - move(sample["done"]).view(-1).float()),
                       weights=move(weights).view(-1).float())


@dataclass
class Buffers:
    """The stores (uniform, prioritized), cpprb's buffers, a device-resident store if any."""

    store: ReplayStore
    pstore: ReplayStore
    reader: ReplayStore  # read-only view of `store`'s directory
    cpprb: Any
    pcpprb: Any
    device_store: ReplayStore | None
    pdevice_store: ReplayStore | None


def device_store(root: Path, name: str, stream: Stream, count: int, device: torch.device,
                 **kw: Any) -> ReplayStore | None:
    """A store with every frame in device memory, where this mmreplay has one."""
    try:
        store = ReplayStore.create(root / name, capacity=count, obs_shape=(84, 84),
                                   frame_stack=STACK, seed=0, device=device, **kw)
    except (TypeError, InvalidInputError) as exc:  # no ``device=`` on create in this tree
        if "device" not in str(exc):
            raise
        return None
    fill_store(store, stream, count)
    return store


def make_buffers(root: Path, stream: Stream, count: int, device: torch.device) -> Buffers:
    stores = [ReplayStore.create(root / name, capacity=count, obs_shape=(84, 84),
                                 frame_stack=STACK, seed=0, **kw)
              for name, kw in (("u", {}), ("p", {"sampler": "prioritized"}))]
    for store in stores:
        fill_store(store, stream, count)
    reader = ReplayStore.open(root / "u", mode="r")
    return Buffers(stores[0], stores[1], reader, make_cpprb(stream, count, False),
                   make_cpprb(stream, count, True),
                   device_store(root, "du", stream, count, device),
                   device_store(root, "dp", stream, count, device, sampler="prioritized"))


# -- feeds -----------------------------------------------------------------------------------
Get = Callable[[], tuple[DeviceBatch, Any]]
Prioritize = Callable[[Any, torch.Tensor], None]


@contextmanager
def open_feed(name: str, bufs: Buffers, size: int, prioritized: bool, device: torch.device,
              ceiling: DeviceBatch, workers: int) -> Iterator[tuple[Get, Prioritize] | None]:
    """The feed `name` as (get a batch and its ids, set priorities), or None where it is
    not available here (cpprb not installed, no CUDA for pinned memory, no device store)."""
    store = bufs.pstore if prioritized else bufs.store
    with ExitStack() as stack:
        if name == "ceiling":
            yield (lambda: (ceiling, None)), _no_priorities
        elif name == "cpprb":
            yield None if bufs.cpprb is None else cpprb_feed(bufs, size, prioritized, device)
        elif name in ("device_store", "device_store_late"):
            ds = bufs.pdevice_store if prioritized else bufs.device_store
            yield None if ds is None else store_feed(lambda: ds.sample(size), ds, device,
                                                     late=name == "device_store_late")
        elif name == "pinned" and device.type != "cuda":
            yield None
        elif name == "store_sample":
            yield store_feed(lambda: store.sample(size), store, device)
        elif name == "processes":
            it = stack.enter_context(bufs.reader.batches(size, prefetch=2 * workers,
                                                         workers=workers, processes=True,
                                                         device=device))
            yield store_feed(lambda: next(it), store, device)
        elif name in ("device_batches_workers", "device_batches_shared"):
            source = bufs.reader if name == "device_batches_workers" else store
            it = stack.enter_context(source.batches(size, prefetch=2 * workers, device=device,
                                                    workers=workers))
            yield store_feed(lambda: next(it), store, device)
        else:
            kw = {"prefetch": {}, "pinned": {"pin_memory": True},
                  "device_batches": {"device": device}}[name]
            it = stack.enter_context(store.batches(size, prefetch=4, **kw))
            yield store_feed(lambda: next(it), store, device, non_blocking=name == "pinned")


def _no_priorities(ids: Any, td: torch.Tensor) -> None:
    return None


def store_feed(sample: Callable[[], Any], store: ReplayStore, device: torch.device, *,
               non_blocking: bool = False, late: bool = False) -> tuple[Get, Prioritize]:
    """`late`: priorities handed over as tensors where they are (``late=True``: queued even
    on the CPU, as on CUDA by default), else brought to the host first (a wait a step)."""
    def get() -> tuple[DeviceBatch, Any]:
        batch = sample()
        return from_store(batch, device, non_blocking), batch.ids

    def prioritize(ids: Any, td: torch.Tensor) -> None:
        if late:
            store.update_priorities(ids, td.detach() + 1e-6, late=True)
        else:
            store.update_priorities(ids.cpu().numpy(), td.cpu().numpy() + 1e-6)
    return get, prioritize


def cpprb_feed(bufs: Buffers, size: int, prioritized: bool,
               device: torch.device) -> tuple[Get, Prioritize]:
    rb = bufs.pcpprb if prioritized else bufs.cpprb

    def get() -> tuple[DeviceBatch, Any]:
        sample = rb.sample(size, beta=0.4) if prioritized else rb.sample(size)
        return cpprb_batch(sample, device), sample.get("indexes")

    def prioritize(indexes: Any, td: torch.Tensor) -> None:
        rb.update_priorities(indexes, td.cpu().numpy() + 1e-6)
    return get, prioritize


# -- measuring -------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def updates_per_s(learner: Learner, get: Get, prioritize: Prioritize | None, *, steps: int,
                  warmup: int, device: torch.device) -> float:
    """Learner updates a second on batches of `get` (priorities set after each when given)."""
    start = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        batch, ids = get()
        td = learner(batch)
        if prioritize is not None:
            prioritize(ids, td)
    sync(device)
    return steps / (time.perf_counter() - start)


def learner_arms(bufs: Buffers, args: Args, device: torch.device,
                 saved: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Every arm's updates a second; `saved` is given the arms so far after each one."""
    modes = ("eager", "graph") if device.type == "cuda" else ("eager",)
    arms: list[dict[str, Any]] = []

    def measured(arm: dict[str, Any]) -> None:
        arms.append(arm)
        saved(arms)

    for mode in modes:
        for size in (int(s) for s in args.batch_sizes.split(",")):
            learner = Learner(device, size, graph=mode == "graph")
            ceiling = learner.static if mode == "graph" else example_batch(device, size)
            feed_arms(learner, bufs, args, device, mode, size, ceiling, measured)
    return arms


def feed_arms(learner: Learner, bufs: Buffers, args: Args, device: torch.device, mode: str,
              size: int, ceiling: DeviceBatch, measured: Callable[[dict[str, Any]], None]
              ) -> None:
    """The arms of one learner, each handed to `measured` as it is done."""
    top = None
    for sampler, feeds in (("uniform", FEEDS), ("prioritized", PRIORITIZED_FEEDS)):
        for name in feeds:
            with open_feed(name, bufs, size, sampler == "prioritized", device, ceiling,
                           args.workers) as feed:
                if feed is None:
                    continue
                rate = updates_per_s(learner, feed[0],
                                     feed[1] if sampler == "prioritized" else None,
                                     steps=args.steps, warmup=args.warmup, device=device)
            top = rate if name == "ceiling" else top
            arm = dict(mode=mode, batch_size=size, sampler=sampler, feed=name,
                       updates_per_s=round(rate, 1), ratio=round(rate / top, 3) if top else None)
            print(f"{mode:5s} {size:4d} {sampler:11s} {name:15s} {rate:9.1f}/s  "
                  f"{arm['ratio']}", flush=True)
            measured(arm)


# -- sampling throughput ---------------------------------------------------------------------
def worker_scaling(bufs: Buffers, most: int, frames: int = 20_000
                   ) -> dict[str, dict[str, dict[str, float]]]:
    """Batches a second of ``batches(32)`` and ``batches(256)`` with 1, 2, 4, ... `most`
    workers: from a read-only view (a view a worker thread; processes) and from the writable
    store (reads shared), ~`frames` batches' frames timed each."""
    counts = [1 << k for k in range(most.bit_length()) if 1 << k <= most]
    rates: dict[str, dict[str, dict[str, float]]] = {}
    for kind, store, processes in (("read_only", bufs.reader, False),
                                   ("processes", bufs.reader, True),
                                   ("writable", bufs.store, False)):
        for size in (32, 256):
            by = rates.setdefault(kind, {}).setdefault(str(size), {})
            batches = max(50, frames // size)
            for workers in counts:
                with store.batches(size, prefetch=2 * workers, workers=workers,
                                   processes=processes) as it:
                    for _ in range(10):
                        next(it)
                    start = time.perf_counter()
                    for _ in range(batches):
                        next(it)
                    by[str(workers)] = round(batches / (time.perf_counter() - start), 1)
                print(f"sampling {kind:9s} batch {size:3d}, {workers:2d} workers: "
                      f"{by[str(workers)]:8.1f} batches/s ({by[str(workers)] / by['1']:.2f}x "
                      f"one)", flush=True)
    return rates


# -- the wrong-batch check -------------------------------------------------------------------
def lagging(get: Callable[[], Any], store: ReplayStore, count: int) -> dict[str, int]:
    """`count` batches, each taken while the GPU is kept behind and used at once without a
    sync, then dropped; at the end each result is compared with what `get` of its ids reads."""
    kept = []
    for _ in range(count):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: copies and kernels stay queued
        ids, obs, next_obs = get()
        # ids on the device are cloned, not brought back: `.cpu()` would wait for the GPU
        kept.append((ids.clone() if ids.is_cuda else ids, obs, next_obs))
        del obs, next_obs
    torch.cuda.synchronize()
    wrong = 0
    for ids, obs, next_obs in kept:
        again = store.get(ids.cpu().numpy())
        wrong += not (torch.equal(obs.cpu(), again.obs.cpu())
                      and torch.equal(next_obs.cpu(), again.next_obs.cpu()))
    return {"wrong": wrong, "of": count}


def wrong_batch_check(bufs: Buffers, count: int) -> dict[str, dict[str, int]]:
    store, cuda = bufs.store, torch.device("cuda")
    found: dict[str, dict[str, int]] = {}

    def copied(batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        return (batch.ids, batch.obs.to(cuda, non_blocking=True),
                batch.next_obs.to(cuda, non_blocking=True))

    def used(batch: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        return batch.ids, batch.obs + 0, batch.next_obs * 1  # kernels on the current stream

    def whole_frames() -> tuple[Any, torch.Tensor, torch.Tensor]:
        arrays = store.sample_arrays(32, pin_memory=True)
        frames = torch.from_numpy(arrays.frames).to(cuda, non_blocking=True)
        return torch.from_numpy(arrays.ids), frames[0], frames[1]

    def numpy_views() -> tuple[Any, torch.Tensor, torch.Tensor]:
        arrays = store.sample_arrays(32, pin_memory=True)
        return (torch.from_numpy(arrays.ids),
                torch.from_numpy(arrays.obs).to(cuda, non_blocking=True),
                torch.from_numpy(arrays.next_obs).to(cuda, non_blocking=True))

    for name, kw, hand in (("pageable_batches", {}, copied),
                           ("pinned_batches", {"pin_memory": True}, copied),
                           ("device_batches", {"device": cuda}, used)):
        with store.batches(32, prefetch=4, **kw) as it:
            found[name] = lagging(lambda it=it, hand=hand: hand(next(it)), store, count)
    found["pinned_sample_arrays"] = lagging(whole_frames, store, count)
    found["pinned_numpy_views"] = lagging(numpy_views, store, count)
    with bufs.reader.batches(32, prefetch=4, workers=2, processes=True, device=cuda) as it:
        found["process_batches"] = lagging(lambda: used(next(it)), bufs.reader, count)
    if bufs.device_store is not None:
        ds = bufs.device_store
        found["device_store"] = lagging(lambda: used(ds.sample(32)), ds, count)
    for name, result in found.items():
        print(f"wrong batches, {name}: {result['wrong']} of {result['of']}", flush=True)
    return found


# -- main ------------------------------------------------------------------------------------
def main() -> int:
    args = tyro.cli(Args, description=__doc__)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: CUDA is not available here (torch.cuda.is_available() is False): "
              "nothing to measure")
        return 0
    if args.quick:
        args.frames, args.distinct_frames = min(args.frames, 20_000), min(args.distinct_frames,
                                                                           5_000)
        args.steps, args.warmup = min(args.steps, 40), min(args.warmup, 5)
    sections = args.sections.split(",")
    if unknown := set(sections) - {"learner", "scaling", "wrong"}:
        raise InvalidInputError(f"--sections takes learner, scaling, wrong; got {sorted(unknown)}")
    stream = load_stream(args)
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        bufs = make_buffers(Path(tmp), stream, args.frames, device)
        found: dict[str, Any] = {"arms": [], "scaling": {}, "wrong": {}}
        try:  # the result is written after each section: a run cut short keeps what it has
            def save(arms: list[dict[str, Any]]) -> None:
                write_result(args, arms, found["scaling"], found["wrong"], say=False)

            for section in ("wrong", "learner", "scaling"):
                if section in sections:
                    found[section_key(section)] = run_section(section, bufs, args, device, save)
                    write_result(args, found["arms"], found["scaling"], found["wrong"])
        finally:
            for store in (bufs.reader, bufs.store, bufs.pstore, bufs.device_store,
                          bufs.pdevice_store):
                if store is not None:
                    store.close()
    return 0


def section_key(section: str) -> str:
    return "arms" if section == "learner" else section


def run_section(section: str, bufs: Buffers, args: Args, device: torch.device,
                save: Callable[[list[dict[str, Any]]], None]) -> Any:
    """One section's figures: the learner arms (each saved as it is done), the sampling
    throughput, or the wrong-batch check (CUDA only: elsewhere nothing can lag; {})."""
    if section == "learner":
        return learner_arms(bufs, args, device, save)
    if section == "scaling":
        return worker_scaling(bufs, args.workers)
    return wrong_batch_check(bufs, args.check_batches) if device.type == "cuda" else {}


def write_result(args: Args, arms: list[dict[str, Any]], scaling: dict[str, Any],
                 wrong: dict[str, Any], *, say: bool = True) -> None:
    from benchlib.harness import machine_info, write_json

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    result = dict(args=asdict(args), machine={**machine_info(), "gpu": gpu}, arms=arms,
                  sampling_batches_per_s_by_workers=scaling, wrong_batches=wrong)
    path = write_json(result, Path(args.out_dir), args.out_name)
    if say:
        print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
