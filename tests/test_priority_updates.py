"""The compiled priority update's checks and its two ways of getting masses.

A proportional update computes the masses ``(p + eps) ** alpha`` in the compiled call where
`priority_kernels.same_pow` finds its ``**`` equal to numpy's, and takes numpy's otherwise:
both must leave bit-identical trees and raise the same errors, writing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import frame

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.kernels import priorities as priority_kernels

OBS = (2, 2)
MODES = ["compiled", "numpy"]


def make(tmp_path, mode: str, monkeypatch, **kw) -> ReplayStore:
    """A prioritized store of 40 steps whose updates take masses the `mode` way (its sampler
    decides at its first update, made here)."""
    kernels = priority_kernels()
    same_pow = kernels.same_pow
    if mode == "numpy":  # as on a machine where numpy's pow is not the C library's
        monkeypatch.setattr(kernels, "same_pow", lambda eps, alpha: False)
    store = ReplayStore.create(tmp_path / mode, capacity=kw.pop("capacity", 64), obs_shape=OBS,
                               seed=0, sampler="prioritized", **kw)
    store.reset(frame(0, OBS))
    for i in range(1, 41):
        store.add(i % 4, 1.0, frame(i, OBS), i % 13 == 0, False, autoreset=i % 13 == 0)
    assert store.update_priorities([], []) == 0
    sampler = store._sampler
    assert sampler._kernel_masses is (mode == "compiled" and same_pow(sampler.eps, sampler.alpha))
    monkeypatch.undo()
    return store


def snapshot(store: ReplayStore) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Everything an update writes: priorities, exact probabilities (the tree), the step
    blocks marked for the next commit, the max."""
    sampler = store._sampler
    return (sampler.priorities(), sampler.probabilities(),
            store._priorities.marks.mask.copy(), sampler.max_priority())


def test_plain_values_statuses() -> None:
    kernels = priority_kernels()
    plain = kernels.plain_values
    assert plain(np.array([0.0, 1.5, 9.0]), 10.0) == 0
    assert plain(np.empty(0), 10.0) == 0
    for bad in (np.nan, np.inf, -1.0, -0.0 - 1e-300):
        assert plain(np.array([1.0, bad]), 10.0) == kernels.BAD_VALUE, bad
    assert plain(np.array([10.0, 1.0]), 10.0) == kernels.OVERFLOW  # at the limit: may overflow
    assert plain(np.array([11.0, np.nan]), 10.0) == kernels.BAD_VALUE  # a bad value wins
    assert plain(np.array([1.0, np.inf]), np.inf) == kernels.BAD_VALUE


@pytest.mark.parametrize(("eps", "alpha"), [(1e-6, 0.6), (0.0, 0.6), (0.01, 1.0), (1e-3, 7.5)])
def test_same_pow_agrees_with_numpy_over_many_values(eps: float, alpha: float) -> None:
    """Where the probe says the compiled ``**`` is numpy's, it is on any values too."""
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.random(50_000) * 10.0 ** rng.integers(-12, 12, 50_000),
                             rng.random(10_000)])
    with np.errstate(over="ignore"):
        want = (values + eps) ** alpha
    same = np.array_equal(priority_kernels().masses(values, eps, alpha), want)
    assert same == priority_kernels().same_pow(eps, alpha)


def test_both_mass_modes_build_the_same_tree(tmp_path, monkeypatch) -> None:
    rng = np.random.default_rng(4)
    stores = {mode: make(tmp_path, mode, monkeypatch) for mode in MODES}
    ids = stores["numpy"].valid_ids()
    for _ in range(20):
        pick, values = rng.choice(ids, 9), rng.random(9) * 10.0 ** rng.integers(-3, 4)
        assert len({store.update_priorities(pick, values) for store in stores.values()}) == 1
    got = {mode: snapshot(store) for mode, store in stores.items()}
    for a, b in zip(got["compiled"], got["numpy"], strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for store in stores.values():
        store._sampler.check_valid()
        store.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("values", "message"), [
    ([1.0, np.nan, 2.0], r"priorities must be finite and >= 0, got \[nan\]"),
    ([1.0, 2.0, -1.0], r"priorities must be finite and >= 0, got \[-1.0\]"),
    ([np.inf, 2.0, 3.0], r"priorities must be finite and >= 0, got \[inf\]"),
    ([1.0, 1e40, 2.0], r"priority 1e\+40 overflows \(p \+ eps\)\^alpha with alpha=10.0"),
    ([1.0, 2.0], r"priorities must be 3 numbers \(one per id\)"),
])
def test_rejected_updates_raise_the_same_error_and_write_nothing(tmp_path, monkeypatch,
                                                                  mode, values, message):
    store = make(tmp_path, mode, monkeypatch, alpha=10.0)
    ids = store.valid_ids()[:3]
    store.update_priorities(ids, [2.0, 3.0, 4.0])
    store.flush()
    before = snapshot(store)
    assert not before[2].any()  # the commit took the marks
    with pytest.raises(InvalidInputError, match=message):
        store.update_priorities(ids, np.array(values))
    for a, b in zip(snapshot(store), before, strict=True):
        np.testing.assert_array_equal(a, b)
    store._sampler.check_valid()
    store.close()
    with ReplayStore.open(tmp_path / mode, mode="r") as reopened:
        np.testing.assert_array_equal(reopened._sampler.priorities(), before[0])


@pytest.mark.parametrize("mode", MODES)
def test_stale_unknown_and_repeated_ids_in_both_modes(tmp_path, monkeypatch, mode) -> None:
    store = make(tmp_path, mode, monkeypatch, capacity=16)
    ids = store.valid_ids()
    # ids 0 and 1 left the ring, 10**9 never came, -3 is no id; the last value of ids[0] wins
    got = store.update_priorities([0, 1, 10**9, -3, int(ids[0]), int(ids[1]), int(ids[0])],
                                  [9.0, 9.0, 9.0, 9.0, 2.0, 3.0, 4.0])
    assert got == 2
    flat, _ = store._ring.flat_of_ids(ids[:2])
    np.testing.assert_array_equal(store._sampler.priorities()[flat], [4.0, 3.0])
    assert store._sampler.max_priority() == 4.0
    store._sampler.check_valid()
    store.close()


def test_torch_ids_and_values_with_grad(tmp_path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    store = make(tmp_path, "compiled", monkeypatch)
    ids = store.valid_ids()[:3]
    values = torch.tensor([1.5, 2.5, 3.5], dtype=torch.float64, requires_grad=True)
    assert store.update_priorities(torch.from_numpy(ids), values) == 3
    assert store.update_priorities(torch.from_numpy(ids)[::2], values.detach()[::2] * 2) == 2
    flat, _ = store._ring.flat_of_ids(ids)
    np.testing.assert_array_equal(store._sampler.priorities()[flat], [3.0, 2.5, 7.0])
    store.close()
