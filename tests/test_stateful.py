"""Hypothesis state machine: ReplayStore against the naive reference through flush, reopen, crash.

Rules record (`reset` of some envs, `add` of one step of every env or of a subset
(``env_ids``), or a seeded burst of either), read (`sample`) and
persist (`flush`, `reopen` r+, `reopen_readonly`, `peek_readonly` beside the live writer, and
`crash`). After every step the store must equal `ReferenceReplay` (tests/reference.py):
``valid_ids()``, every field of ``get(valid_ids())``, and ``counts``.

`crash` drops the store without flushing (closing its lock fd by hand, as process death would)
and reopens it: the store must equal the model as of the last flush, except that transitions
whose stack reads a frame below the *given-up bound* may be missing. A chunk write gives up at
most the frames it overwrites plus ``ahead = max(chunk_frames, slots_per_env // 16)``, so per
env the bound is ``frames written before the crash - slots_per_env + ahead``; it stays in force
(the store keeps its ``kept_from``) and only grows.

Frames are (2, 3) uint8 and encode env, per-env frame number and how many crashes came before,
so a frame of a lost future never equals the one recorded in its place.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from crash_writer import abandon
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from reference import ReferenceReplay

from mmreplay import EmptyStoreError, ReadOnlyError, ReplayStore

# A hypothesis state machine of the whole store: 25-30 s, so CI's tier.
pytestmark = pytest.mark.integration

LONG = os.environ.get("MMREPLAY_LONG") == "1"
OBS = (2, 3)
EXACT_FIELDS = ("obs", "next_obs", "action", "terminated", "truncated")
MODEL_KEYS = ("capacity", "num_envs", "frame_stack", "n_step", "gamma", "stack_padding")
ONE_IN_8 = st.integers(0, 7).map(lambda x: x == 0)


@st.composite
def store_options(draw: st.DrawFn) -> dict[str, Any]:
    """Small rings (4-40 slots per env) that wrap, odd chunk and block sizes."""
    num_envs = draw(st.integers(1, 3))
    slots = draw(st.integers(4, 40))
    return {
        "capacity": num_envs * slots + draw(st.integers(0, num_envs - 1)),
        "num_envs": num_envs,
        "frame_stack": draw(st.integers(1, 4)),
        "n_step": draw(st.integers(1, 3)),
        "stack_padding": draw(st.sampled_from(["zero", "first"])),
        "chunk_frames": draw(st.integers(1, 8)),
        "block_slots": draw(st.integers(1, 16)),
        "gamma": 0.9,
    }


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="mmreplay-stateful-"))
        self.path = self.tmp / "store"
        self.store: ReplayStore | None = None

    @initialize(options=store_options(), seed=st.integers(0, 2**16))
    def create(self, options: dict[str, Any], seed: int) -> None:
        self.store = ReplayStore.create(self.path, obs_shape=OBS, seed=seed, **options)
        self.model = ReferenceReplay(obs_shape=OBS, **{k: options[k] for k in MODEL_KEYS})
        self.committed = copy.deepcopy(self.model)  # the model as of the last flush
        self.envs = options["num_envs"]
        self.slots = self.store.spec.slots_per_env
        self.ahead = max(self.store.spec.chunk_frames, self.slots // 16)
        self.bound = np.zeros(self.envs, np.int64)
        self.crashes = 0

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- recording ------------------------------------------------------------------
    def frame(self, env: int) -> np.ndarray:
        n = self.model.frames_written[env]
        return np.array([[env + 1, n % 256, n // 256 % 256],
                         [self.crashes % 256, (n * 7 + env) % 256, 1]], np.uint8)

    def running(self) -> list[bool]:
        return [bool(eps) and not eps[-1].ended for eps in self.model.episodes]

    def written(self) -> np.ndarray:
        return self.written_of(self.model)

    def all_frames(self) -> np.ndarray:
        """The next frame of every env, shaped as ``reset(obs)`` with no env_ids wants it."""
        frames = np.stack([self.frame(e) for e in range(self.envs)])
        return frames[0] if self.envs == 1 else frames

    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        if self.envs == 1:
            obs = self.frame(0)
            if data.draw(st.booleans(), label="listed"):
                self.store.reset(obs, env_ids=[0])
                self.model.reset([obs], env_ids=[0])
            else:
                self.store.reset(obs)
                self.model.reset(obs)
            return
        env_ids = data.draw(st.none() | st.lists(
            st.integers(0, self.envs - 1), min_size=1, max_size=self.envs, unique=True))
        obs = np.stack([self.frame(e) for e in (env_ids or range(self.envs))])
        self.store.reset(obs, env_ids=env_ids)
        self.model.reset(obs, env_ids=env_ids)

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        self.add_rows(data, None)

    @rule(data=st.data())
    def add_some(self, data: st.DataObject) -> None:
        """One step of a subset of the envs (``env_ids``, in a drawn order)."""
        env_ids = data.draw(st.lists(st.integers(0, self.envs - 1), min_size=1,
                                     max_size=self.envs, unique=True), label="env_ids")
        self.add_rows(data, env_ids)

    def add_rows(self, data: st.DataObject, env_ids: list[int] | None) -> None:
        step = st.tuples(st.integers(0, 5), st.sampled_from([-1.0, -0.25, 0.0, 0.5, 2.0]),
                         ONE_IN_8, ONE_IN_8, ONE_IN_8)
        count = self.envs if env_ids is None else len(env_ids)
        rows = data.draw(st.lists(step, min_size=count, max_size=count))
        action, reward, terminated, truncated, cut = (np.array(c) for c in zip(*rows, strict=True))
        idle = ~np.array(self.running())[env_ids if env_ids is not None else slice(None)]
        self.record_step(action, reward, terminated, truncated, cut | idle, env_ids)

    @rule(count=st.integers(1, 30), seed=st.integers(0, 2**32 - 1), subsets=st.booleans())
    def add_many(self, count: int, seed: int, subsets: bool) -> None:
        """A burst of steps (fast enough to wrap the ring within a few rules); with `subsets`
        each step goes to a random subset of the envs, so they advance independently."""
        rng = np.random.default_rng(seed)
        for _ in range(count):
            envs = list(range(self.envs))
            if subsets:
                envs = rng.permutation(self.envs)[:rng.integers(1, self.envs + 1)].tolist()
            n = len(envs)
            autoreset = (rng.random(n) < 0.02) | ~np.array(self.running())[envs]
            self.record_step(rng.integers(0, 6, n), rng.integers(-4, 5, n) * 0.25,
                             rng.random(n) < 0.08, rng.random(n) < 0.03, autoreset,
                             envs if subsets else None)

    def record_step(self, action: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                    truncated: np.ndarray, autoreset: np.ndarray,
                    env_ids: list[int] | None = None) -> None:
        envs = range(self.envs) if env_ids is None else env_ids
        frames = np.stack([self.frame(e) for e in envs])
        if self.envs == 1 and env_ids is None:
            args: tuple[Any, ...] = (int(action[0]), float(reward[0]), frames[0],
                                     bool(terminated[0]), bool(truncated[0]), bool(autoreset[0]))
        else:
            args = (action.astype(np.int64), reward, frames, terminated.astype(bool),
                    truncated.astype(bool), autoreset.astype(bool))
        kwargs = {} if env_ids is None else {"env_ids": np.array(env_ids, np.int64)}
        self.store.add(*args, **kwargs)
        self.model.add(*args, **kwargs)

    # -- reading ----------------------------------------------------------------------
    @rule(size=st.integers(1, 8))
    def sample(self, size: int) -> None:
        if len(self.store) == 0:
            with pytest.raises(EmptyStoreError):
                self.store.sample(size)
            return
        batch = self.store.sample(size)
        ids = batch.ids.numpy()
        assert np.isin(ids, self.store.valid_ids()).all(), f"sampled unknown ids {ids}"
        assert torch.equal(batch.weights, torch.ones(size))
        again = self.store.get(ids)
        for name in (*EXACT_FIELDS, "reward", "discount", "ids"):
            assert torch.equal(getattr(batch, name), getattr(again, name)), name

    # -- persistence ------------------------------------------------------------------
    @rule()
    def flush(self) -> None:
        self.store.flush()
        self.committed = copy.deepcopy(self.model)

    @rule()
    def reopen(self) -> None:
        """close + open r+: same state, and the same next sample as the committed RNG gives."""
        self.store.flush()
        with ReplayStore.open(self.path, "r") as view:
            want = view.sample(4).ids if len(view) else None
        self.store.close()
        self.committed = copy.deepcopy(self.model)
        self.store = ReplayStore.open(self.path)
        if want is not None:
            assert torch.equal(self.store.sample(4).ids, want), "RNG not restored by reopen"

    @rule()
    def reopen_readonly(self) -> None:
        self.store.close()
        self.committed = copy.deepcopy(self.model)
        self.store = None
        view = ReplayStore.open(self.path, "r")
        try:
            self.check(view, self.model, self.bound)
            with pytest.raises(ReadOnlyError):
                view.flush()
            with pytest.raises(ReadOnlyError):
                view.reset(self.all_frames())
        finally:
            view.close()
        self.store = ReplayStore.open(self.path)

    @rule()
    def peek_readonly(self) -> None:
        """A reader beside the live writer sees the last flush, minus what was given up."""
        bound = np.maximum(self.bound, self.written() - self.slots + self.ahead)
        with ReplayStore.open(self.path, "r") as view:
            assert view.generation == self.store.generation
            self.check(view, self.committed, bound)

    @rule()
    def crash(self) -> None:
        written, generation = self.written(), self.store.generation
        abandon(self.store)
        self.store = None
        self.model = copy.deepcopy(self.committed)
        self.bound = np.maximum(self.bound, written - self.slots + self.ahead)
        self.crashes += 1
        self.store = ReplayStore.open(self.path)
        assert self.store.generation == generation, "reopened a different commit"
        assert not any((self.path / "tmp").iterdir()), "temp files left after a writable open"
        lost = len(self.model.expected()) - len(self.store)
        event(f"crash: {'lost transitions' if lost else 'nothing lost'}")
        event(f"crash: ring {'had' if (written > self.slots).any() else 'had not'} wrapped")

    # -- the comparison -----------------------------------------------------------------
    @invariant()
    def matches_model(self) -> None:
        if self.store is not None:
            self.check(self.store, self.model, self.bound)

    def check(self, store: ReplayStore, model: ReferenceReplay, bound: np.ndarray) -> None:
        """`store` equals `model` but for transitions reading frames below `bound`."""
        expected = model.expected()
        ids = store.valid_ids()
        assert ids.dtype == np.int64 and np.all(np.diff(ids) > 0), f"valid_ids {ids}"
        extra = set(ids.tolist()) - set(expected)
        assert not extra, f"store has ids the model lacks: {sorted(extra)[:10]}"
        lowers = self.lowest_frames(model)
        for i in sorted(set(expected) - set(ids.tolist())):
            env, lower = lowers[i]
            assert lower < bound[env], (
                f"id {i} (env {env}, oldest frame {lower}) missing; given-up bound {bound}")
        self.check_counts(store, model, bound, ids.size)
        if ids.size:
            self.check_fields(store.get(ids), expected, ids)

    def check_counts(self, store: ReplayStore, model: ReferenceReplay, bound: np.ndarray,
                     sampleable: int) -> None:
        counts, written = store.counts, self.written_of(model)
        assert counts.frames_written == written.sum()
        assert counts.transitions == model.next_id
        assert counts.episodes == sum(len(eps) for eps in model.episodes)
        assert counts.sampleable == sampleable == len(store)
        oldest_worst = np.minimum(np.maximum(np.maximum(bound, written - self.slots), 0), written)
        most = np.minimum(written, self.slots).sum()
        assert (written - oldest_worst).sum() <= counts.frames_kept <= most

    @staticmethod
    def check_fields(batch: Any, expected: dict[int, dict[str, Any]], ids: np.ndarray) -> None:
        assert np.array_equal(batch.ids.numpy(), ids)
        for name in EXACT_FIELDS:
            want = np.stack([np.asarray(expected[i][name]) for i in ids.tolist()])
            got = getattr(batch, name).numpy()
            bad = ~(got == want).reshape(ids.size, -1).all(axis=1)
            assert not bad.any(), f"{name} differs for ids {ids[bad][:10].tolist()}"
        for name in ("reward", "discount"):
            want = np.array([expected[i][name] for i in ids.tolist()], np.float64)
            got = getattr(batch, name).numpy().astype(np.float64)
            bad = ~np.isclose(got, want, rtol=1e-6, atol=1e-6)
            assert not bad.any(), f"{name} differs for ids {ids[bad][:10].tolist()}"

    def lowest_frames(self, model: ReferenceReplay) -> dict[int, tuple[int, int]]:
        """id -> (env, frame number of the oldest real frame its stack reads)."""
        k, out = model.frame_stack, {}
        for env, episodes in enumerate(model.episodes):
            for episode in episodes:
                for t, i in enumerate(episode.ids):
                    out[i] = (env, episode.start + max(t - k + 1, 0))
        return out

    @staticmethod
    def written_of(model: ReferenceReplay) -> np.ndarray:
        return np.asarray(model.frames_written, np.int64)


StoreMachine.TestCase.settings = settings(
    max_examples=500 if LONG else 50,
    stateful_step_count=100 if LONG else 50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
