"""One transition, and one episode frame by frame, as numpy: what `show` and the viewer draw.

`transition` reads a sampleable transition through `ReplayStore.get`; `episode_frames` and
`episode_steps` read an episode's kept frames and the step taken from each through the
store's read-only ``store.views`` (step columns, frames by slot, priorities).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.index.ring import EXTRA_PREFIX
from mmreplay.store import ReplayStore


@dataclass(frozen=True)
class TransitionView:
    """One transition as numpy: ``obs``/``next_obs`` are ``(frame_stack, *obs_shape)``."""

    id: int
    obs: np.ndarray
    next_obs: np.ndarray
    action: np.ndarray
    reward: float
    discount: float
    terminated: bool
    truncated: bool


def transition(store: ReplayStore, transition_id: int) -> TransitionView:
    """The sampleable transition `transition_id` (`UnknownIdError` if it is not)."""
    batch = store.get([transition_id])
    return TransitionView(
        id=int(transition_id), obs=batch.obs[0].numpy(), next_obs=batch.next_obs[0].numpy(),
        action=batch.action[0].numpy(), reward=float(batch.reward[0]),
        discount=float(batch.discount[0]), terminated=bool(batch.terminated[0]),
        truncated=bool(batch.truncated[0]))


def episode_frames(store: ReplayStore, episode: int) -> np.ndarray:
    """The kept frames of `episode` in order, ``(T, *obs_shape)``."""
    return store.views.read_frames(_episode_slots(store, episode))


def _episode_slots(store: ReplayStore, episode: int) -> np.ndarray:
    """Flat slots of the kept frames of `episode`, in frame order."""
    ring = store.views.step_columns()
    flat = ring.flat(*ring.kept_frames())
    mine = flat[ring.steps["episode"].reshape(-1)[flat] == episode]
    if mine.size == 0:
        raise InvalidInputError(f"episode {episode} has no kept frame in this store "
                                f"(see `mmreplay episodes` for the kept ones)")
    return mine


@dataclass(frozen=True)
class EpisodeSteps:
    """The kept frames of one episode and the step taken from each; arrays are ``(T, ...)``.

    Frame ``t`` is o at episode position ``pos[t]``; its step (o, ``action[t]``,
    ``reward[t]``, next o) is transition ``ids[t]``, -1 where the frame has no step (the
    last frame of an ended episode, or the newest of a running one). ``priority`` is NaN
    for uniform stores and frames without a step.
    """

    episode: int
    env: int
    pos: np.ndarray
    ids: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    sampleable: np.ndarray
    priority: np.ndarray
    extras: dict[str, np.ndarray]


def episode_steps(store: ReplayStore, episode: int) -> EpisodeSteps:
    """Step columns of the kept frames of `episode` (`InvalidInputError` if none is kept)."""
    flat = _episode_slots(store, episode)
    ring = store.views.step_columns()
    cols = ring.steps.reshape(-1)[flat]
    has = cols["has_step"]
    prio = np.full(flat.size, np.nan)
    state = store.views.priority_state()
    if state is not None:  # priorities of sampleable transitions, in flat-slot order
        valid = np.flatnonzero(ring.valid)
        where = np.searchsorted(valid, flat)
        hit = ring.valid[flat]
        prio[hit] = state.sampleable[where[hit]]
    extras = {name: cols[EXTRA_PREFIX + name] for name, _, _ in store.spec.extras}
    return EpisodeSteps(
        episode=int(episode), env=int(flat[0] // ring.slots_per_env), pos=cols["pos"].copy(),
        ids=np.where(has, cols["id"], -1), action=cols["action"].copy(),
        reward=cols["reward"].astype(np.float64), terminated=cols["terminated"] & has,
        truncated=cols["truncated"] & has, sampleable=ring.valid[flat].copy(), priority=prio,
        extras={k: np.where(_rows(has, v), v, 0) for k, v in extras.items()})


def _rows(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    """`mask` (N,) shaped to broadcast over an (N, ...) array."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))
