"""`mmreplay plot`: one figure of what a store holds and what its sampler draws (matplotlib).

Panels, in order; a panel with no data (no complete episode yet, a uniform store's
priorities) is left out rather than drawn empty, and an odd last panel spans the row::

    P(draw) over the ring, by id      | age of a drawn transition (exact)
    priority (prioritized stores)     | per-step reward
    episode length                    | episode return

Matplotlib is optional (the ``tools`` extra) and imported here only, without pyplot (no GUI
backend, no global state).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmreplay.store import ReplayStore
from mmreplay.tools.distributions import SamplingView, distributions, sampling_view
from mmreplay.tools.render import MissingExtraError

COLS = 2
RING_POINTS = 2000  # the P(draw) line: at most this many points (means over id ranges)


@dataclass(frozen=True)
class Panel:
    title: str
    draw: Callable[[Any], None]  # draws on a matplotlib Axes


@dataclass(frozen=True)
class PlotResult:
    figure: Any
    drawn: tuple[str, ...]
    skipped: tuple[str, ...]  # titles left out for want of data


def plot_store(store: ReplayStore, *, bins: int = 30) -> PlotResult:
    """The figure of `store` (see the module docstring)."""
    figure_cls = _figure_class()
    panels, skipped = _panels(store, bins)
    rows = max(1, -(-len(panels) // COLS))
    fig = figure_cls(figsize=(5.2 * COLS, 3.3 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, COLS)
    for i, panel in enumerate(panels):
        r, c = divmod(i, COLS)
        last_alone = i == len(panels) - 1 and c == 0
        ax = fig.add_subplot(grid[r, :] if last_alone else grid[r, c])
        ax.set_title(panel.title, fontsize=10)
        panel.draw(ax)
    return PlotResult(figure=fig, drawn=tuple(p.title for p in panels), skipped=skipped)


def _panels(store: ReplayStore, bins: int) -> tuple[list[Panel], tuple[str, ...]]:
    """(panels with data, names of those without)."""
    dist, view = distributions(store), sampling_view(store)
    n = view.ids.size
    # (name, title, has data, draw)
    candidates: list[tuple[str, str, bool, Callable[[Any], None]]] = [
        ("P(draw) over the ring", f"P(draw) over the ring by id ({view.sampler}; effective "
         f"sample size {view.effective_sample_size:.0f} of {n})", n > 0,
         lambda ax: _ring(ax, view)),
        ("age of a drawn transition", "age of a drawn transition (exact; 0 = newest)", n > 0,
         lambda ax: _ages(ax, view, bins))]
    if dist.priorities is not None:
        prios = dist.priorities
        candidates.append(("priority", f"priority (sampleable transitions), n={prios.size}",
                           prios.size > 0, lambda ax: _hist(ax, prios, bins)))
    for name, values in (("per-step reward (kept steps)", dist.rewards),
                         ("episode length (complete episodes)", dist.episode_lengths),
                         ("episode return (complete episodes)", dist.episode_returns)):
        candidates.append((name, f"{name}, n={values.size}", values.size > 0,
                           functools.partial(_hist, data=values, bins=bins)))
    panels = [Panel(title, draw) for _, title, has, draw in candidates if has]
    return panels, tuple(name for name, _, has, _ in candidates if not has)


def _ring(ax: Any, view: SamplingView) -> None:
    n = view.ids.size
    step = max(1, -(-n // RING_POINTS))
    starts = np.arange(0, n, step)
    mean_p = np.add.reduceat(view.probabilities, starts) / np.diff(np.r_[starts, n])
    ax.plot(view.ids[starts], mean_p, color="tab:blue", lw=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("transition id (oldest left)")
    ax.set_ylabel("P(draw) per id" if step == 1 else f"mean P(draw), {step} ids")


def _ages(ax: Any, view: SamplingView, bins: int) -> None:
    ages = view.next_id - 1 - view.ids
    ax.hist(ages, bins=min(bins, ages.size), weights=view.probabilities, color="tab:purple")
    ax.set_xlabel("age (transitions)")
    ax.set_ylabel("probability")


def _hist(ax: Any, data: np.ndarray, bins: int) -> None:
    ax.hist(data, bins=bins, color="tab:blue")
    ax.set_ylabel("count")


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError('`mmreplay plot` needs matplotlib: pip install '
                                '"mmreplay[tools]"') from None
    return Figure
