"""Which transitions exist and which frames they read: the per-env rings of step columns.

Every env has a stream of frames numbered 0, 1, 2, ... (its *frame numbers*).
Frame ``f`` of env ``e`` lives in slot ``f % S`` (``S = slots_per_env``) and flat
slot ``e * S + f % S``. Only the most recent ``S`` frames are kept::

    frame numbers   0 ........ oldest ............... written-1 | written (next)
                    [ evicted ][ kept: at most S frames          ]

A *step* belongs to the frame it starts from: slot ``f`` holds the action,
reward and flags of the step ``o_f -> o_{f+1}`` (``has_step``) and that
transition's id. Episodes are runs of consecutive frame numbers; ``pos`` is a
frame's position in its episode (0 = ``o_0``).

The transition at frame ``t`` is *valid* (sampleable) iff

* it has a step,
* every real frame its stack reads is kept: ``max(t - k + 1, t - pos[t]) >= oldest``,
* its n-step window is complete: ``n`` steps follow in the episode, or the
  episode ended (terminated or truncated) inside the window.

Validity is refreshed lazily (``refresh``) for the frames touched since the last
refresh, so ``append`` stays O(1). This module knows no pixels, codecs, RNG or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.index.ids import IdIndex
from mmreplay.kernels import compiled, lazy_entry
from mmreplay.kernels.structs import IdMap, LookupOut, RingColumns
from mmreplay.spec import StoreSpec

_LOOKUP = lazy_entry(compiled, "lookup")  # found without a look-up


def step_dtype(spec: StoreSpec) -> np.dtype:
    """The record of one slot; persisted as-is in the step blocks."""
    return np.dtype([
        ("pos", "<i8"),
        ("episode", "<i8"),
        ("id", "<i8"),
        ("has_step", "?"),
        ("terminated", "?"),
        ("truncated", "?"),
        ("reward", "<f4"),
        ("action", np.dtype(spec.action_dtype).newbyteorder("<"), spec.action_shape),
        *[(EXTRA_PREFIX + name, np.dtype(dtype).newbyteorder("<"), shape)
          for name, shape, dtype in spec.extras],
    ])


EXTRA_PREFIX = "extra_"  # step-record field of a declared extra: ``extra_<name>``
_NO_SLOTS = np.empty(0, np.int64)
_NO_VALID = np.empty(0, bool)
_NO_SLOTS.flags.writeable = _NO_VALID.flags.writeable = False


@dataclass(frozen=True)
class Lookup:
    """What the store needs to build a batch for some flat slots (all numpy)."""

    obs_slots: np.ndarray       # (B, k) flat slots of the stack, -1 = zero padding
    next_obs_slots: np.ndarray  # (B, k) flat slots of the next stack
    action: np.ndarray
    reward: np.ndarray          # float32 n-step return
    terminated: np.ndarray
    truncated: np.ndarray
    discount: np.ndarray        # float32
    steps: np.ndarray           # int64 m: steps in the n-step window (fewer when the episode ends)
    ids: np.ndarray             # int64
    extras: dict[str, np.ndarray]  # the extras of step t (as its action), by name
    slots: np.ndarray           # (2, B, k): obs_slots and next_obs_slots are its halves


@dataclass(frozen=True)
class StepColumns:
    """A read-only view of a ring's step columns and cursors, for tools that read a store.

    The arrays are the ring's own, marked read-only (no copy): they reflect later writes,
    so take a fresh view after recording (``oldest`` is computed: a snapshot).
    ``steps[e, f % slots_per_env]`` is the record of frame ``f`` of env ``e`` (see the module
    doc); flat slot = ``e * slots_per_env + slot``.
    """

    steps: np.ndarray      # (num_envs, slots_per_env) records of `step_dtype`
    written: np.ndarray    # (num_envs,) frames ever written per env
    oldest: np.ndarray     # (num_envs,) first kept frame number per env
    running: np.ndarray    # (num_envs,) the env's episode accepts steps
    valid: np.ndarray      # (num_envs * slots_per_env,) sampleable transition per flat slot
    next_id: int
    next_episode: int

    @property
    def num_envs(self) -> int:
        return int(self.steps.shape[0])

    @property
    def slots_per_env(self) -> int:
        return int(self.steps.shape[1])

    def kept_frames(self) -> tuple[np.ndarray, np.ndarray]:
        """(env, frame number) of every kept frame, env-major and in frame order."""
        return kept_frames(self.written, self.oldest)

    def flat(self, env: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """Flat slots of frame numbers `frames` of `env`."""
        return env * self.slots_per_env + frames % self.slots_per_env


def kept_frames(written: np.ndarray, oldest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(env, frame number) of every kept frame ``oldest[e] <= f < written[e]``, env-major."""
    counts = written - oldest
    starts = np.cumsum(counts) - counts
    env = np.repeat(np.arange(written.size, dtype=np.int64), counts)
    frames = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts - oldest, counts)
    return env, frames


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class StepRing:
    """Per-env cursors, step columns, episode bounds and the validity mask."""

    def __init__(self, spec: StoreSpec) -> None:
        self.spec = spec
        self.slots_per_env = spec.slots_per_env
        self.num_envs = spec.num_envs
        self.steps = np.zeros((self.num_envs, self.slots_per_env), step_dtype(spec))
        self.steps["id"] = -1
        # flat views of the step columns the read path uses (``steps`` is never replaced)
        self._flat_cols = {name: self.steps.reshape(-1)[name] for name in (
            "pos", "reward", "terminated", "truncated", "action", "id", "episode", "has_step")}
        self.written = np.zeros(self.num_envs, np.int64)     # frames ever written per env
        self.kept_from = np.zeros(self.num_envs, np.int64)   # extra lower bound (from a manifest)
        self.running = np.zeros(self.num_envs, bool)         # episode open: accepts steps
        self.next_id = 0
        self.next_episode = 0
        self.valid = np.zeros(self.num_envs * self.slots_per_env, bool)
        self.ids = IdIndex(self._flat_cols["id"])  # id -> flat slot
        self._dirty_lo = np.zeros(self.num_envs, np.int64)   # first frame touched since refresh
        self._refreshed_key = (b"", b"")  # (written, kept_from) at the last refresh
        self.dirty_blocks: set[int] = set()
        blank = np.zeros(1, self.steps.dtype)
        blank["id"] = -1  # type: ignore[call-overload]  # structured field
        self._blank = blank[0]  # the record of a fresh slot: no step, no id
        self._gamma_pow = np.array([spec.gamma ** j for j in range(spec.n_step + 1)])
        self.lookup_columns = _ring_columns(spec, self.written, self._flat_cols, self._gamma_pow)
        # Step ordinals, for windows of consecutive steps across episodes: frame f of env e
        # has ``ord_of_frame[e, f % S]`` steps before it (its step's ordinal if it has one),
        # and the step of ordinal o is at frame ``frame_of_ord[e, o % S]`` (steps <= frames,
        # so a kept step's entry is never overwritten). Origins are arbitrary per env.
        self.ord_of_frame = np.zeros((self.num_envs, self.slots_per_env), np.int64)
        self.frame_of_ord = np.zeros((self.num_envs, self.slots_per_env), np.int64)
        self.step_count = np.zeros(self.num_envs, np.int64)
        # Consumers of "first frame touched since I last looked" (sequence indexes), and a
        # counter of full rebuilds (after which they start over).
        self.watchers: list[np.ndarray] = []
        self.rebuilds = 0

    # -- frame numbers ----------------------------------------------------------
    @property
    def oldest(self) -> np.ndarray:
        """First kept frame number per env."""
        lowest = np.maximum(self.kept_from, self.written - self.slots_per_env)
        return np.minimum(lowest, self.written)

    def kept_frames(self) -> tuple[np.ndarray, np.ndarray]:
        """(env, frame number) of every kept frame, env-major and in frame order."""
        return kept_frames(self.written, self.oldest)

    def columns(self) -> StepColumns:
        """A read-only view of the step columns and cursors (see `StepColumns`)."""
        return StepColumns(
            steps=_read_only(self.steps), written=_read_only(self.written),
            oldest=_read_only(self.oldest), running=_read_only(self.running),
            valid=_read_only(self.valid), next_id=self.next_id, next_episode=self.next_episode)

    def index_nbytes(self) -> int:
        """Bytes of the RAM index besides the step columns (mask, id map, cursors)."""
        arrays = (self.valid, self.ids.loc, self.written, self.kept_from, self.running,
                  self._dirty_lo, self.ord_of_frame, self.frame_of_ord,
                  self.step_count)
        return sum(a.nbytes for a in arrays)

    def frame_at(self, flat: np.ndarray) -> np.ndarray:
        """Frame number currently in each flat slot (negative: never written)."""
        env, slot = np.divmod(flat, self.slots_per_env)
        last = self.written[env] - 1
        return last - (last - slot) % self.slots_per_env

    # -- recording --------------------------------------------------------------
    def begin_episodes(self, envs: np.ndarray) -> np.ndarray:
        """Start a new episode (o_0) in each env; returns the slots to write o_0 to."""
        self.truncate_running(envs)
        slots = np.empty(envs.size, np.int64)
        for i, env in enumerate(envs.tolist()):
            rec, slots[i] = self._new_frame(env)
            rec["episode"] = self.next_episode
            self.next_episode += 1
            self.running[env] = True
        return slots

    def truncate_running(self, envs: np.ndarray) -> None:
        """End running episodes as truncated at their last recorded step."""
        for env in envs[self.running[envs]].tolist():
            self.running[env] = False
            last = int(self.written[env]) - 2
            if last < 0 or self.steps[env, (last + 1) % self.slots_per_env]["pos"] == 0:
                continue  # the episode has no step yet
            self.steps[env, last % self.slots_per_env]["truncated"] = True
            self._touch(env, last)

    def record_steps(self, envs: np.ndarray, action: np.ndarray, reward: np.ndarray,
                     terminated: np.ndarray, truncated: np.ndarray,
                     extras: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Record one step per env (all running); returns the slots for the next frames.

        Structured scalars (``steps[e, s]``) are views, so each field is set in place.
        `extras` (one row per env) land in the same record as the step's action.
        """
        slots = np.empty(envs.size, np.int64)
        for i, env in enumerate(envs.tolist()):
            if extras:
                rec = self.steps[env, (int(self.written[env]) - 1) % self.slots_per_env]
                for name, rows in extras.items():
                    rec[EXTRA_PREFIX + name] = rows[i]
            slots[i] = self.record_step(env, action[i], reward[i], terminated[i], truncated[i])
        return slots

    def record_step(self, env: int, action: Any, reward: Any, terminated: bool,
                    truncated: bool) -> int:
        """`record_steps` for one env; returns the slot for its next frame."""
        t = int(self.written[env]) - 1
        prev = self.steps[env, t % self.slots_per_env]
        prev["has_step"], prev["id"] = True, self.next_id
        prev["terminated"], prev["truncated"] = terminated, truncated
        prev["reward"], prev["action"] = reward, action
        self.frame_of_ord[env, self.step_count[env] % self.slots_per_env] = t
        self.step_count[env] += 1
        self.ids.point(self.next_id, env * self.slots_per_env + t % self.slots_per_env)
        self.next_id += 1
        self._touch(env, t)
        rec, slot = self._new_frame(env)
        rec["pos"], rec["episode"] = prev["pos"] + 1, prev["episode"]
        self.running[env] = not (terminated or truncated)
        return slot

    def _new_frame(self, env: int) -> tuple[np.void, int]:
        """Claim the env's next slot for a new frame; returns its (blank) record and slot."""
        frame = int(self.written[env])
        slot = frame % self.slots_per_env
        self.steps[env, slot] = self._blank
        self.ord_of_frame[env, slot] = self.step_count[env]
        self._touch(env, frame)
        self.written[env] = frame + 1
        return self.steps[env, slot], slot

    def touch_frames(self, touched: np.ndarray) -> None:
        """`_touch` of every frame from ``touched[e]`` to the last written, per env (after a
        compiled recording, `blocks.record_block`)."""
        np.minimum(self._dirty_lo, touched, out=self._dirty_lo)
        for lo in self.watchers:
            np.minimum(lo, touched, out=lo)
        block, spe = self.spec.block_slots, self.slots_per_env
        for e in np.flatnonzero(touched < self.written).tolist():
            low, high = int(touched[e]), int(self.written[e])
            if high - low >= spe:
                self.dirty_blocks.update(range(-(-spe // block)))
                continue
            first, last = low % spe // block, (high - 1) % spe // block
            if first <= last:
                self.dirty_blocks.update(range(first, last + 1))
            else:  # the frames wrap around the ring's end
                self.dirty_blocks.update(range(first, -(-spe // block)))
                self.dirty_blocks.update(range(0, last + 1))

    def _touch(self, env: int, frame: int) -> None:
        if frame < self._dirty_lo[env]:
            self._dirty_lo[env] = frame
        for lo in self.watchers:
            if frame < lo[env]:
                lo[env] = frame
        self.dirty_blocks.add(frame % self.slots_per_env // self.spec.block_slots)

    # -- validity ---------------------------------------------------------------
    def refresh(self) -> tuple[np.ndarray, np.ndarray]:
        """Recompute validity where it may have changed; returns (flat slots, valid)."""
        key = (self.written.tobytes(), self.kept_from.tobytes())
        if key == self._refreshed_key and self._dirty_lo.tobytes() == key[0]:
            return _NO_SLOTS, _NO_VALID  # nothing written or given up since the last refresh
        env, frames = self._candidates()
        flat = env * self.slots_per_env + frames % self.slots_per_env
        ok = self.transition_valid(env, frames)
        self.valid[flat] = ok
        self._dirty_lo[:] = self.written
        self._refreshed_key = key
        return flat, ok

    def _candidates(self) -> tuple[np.ndarray, np.ndarray]:
        k, n = self.spec.frame_stack, self.spec.n_step
        oldest, envs, frames = self.oldest, [], []
        for e in range(self.num_envs):
            new = np.arange(max(oldest[e], self._dirty_lo[e] - n - 1), self.written[e])
            gone = np.arange(oldest[e], min(oldest[e] + k, self.written[e]))
            both = np.union1d(new, gone)
            frames.append(both)
            envs.append(np.full(both.size, e, np.int64))
        return np.concatenate(envs), np.concatenate(frames).astype(np.int64)

    def rebuild_validity(self) -> None:
        """Recompute the whole mask and id map (after loading from disk)."""
        flat = np.arange(self.num_envs * self.slots_per_env, dtype=np.int64)
        env, frames = np.divmod(flat, self.slots_per_env)[0], self.frame_at(flat)
        kept = frames >= self.oldest[env]
        self.valid[:] = False
        self.valid[flat[kept]] = self.transition_valid(env[kept], frames[kept])
        ids = self.steps["id"].reshape(-1)
        live = kept & (ids >= 0)
        order = np.argsort(ids[live], kind="stable")  # the newest id takes a shared entry
        self.ids.rebuild(ids[live][order], flat[live][order])
        self._dirty_lo[:] = self.written
        self._refreshed_key = (self.written.tobytes(), self.kept_from.tobytes())
        self._rebuild_ordinals()

    def _rebuild_ordinals(self) -> None:
        """Number the kept steps of every env 0, 1, ... (after loading)."""
        oldest = self.oldest
        for e in range(self.num_envs):
            frames = np.arange(oldest[e], self.written[e])
            has = self.steps["has_step"][e, frames % self.slots_per_env]
            before = np.cumsum(has) - has
            self.ord_of_frame[e, frames % self.slots_per_env] = before
            self.frame_of_ord[e, before[has] % self.slots_per_env] = frames[has]
            self.step_count[e] = int(has.sum())
        self.rebuilds += 1

    def transition_valid(self, env: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Validity of the transitions at kept frames `t` of `env` (see module doc)."""
        col, row = self._flat_cols, env * self.slots_per_env  # a field at a time, 1-D
        flat = row + t % self.slots_per_env  # gathers (a gather of records copies them all)
        episode = col["episode"][flat]
        lower = np.maximum(t - self.spec.frame_stack + 1, t - col["pos"][flat])
        ok = col["has_step"][flat] & (lower >= self.oldest[env])
        alive, complete, last = ok.copy(), np.zeros_like(ok), self.written[env] - 1
        for j in range(self.spec.n_step):
            u, us = t + j, flat if j == 0 else row + (t + j) % self.slots_per_env
            alive &= (u < last) & col["has_step"][us] & (col["episode"][us] == episode)
            done = alive & (col["terminated"][us] | col["truncated"][us])
            complete |= done
            alive &= ~done
        return ok & (complete | alive)

    # -- ids --------------------------------------------------------------------
    def flat_of_ids(self, ids: np.ndarray, *,
                    valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(flat slots, found mask) for transition ids; found = id is sampleable now
        (valid in `valid` instead, e.g. a sequence index's starts, when given)."""
        flat = self.ids.locate(ids, self.next_id)
        found = flat >= 0
        flat = np.where(found, flat, 0)
        found &= self.ids.slot_ids[flat] == ids
        found &= (self.valid if valid is None else valid)[flat]
        return flat, found

    def valid_flat(self) -> np.ndarray:
        return np.flatnonzero(self.valid)

    def id_map(self) -> IdMap:
        """The id -> flat slot map and validity mask as plain arrays (see `IdMap`)."""
        return self.ids.as_map(self.valid, self.next_id)

    def spilled(self, ids: np.ndarray) -> np.ndarray:
        """Flat slot of each id (`IdIndex.locate`), -1 for ids held nowhere."""
        return self.ids.locate(ids, self.next_id)

    # -- lookups ----------------------------------------------------------------
    def lookup(self, flat: np.ndarray) -> Lookup:
        """Everything a batch needs for valid flat slots, computed in one compiled call (each
        field in the dtype a batch hands out: no conversion after it)."""
        size = flat.size
        both = np.empty((2, size, self.spec.frame_stack), np.int64)  # obs and next_obs stacks
        out = lookup_out(both)
        _LOOKUP(flat, self.lookup_columns, out)
        return Lookup(obs_slots=both[0], next_obs_slots=both[1],
                      action=self.actions_at(flat), reward=out.ret, terminated=out.term,
                      truncated=out.trunc, discount=out.discount, steps=out.steps, ids=out.ids,
                      extras=self.extras_at(flat) if self.spec.extras else {}, slots=both)

    def actions_at(self, flat: np.ndarray) -> np.ndarray:
        """The actions of the steps at these flat slots (any shape), as `lookup` has them."""
        return self._flat_cols["action"][flat]

    def extras_at(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The extras recorded with the steps at these flat slots (any shape), by name."""
        if not self.spec.extras:
            return {}
        cols = self.steps.reshape(-1)
        return {name: cols[EXTRA_PREFIX + name][flat] for name, _, _ in self.spec.extras}

    # -- invariants ---------------------------------------------------------------
    def check_valid(self) -> None:
        """Raise RuntimeError if the incremental mask differs from a full recompute."""
        self.refresh()
        mask = self.valid.copy()
        self.rebuild_validity()
        if not np.array_equal(mask, self.valid):
            bad = np.flatnonzero(mask != self.valid)[:10]
            raise RuntimeError(f"validity mask out of date at flat slots {bad.tolist()}")
        if (self.oldest > self.written).any() or (self.written < 0).any():
            raise RuntimeError(
                f"cursors inconsistent: oldest {self.oldest}, written {self.written}")


def lookup_out(stacks: np.ndarray) -> LookupOut:
    """Fresh outputs of a compiled `lookup` of ``stacks.shape[1]`` slots, each in the dtype a
    batch hands out, its obs and next_obs stacks written into ``stacks`` ``(2, B, stack)``."""
    size = stacks.shape[1]
    return LookupOut(obs=stacks[0], next_obs=stacks[1], ret=np.empty(size, np.float32),
                     term=np.empty(size, bool), trunc=np.empty(size, bool),
                     discount=np.empty(size, np.float32), steps=np.empty(size, np.int64),
                     ids=np.empty(size, np.int64))


def _ring_columns(spec: StoreSpec, written: np.ndarray, cols: dict[str, np.ndarray],
                  gamma_pow: np.ndarray) -> RingColumns:
    """What `StepRing.lookup` passes its kernel (the ring's arrays, written in place)."""
    return RingColumns(written=written, slots=spec.slots_per_env, stack=spec.frame_stack,
                       n_step=spec.n_step, pad_first=spec.stack_padding == "first",
                       gamma_pow=gamma_pow, pos=cols["pos"], reward=cols["reward"],
                       terminated=cols["terminated"], truncated=cols["truncated"],
                       step_id=cols["id"])
