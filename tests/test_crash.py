"""Crash safety: SIGKILL a recording writer, reopen, compare with a crash-free replay.

A writer process (`crash_writer.run_writer`) records a deterministic stream (16x16 frames that
encode env and frame number, ``chunk_frames`` 3-4, rings of 37-200 slots per env that wrap many
times, frame_stack 4, n_step 3, terminations, truncations, cuts, samples) and flushes every 1-10
ops. Writers are forked from a forkserver that has imported mmreplay, its kernel modules and
torch already, so a kill cycle costs milliseconds rather than an interpreter start and ~4 s of
imports. The parent SIGKILLs the writer at a
random moment, or the writer SIGKILLs itself just before or after the n-th atomic rename onto a
chunk, step/tail file or the manifest. After every kill:

* ``open(path, "r")`` and ``open(path)`` succeed; the writable open leaves ``tmp/`` empty and
  no ``.npy`` file the manifest does not name;
* the store sits at a flush point of the stream, at or after the last flush the side file
  recorded and no later than the next one; its generation is at least the recorded one;
* against a reference store fed the same stream up to that point in-process, without crashes:
  counts agree, reopened ids are a subset, every reopened id is bit-identical in every field
  (and its newest obs frame decodes to the right env and frame number), and every reference
  id is present unless its stack reads a frame below the given-up bound;
* the RNG is the one committed with that state (the writer logs it as each flush begins), and
  while no crash in the trial has lost a transition a read-only view of the store and of the
  reference sample the same ids.

Given-up bound, per env: a chunk write after the last commit gives up at most the frames it
overwrites plus ``ahead = max(chunk_frames, slots_per_env // 16)``, and the dead writer wrote
no further than the next flush point, so frames below
``frames_at(next flush) - slots_per_env + ahead`` may be gone, none at or above.

Each trial is a chain: the next writer resumes from the reopened store; at the end the store
also records and flushes in-process and is compared again. ``MMREPLAY_LONG=1``: 10x trials.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest
from crash_writer import (
    Stream,
    StreamConfig,
    abandon,
    read_rng_states,
    read_side,
    run_writer,
)

from mmreplay import ReplayStore

pytestmark = pytest.mark.integration  # crash loops: writer processes killed with SIGKILL

LONG = os.environ.get("MMREPLAY_LONG") == "1"
RANDOM_SEEDS = 20 if LONG else 2  # per config, each a chain of KILLS_PER_TRIAL kills
INJECTED_SEEDS = 10 if LONG else 1  # per config, each a chain of INJECTIONS_PER_TRIAL crashes
KILLS_PER_TRIAL = 4
INJECTIONS_PER_TRIAL = 6
MAX_KILL_DELAY = 0.25  # seconds after the writer reports it is recording
CONTINUE_OPS = 150
FIELDS = ("obs", "next_obs", "action", "reward", "discount", "terminated", "truncated", "ids")

CONFIGS = {
    "1env": StreamConfig(capacity=64),
    "2env": StreamConfig(capacity=80, num_envs=2, p_reset=0.05, p_cut=0.02),
    # 37 slots per env: the ring's last chunk holds one slot; 8 step blocks of 5 slots
    "2env_short_chunk_first": StreamConfig(
        capacity=75, num_envs=2, stack_padding="first", block_slots=5, max_flush_gap=3),
    # 200 slots: ahead = 200 // 16 = 12 frames > chunk_frames
    "1env_wide_ahead": StreamConfig(capacity=200, chunk_frames=3, block_slots=64,
                                    max_flush_gap=10),
}
STATS: Counter[str] = Counter()


@pytest.fixture(scope="module")
def ctx() -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context("forkserver")
    # What each writer would otherwise import and load for itself: torch (its samples'
    # batches, ~3 s), the kernel modules and their compiled kernels (~1 s; `crash_warmup`
    # runs them once). The server ignores the test's sys.path (CPython), so it gets tests/
    # through PYTHONPATH as it starts; a failed preload is silent (the writers then load it).
    context.set_forkserver_preload(["mmreplay", "torch", "mmreplay.kernels.numba_kernels",
                                    "mmreplay.kernels.tree_kernels",
                                    "mmreplay.kernels.priority_kernels",
                                    "mmreplay.kernels.table_kernels",
                                    "mmreplay.kernels.sample_kernels", "crash_warmup"])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).parent), before) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return context


# ----------------------------------------------------------------------------- the reference


class Reference:
    """The same stream replayed, crash-free, into a fresh store in this process."""

    def __init__(self, config: StreamConfig, path: Path) -> None:
        self.stream = Stream(config)
        self.store = ReplayStore.create(path, **config.store_kwargs())
        self.position = 0

    def advance_to(self, position: int) -> None:
        assert position >= self.position, "a reopened store went back before an earlier one"
        for i in range(self.position, position):
            self.stream.op(i).apply(self.store)
        self.position = position

    def bound(self, position: int) -> np.ndarray:
        """Per env: frames below this may have been given up by a crash at `position`."""
        config, spec = self.stream.config, self.store.spec
        ahead = max(spec.chunk_frames, config.slots_per_env // 16)
        later = self.stream.frames_at(self.stream.next_flush(position))
        return later - config.slots_per_env + ahead


@dataclass
class Trial:
    config: StreamConfig
    root: Path
    side: Path
    ref: Reference
    rng: np.random.Generator
    lossless: bool = True  # no reopen so far lost a transition: RNG streams still agree
    bound: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def start_trial(config: StreamConfig, tmp_path: Path, seed: int) -> Trial:
    config = replace(config, seed=seed)
    root = tmp_path / "store"
    ReplayStore.create(root, **config.store_kwargs()).close()
    return Trial(config, root, tmp_path / "side.txt", Reference(config, tmp_path / "ref"),
                 np.random.default_rng(seed), bound=np.zeros(config.num_envs, np.int64))


# ----------------------------------------------------------------------------- checks


def assert_matches(store: ReplayStore, ref: Reference, bound: np.ndarray) -> int:
    """`store` equals `ref.store` but for transitions reading frames below `bound`.

    Returns how many reference transitions the store lost.
    """
    want, got = ref.store.counts, store.counts
    assert (got.frames_written, got.transitions, got.episodes) == (
        want.frames_written, want.transitions, want.episodes)
    assert got.frames_kept <= want.frames_kept and got.sampleable <= want.sampleable
    ids, want_ids = store.valid_ids(), ref.store.valid_ids()
    assert len(store) == ids.size
    extra = np.setdiff1d(ids, want_ids)
    assert extra.size == 0, f"reopened store has ids the reference lacks: {extra[:10]}"
    env, frame, lower = ref.stream.id_arrays()
    missing = np.setdiff1d(want_ids, ids)
    wrongly = missing[lower[missing] >= bound[env[missing]]]
    assert wrongly.size == 0, (
        f"lost ids {wrongly[:10].tolist()} whose frames start at "
        f"{lower[wrongly[:10]].tolist()}, at or above the given-up bound {bound.tolist()}")
    if ids.size:
        assert_same_batches(store, ref, ids, env[ids], frame[ids])
    return int(missing.size)


def assert_same_batches(store: ReplayStore, ref: Reference, ids: np.ndarray,
                        env: np.ndarray, frame: np.ndarray) -> None:
    got, want = store.get(ids), ref.store.get(ids)
    for name in FIELDS:
        a, b = getattr(got, name).numpy(), getattr(want, name).numpy()
        same = (a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes())
        assert same, f"field {name} differs from the crash-free reference"
    newest = got.obs.numpy()[:, -1]
    numbers = np.ascontiguousarray(newest[:, 0, 1:9]).view("<u8")[:, 0]
    assert np.array_equal(newest[:, 0, 0].astype(np.int64) - 1, env), "obs from the wrong env"
    assert np.array_equal(numbers.astype(np.int64), frame), "obs is not the transition's frame"


def assert_same_rng(store: ReplayStore, ref: Reference) -> None:
    """A read-only `store` draws what a read-only view of the reference draws."""
    ref.store.flush()
    with ReplayStore.open(ref.store.path, "r") as view:
        if len(view):
            assert np.array_equal(store.sample(16).ids.numpy(), view.sample(16).ids.numpy()), (
                "reopened store's RNG is not the one committed with its state")


def assert_swept(root: Path) -> None:
    """No temp file and no .npy file the manifest does not name."""
    left = sorted(p.name for p in (root / "tmp").iterdir())
    assert not left, f"temp files left after a writable open: {left}"
    named = set(json.loads((root / "manifest.json").read_text())["files"])
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*.npy")}
    assert on_disk <= named, f"files the manifest does not name: {sorted(on_disk - named)}"


# ----------------------------------------------------------------------------- kill cycles


def kill_cycle(trial: Trial, ctx: multiprocessing.context.BaseContext,
               crash_at: tuple[str, int, bool] | None = None) -> bool:
    """Run one writer until it dies; returns whether it died of SIGKILL."""
    lines = len(read_side(trial.side))
    max_ops = 50_000 if crash_at is None else 2_000
    proc = ctx.Process(target=run_writer, daemon=True,  # type: ignore[attr-defined]
                       args=(trial.config, str(trial.root), str(trial.side), crash_at, max_ops))
    proc.start()
    if crash_at is None:
        wait_for_lines(trial.side, lines + 1, proc)
        time.sleep(trial.rng.uniform(0.0, MAX_KILL_DELAY))
        proc.kill()
    proc.join(60)
    assert proc.exitcode in (-signal.SIGKILL, 0), f"writer failed with {proc.exitcode}"
    assert len(read_side(trial.side)) > lines, "writer died before it began recording"
    return proc.exitcode == -signal.SIGKILL


def wait_for_lines(side: Path, count: int, proc: multiprocessing.process.BaseProcess) -> None:
    deadline = time.monotonic() + 30
    while len(read_side(side)) < count:
        assert proc.is_alive(), f"writer exited with {proc.exitcode} before it began recording"
        assert time.monotonic() < deadline, "writer did not begin recording within 30 s"
        time.sleep(0.002)


def verify_after_crash(trial: Trial) -> None:
    """Every post-crash check of the module docstring, read-only first, then writable."""
    stream, ref = trial.ref.stream, trial.ref
    last_position, last_generation = read_side(trial.side)[-1]
    leftovers = any((trial.root / "tmp").iterdir())
    with ReplayStore.open(trial.root, "r") as view:
        position = stream.position_of(view.counts.frames_written)
        assert position in (last_position, stream.next_flush(last_position)), (
            f"reopened at op {position}; last recorded flush {last_position}")
        assert view.generation >= last_generation
        ref.advance_to(position)
        trial.bound = ref.bound(position)
        lost = assert_matches(view, ref, trial.bound)
        # the writer logged its RNG state as each flush began: that state is what it commits
        assert view._batches.rng.bit_generator.state == read_rng_states(trial.side)[position], (
            "reopened store's RNG is not the one the writer committed with this state")
        if trial.lossless and not lost:
            assert_same_rng(view, ref)
        trial.lossless &= not lost
    store = ReplayStore.open(trial.root)
    try:
        assert_swept(trial.root)
        assert store.generation >= last_generation
        assert_matches(store, ref, trial.bound)
    finally:
        store.close()
    STATS.update(kills=1, temp_files_left=leftovers, lost_transitions=lost > 0,
                 ahead_of_side_file=position > last_position)


def continue_in_process(trial: Trial) -> None:
    """After the last crash: record and flush in this process, compare, reopen, compare."""
    stream, ref = trial.ref.stream, trial.ref
    store = ReplayStore.open(trial.root)
    start = stream.position_of(store.counts.frames_written)
    for i in range(start, start + CONTINUE_OPS):
        op = stream.op(i)
        op.apply(store)
        ref.advance_to(i + 1)
        if op.flush:
            store.flush()
    assert_matches(store, ref, trial.bound)
    store.close()
    with ReplayStore.open(trial.root, "r") as view:
        assert_matches(view, ref, trial.bound)
        if trial.lossless:
            assert_same_rng(view, ref)


# ----------------------------------------------------------------------------- tests


def trial_params(seeds: int) -> list[tuple[str, int]]:
    return [(name, seed) for name in CONFIGS for seed in range(seeds)]


@pytest.mark.parametrize(("name", "seed"), trial_params(RANDOM_SEEDS))
def test_sigkill_at_random_moments(name: str, seed: int, tmp_path: Path, ctx) -> None:
    trial = start_trial(CONFIGS[name], tmp_path, seed)
    for _ in range(KILLS_PER_TRIAL):
        assert kill_cycle(trial, ctx), "writer ended before the kill"
        verify_after_crash(trial)
    continue_in_process(trial)
    print(f"crash stats so far: {dict(STATS)}")


@pytest.mark.parametrize(("name", "seed"), trial_params(INJECTED_SEEDS))
def test_sigkill_at_injected_points(name: str, seed: int, tmp_path: Path, ctx) -> None:
    """The writer kills itself right before or after the n-th rename onto a kind of file."""
    trial = start_trial(CONFIGS[name], tmp_path, 1000 + seed)
    targets = {"any": 300, "chunk": 60, "npy": 120, "manifest": 80}
    for _ in range(INJECTIONS_PER_TRIAL):
        target = str(trial.rng.choice(list(targets)))
        nth, after = int(trial.rng.integers(1, targets[target] + 1)), bool(trial.rng.random() < .5)
        killed = kill_cycle(trial, ctx, (target, nth, after))
        if killed and not after:
            assert any((trial.root / "tmp").iterdir()), "a kill before a rename left no temp file"
        verify_after_crash(trial)
        STATS.update(injected_kills=killed)
    continue_in_process(trial)
    print(f"crash stats so far: {dict(STATS)}")


def test_crash_after_give_up_loses_only_old_transitions(tmp_path: Path) -> None:
    """In-process: flush, record until a chunk write commits a give-up, then die unflushed."""
    config = CONFIGS["1env"]
    ref = Reference(config, tmp_path / "ref")
    store = ReplayStore.create(tmp_path / "store", **config.store_kwargs())
    stream, i = ref.stream, 0
    while not (stream.op(i).flush and stream.frames_at(i + 1)[0] >= 3 * config.slots_per_env):
        stream.op(i).apply(store)
        i += 1
    stream.op(i).apply(store)
    store.flush()
    flushed, generation = i + 1, store.generation
    while store.generation == generation:  # no flush: only a give-up commit moves it
        i += 1
        stream.op(i).apply(store)
    generation = store.generation
    frames_now = stream.frames_at(i + 1)
    abandon(store)
    reopened = ReplayStore.open(tmp_path / "store")
    assert reopened.generation == generation
    assert stream.position_of(reopened.counts.frames_written) == flushed
    ref.advance_to(flushed)
    ahead = max(config.chunk_frames, config.slots_per_env // 16)
    lost = assert_matches(reopened, ref, frames_now - config.slots_per_env + ahead)
    assert lost > 0, "the give-up commit should have cost the oldest transitions"
    reopened.close()


@pytest.mark.parametrize("shard_chunks", [1, 0])  # a file per chunk; one shard file
def test_give_up_commits_only_when_committed_frames_are_overwritten(tmp_path: Path,
                                                                    shard_chunks: int) -> None:
    """A give-up manifest only while the committed one claims on-disk frames being overwritten.

    Regression: every chunk write past the wrap used to commit one, even when the committed
    manifest claimed no frame at all (a manifest rewrite, two fsyncs if durable, per chunk).
    """
    store = ReplayStore.create(tmp_path / "store", capacity=32, obs_shape=(2,), chunk_frames=4,
                               shard_chunks=shard_chunks)
    frame = 0

    def record(frames: int) -> int:
        nonlocal frame
        for _ in range(frames):
            frame += 1
            store.add(0, 0.0, np.full(2, frame % 250, np.uint8), False, False)
        return store.generation

    generation = store.generation  # committed at create: nothing written, nothing claimed
    store.reset(np.zeros(2, np.uint8))
    assert record(200) == generation, "give-up commits although the manifest claims no frame"
    store.flush()
    generation = store.generation
    # the claimed frames are all overwritten once a lap and the file holding the committed
    # tail's chunk are written: its chunk (4 frames), or the ring's one shard (32)
    after_one_lap = record(32 + (4 if shard_chunks == 1 else 32))
    assert 0 < after_one_lap - generation <= 32 // 4, "each give-up frees at least a chunk"
    assert record(200) == after_one_lap, "give-up commits after every claimed frame was freed"
    store.close()
