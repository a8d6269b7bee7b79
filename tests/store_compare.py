"""Field-by-field comparison of two stores (shared by the dataset round-trip tests)."""

from __future__ import annotations

import torch

from mmreplay import ReplayStore
from mmreplay.tools import inspection as ins

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "discount", "ids")


def assert_stores_equal(a: ReplayStore, b: ReplayStore, *, same_ids: bool = True) -> None:
    """Same counts, sampleable ids, every sampleable transition and every episode row."""
    assert a.counts == b.counts
    ids_a, ids_b = a.valid_ids(), b.valid_ids()
    assert ids_a.size > 0
    if same_ids:
        assert ids_a.tolist() == ids_b.tolist()
    assert ids_a.size == ids_b.size
    got_a, got_b = a.get(ids_a), b.get(ids_b)
    for field in FIELDS:
        if field == "ids" and not same_ids:
            continue
        x, y = getattr(got_a, field), getattr(got_b, field)
        assert x.dtype == y.dtype, field
        assert torch.equal(x, y), field
    assert ins.episode_table(a) == ins.episode_table(b)
