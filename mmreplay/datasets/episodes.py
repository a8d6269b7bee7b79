"""Whole episodes in and out of a store: what dataset exporters and importers share.

An episode of T steps is T+1 single frames and T steps::

    observations  o_0  o_1  ...  o_T          (T+1, *obs_shape)
    actions       a_0  a_1  ...  a_{T-1}      (T, *action_shape)
    rewards, terminations, truncations        (T,)  only the last step may end it

`read_episodes` yields the finished episodes whose frames are all still kept, in
episode order, reading frames in batches (memory stays bounded by `batch_frames` plus
the longest episode); `write_episode` records one into a store (``reset`` + ``add``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mmreplay.errors import DatasetFormatError
from mmreplay.store import ReplayStore

BATCH_FRAMES = 4096


@dataclass(frozen=True)
class Episode:
    """One finished episode (see the module doc); `env` and `number` as in the store."""

    env: int
    number: int
    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray

    def __len__(self) -> int:
        return int(self.rewards.shape[0])


@dataclass(frozen=True)
class EpisodeSpans:
    """Where the exportable episodes' frames are: flat slots, and each episode's range."""

    env: np.ndarray     # (E,) env of each episode
    number: np.ndarray  # (E,) episode number
    starts: np.ndarray  # (E + 1,) episode i's frames are slots[starts[i]:starts[i+1]]
    slots: np.ndarray   # flat slots of all their frames, episode after episode


def episode_spans(store: ReplayStore) -> EpisodeSpans:
    """The finished, fully kept episodes with at least one step, by episode number."""
    ring = store.views.step_columns()
    env, frames = ring.kept_frames()
    cols = ring.steps[env, frames % ring.slots_per_env]
    order = np.lexsort((frames, cols["episode"]))
    env, frames, cols = env[order], frames[order], cols[order]
    cut = np.flatnonzero(np.r_[True, cols["episode"][1:] != cols["episode"][:-1], True])
    first, stop = cut[:-1], cut[1:]
    last = stop - 1
    done = ~cols["has_step"][last] & (stop - first >= 2)
    before = np.maximum(last - 1, 0)
    done &= cols["terminated"][before] | cols["truncated"][before]
    done &= cols["pos"][first] == 0
    keep = np.repeat(done, stop - first)
    lengths = (stop - first)[done]
    return EpisodeSpans(env=env[first][done], number=cols["episode"][first][done],
                        starts=np.r_[0, np.cumsum(lengths)],
                        slots=ring.flat(env, frames)[keep])


def read_episodes(store: ReplayStore, *, batch_frames: int = BATCH_FRAMES
                  ) -> Iterator[Episode]:
    """Every finished, fully kept episode (see `episode_spans`), frames read in batches."""
    spans = episode_spans(store)
    steps = store.views.step_columns().steps.reshape(-1)
    i, count = 0, spans.number.size
    while i < count:
        j = i + 1
        while j < count and spans.starts[j + 1] - spans.starts[i] <= batch_frames:
            j += 1
        lo = spans.starts[i]
        frames = store.views.read_frames(spans.slots[lo:spans.starts[j]])
        for k in range(i, j):
            a, b = spans.starts[k] - lo, spans.starts[k + 1] - lo
            cols = steps[spans.slots[spans.starts[k]:spans.starts[k + 1] - 1]]
            yield Episode(env=int(spans.env[k]), number=int(spans.number[k]),
                          observations=frames[a:b], actions=cols["action"].copy(),
                          rewards=cols["reward"].copy(), terminations=cols["terminated"].copy(),
                          truncations=cols["truncated"].copy())
        i = j


def check_episode(observations: np.ndarray, actions: np.ndarray, rewards: np.ndarray,
                  terminations: np.ndarray, truncations: np.ndarray, where: str) -> None:
    """T+1 observations for T steps, and nothing ends the episode before its last step."""
    steps = len(rewards)
    lengths = {"observations": len(observations) - 1, "actions": len(actions),
               "terminations": len(terminations), "truncations": len(truncations)}
    bad = {k: v for k, v in lengths.items() if v != steps}
    if steps < 1 or bad:
        raise DatasetFormatError(
            f"{where}: {steps} rewards but {len(observations)} observations, "
            f"{len(actions)} actions, {len(terminations)} terminations and "
            f"{len(truncations)} truncations; expected T >= 1 steps and T+1 observations")
    ends = np.logical_or(terminations, truncations)[:-1]
    if ends.any():
        raise DatasetFormatError(f"{where}: step {int(np.flatnonzero(ends)[0])} of {steps} "
                                f"ends the episode before its last step")


def write_episode(store: ReplayStore, observations: np.ndarray, actions: np.ndarray,
                  rewards: np.ndarray, terminations: np.ndarray,
                  truncations: np.ndarray) -> None:
    """Record one episode (already checked by `check_episode`) into a one-env store."""
    store.reset(observations[0])
    terms, truncs = terminations.tolist(), truncations.tolist()
    for t in range(len(terms)):
        store.add(actions[t], rewards[t], observations[t + 1], bool(terms[t]), bool(truncs[t]))
