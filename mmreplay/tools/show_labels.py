"""The words under each frame of `mmreplay show`: stack position, id, action, reward, flags.

Pure text from `inspection` results; `render.labelled_sheet` draws it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmreplay.spec import StoreSpec
from mmreplay.tools.steps import EpisodeSteps, TransitionView


def flags(terminated: bool, truncated: bool) -> str:
    return "terminated" if terminated else "truncated" if truncated else ""


def value(x: Any) -> str:
    """An action or reward, short: ``2``, ``0.5``, ``[0.1, -1]``."""
    array = np.asarray(x)
    if array.ndim == 0:
        return f"{array.item():.4g}" if array.dtype.kind == "f" else str(array.item())
    return "[" + ", ".join(value(v) for v in array.reshape(-1)[:4]) + \
        (", …]" if array.size > 4 else "]")


def transition_title(view: TransitionView) -> str:
    end = flags(view.terminated, view.truncated)
    return (f"transition {view.id}: action {value(view.action)}, reward {value(view.reward)}, "
            f"discount {view.discount:.4g}" + (f", {end}" if end else ""))


def transition_labels(view: TransitionView, spec: StoreSpec) -> list[list[str]]:
    """Under obs frame k: ``obs[k] t-j``; under next_obs frame k: ``next[k] t+n-j``; under
    the newest obs frame the id, action and reward (``R<n>``: the n-step return), under
    the newest next frame the end flag."""
    k, n = view.obs.shape[0], spec.n_step
    reward = "r" if n == 1 else f"R{n}"  # the n-step discounted return when n > 1
    step = f"id {view.id}  a {value(view.action)}  {reward} {value(view.reward)}"
    obs = [[f"obs[{i}]  t{_offset(i - (k - 1))}", step if i == k - 1 else ""] for i in range(k)]
    end = flags(view.terminated, view.truncated)
    nxt = [[f"next[{i}]  t{_offset(n + i - (k - 1))}", end if i == k - 1 else ""]
           for i in range(k)]
    return obs + nxt


def _offset(j: int) -> str:
    return "" if j == 0 else f"{j:+d}"


def episode_labels(steps: EpisodeSteps) -> list[list[str]]:
    """Under frame t of an episode: position and id, then action, reward and flags."""
    out = []
    for t in range(steps.pos.size):
        tid = int(steps.ids[t])
        if tid < 0:
            out.append([f"t={steps.pos[t]}", "no step (last)"])
            continue
        end = flags(bool(steps.terminated[t]), bool(steps.truncated[t]))
        out.append([f"t={steps.pos[t]}  id {tid}",
                    f"a {value(steps.action[t])}  r {value(steps.reward[t])}"
                    + (f"  {end}" if end else "")])
    return out
