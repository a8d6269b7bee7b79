"""The checks of `FrameOnceReplayBuffer`'s configuration: n-step settings reconciled with
the SB3 algorithm's, argument types, and an existing store's spec against the buffer's.
Plain values in, `ValueError` out; nothing here opens a store.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np


def reconcile_n_steps(algo: Any, n_steps: int | None,
                       gamma: float | None) -> tuple[int, float]:
    """n-step settings from the kwargs and the algorithm, or a ValueError if they disagree.

    SB3 passes ``n_steps``/``gamma`` only to its own buffer: ``DQN(n_steps=3)`` with a
    custom class would otherwise train 1-step without a word.
    """
    algo_n = 1 if algo is None else int(algo.n_steps)
    algo_gamma = None if algo is None else float(algo.gamma)
    if n_steps is None and algo_n > 1:
        warnings.warn(f"FrameOnceReplayBuffer takes n_steps={algo_n}, gamma={algo_gamma} from "
                      f"the algorithm: its n-step returns are on", stacklevel=4)
    if n_steps is None:
        n_steps = algo_n
    n_steps = positive_int("n_steps", n_steps)
    if algo_n > 1 and n_steps != algo_n:
        raise ValueError(f"replay_buffer_kwargs n_steps={n_steps} contradicts the algorithm's "
                         f"n_steps={algo_n}")
    if gamma is None:
        gamma = 0.99 if algo_gamma is None else algo_gamma
    elif n_steps > 1 and algo_gamma is not None and float(gamma) != algo_gamma:
        raise ValueError(f"replay_buffer_kwargs gamma={gamma} contradicts the algorithm's "
                         f"gamma={algo_gamma}: n-step returns would discount differently")
    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    return n_steps, gamma


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"{name} must be None or one of {choices}, got {value!r}")


def check_spec(spec: Any, want: dict[str, Any], path: str) -> None:
    """Every setting in `want` is the store's, or a ValueError naming both."""
    for name, value in want.items():
        have = getattr(spec, name)
        if name.endswith("dtype"):
            have, value = np.dtype(have), np.dtype(value)
        elif name.endswith("shape"):
            have, value = tuple(have), tuple(value)
        if have != value:
            raise ValueError(f"the store at {path} has {name}={have!r}, this buffer needs "
                             f"{name}={value!r} (use another path, or the settings it was "
                             f"made with)")
