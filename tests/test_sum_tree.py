"""Tests for mmreplay.index.sum_tree: reference equivalence, find() safety, statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreplay.index.sum_tree import SumTree, _level_bits

CAPACITIES = [1, 7, 50, 1000]


class NaiveSumTree:
    """Deliberately naive reference: a Python list and linear scans, no cleverness to share bugs."""

    def __init__(self, capacity: int) -> None:
        self.masses = [0.0] * capacity

    def set(self, indices: list[int], values: list[float]) -> None:
        for i, v in zip(indices, values, strict=True):  # in order, so the last duplicate wins
            self.masses[i] = float(v)

    def set_all(self, values: list[float]) -> None:
        self.masses = [float(v) for v in values]

    def total(self) -> float:
        acc = 0.0
        for m in self.masses:
            acc += m
        return acc

    def prefix(self, i: int) -> float:
        acc = 0.0
        for m in self.masses[:i]:
            acc += m
        return acc

    def find_one(self, target: float) -> int:
        acc = 0.0
        for i, m in enumerate(self.masses):
            if m > 0.0 and acc <= target < acc + m:
                return i
            acc += m
        # target == total (or rounding above it): the last leaf with positive mass
        return max(i for i, m in enumerate(self.masses) if m > 0.0)

    def min_nonzero(self) -> float:
        positive = [m for m in self.masses if m > 0.0]
        return min(positive) if positive else math.inf


def _snapshot(tree: SumTree) -> tuple[np.ndarray, float, float]:
    return tree.get(np.arange(tree.capacity)), tree.total(), tree.min_nonzero()


def _assert_unchanged(tree: SumTree, before: tuple[np.ndarray, float, float]) -> None:
    masses, total, min_nz = _snapshot(tree)
    np.testing.assert_array_equal(masses, before[0])
    assert total == before[1]
    assert min_nz == before[2]
    tree.check_valid()


# --------------------------------------------------------------------------- reference equivalence


def _exact_masses(rng: np.random.Generator, size: int) -> np.ndarray:
    """Quarter-integer masses up to 100, ~30% zeros: every sum is exact in float64, so the tree and
    the naive list must agree bit for bit regardless of summation order."""
    masses = rng.integers(1, 401, size=size) / 4.0
    masses[rng.random(size) < 0.3] = 0.0
    return masses


def _random_batch(rng: np.random.Generator, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    idx = rng.integers(0, capacity, size=int(rng.integers(0, 24)))
    if idx.size:  # force duplicates with differing values even at large capacities
        idx = np.concatenate([idx, rng.choice(idx, size=int(rng.integers(1, 6)))])
    return idx, _exact_masses(rng, idx.size)


def _targets(rng: np.random.Generator, ref: NaiveSumTree) -> np.ndarray:
    total = ref.total()
    boundaries = [ref.prefix(int(i)) for i in rng.integers(0, len(ref.masses), size=4)]
    uniform = rng.random(12) * total
    return np.concatenate([uniform, boundaries, [0.0, total, np.nextafter(total, np.inf)]])


def _apply_random_op(
    rng: np.random.Generator, tree: SumTree, ref: NaiveSumTree, capacity: int
) -> None:
    op = rng.choice(["set", "set", "set", "set_all", "set_all_zero", "find"])
    if op == "set":
        idx, vals = _random_batch(rng, capacity)
        tree.set(idx, vals)
        ref.set(idx.tolist(), vals.tolist())
    elif op in ("set_all", "set_all_zero"):
        vals = _exact_masses(rng, capacity) if op == "set_all" else np.zeros(capacity)
        tree.set_all(vals)
        ref.set_all(vals.tolist())
    elif ref.total() > 0.0:
        targets = _targets(rng, ref)
        got = tree.find(targets)
        assert got.dtype == np.int64
        assert got.tolist() == [ref.find_one(float(t)) for t in targets]
    else:
        with pytest.raises(ValueError, match="total mass is 0"):
            tree.find(np.array([0.0]))


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_naive_reference(capacity: int, seed: int) -> None:
    rng = np.random.default_rng([seed, capacity])
    tree, ref = SumTree(capacity), NaiveSumTree(capacity)
    for _ in range(150):
        _apply_random_op(rng, tree, ref, capacity)
        tree.check_valid()
        assert tree.total() == ref.total()
        assert tree.min_nonzero() == ref.min_nonzero()
        assert tree.get(np.arange(capacity)).tolist() == ref.masses


@settings(max_examples=150, deadline=None)
@given(
    masses=st.lists(
        st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=1e6, allow_subnormal=True)),
        min_size=1,
        max_size=80,
    ),
    fractions=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=20),
)
def test_find_arbitrary_floats_lands_in_interval(
    masses: list[float], fractions: list[float]
) -> None:
    tree, ref = SumTree(len(masses)), NaiveSumTree(len(masses))
    tree.set_all(np.array(masses))
    ref.set_all(masses)
    tree.check_valid()
    assert tree.min_nonzero() == ref.min_nonzero()
    assert math.isclose(tree.total(), math.fsum(masses), rel_tol=1e-12, abs_tol=0.0)
    if tree.total() == 0.0:
        return
    targets = np.array(fractions) * tree.total()
    tol = 1e-9 * tree.total()  # float masses: summation order may move boundaries by rounding
    for t, leaf in zip(targets, tree.find(targets), strict=True):
        assert masses[leaf] > 0.0
        lo = ref.prefix(int(leaf))
        assert lo - tol <= t <= lo + masses[leaf] + tol


# --------------------------------------------------------------------------- find() safety


def _sparse_float_masses(rng: np.random.Generator, capacity: int) -> np.ndarray:
    masses = rng.random(capacity) * 10.0 ** rng.integers(-8, 4, size=capacity)
    masses[rng.random(capacity) < 0.8] = 0.0
    masses[-max(1, capacity // 5) :] = 0.0  # trailing zeros: target == total must not land here
    masses[rng.integers(0, max(1, capacity - capacity // 5))] = 0.1
    return masses


@pytest.mark.parametrize("capacity", [2, 3, 7, 50, 1000, 4097])
def test_find_never_returns_zero_mass_leaf(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    for _ in range(20):
        masses = _sparse_float_masses(rng, capacity)
        tree.set_all(masses)
        total = tree.total()
        edges = np.concatenate([[0.0], np.cumsum(masses)])
        targets = np.concatenate(
            [
                edges,
                np.nextafter(edges, np.inf),
                np.nextafter(edges, -np.inf),
                rng.random(1000) * total,
                [total, np.nextafter(total, np.inf), total * (1.0 + 1e-10)],
            ]
        )
        targets = np.clip(targets, 0.0, total * (1.0 + 1e-10))
        leaves = tree.find(targets)
        assert np.all(masses[leaves] > 0.0)



@pytest.mark.parametrize("capacity", [16, 100, 4097])
def test_find_at_float_boundaries_lands_on_positive_leaf_in_its_interval(capacity: int) -> None:
    # Subtracting a prefix can leave a remainder at or above the chosen child's own total by
    # rounding; each level must still pick a positive child. Half the leaves are zero, so many
    # prefix rows end in zero-mass children.
    rng = np.random.default_rng(capacity + 5)
    tree = SumTree(capacity)
    for _ in range(100):
        masses = rng.random(capacity) * 10.0 ** rng.integers(-3, 3, size=capacity)
        masses[rng.random(capacity) < 0.5] = 0.0
        masses[rng.integers(0, capacity)] = 1.0
        tree.set_all(masses)
        total = tree.total()
        edges = np.concatenate([[0.0], np.cumsum(masses)])
        targets = np.concatenate([edges, np.nextafter(edges, np.inf), np.nextafter(edges, 0.0),
                                  rng.random(500) * total])
        targets = np.clip(targets, 0.0, total)
        leaves = tree.find(targets)
        assert np.all(masses[leaves] > 0.0)
        tol = 1e-11 * total
        assert np.all(edges[leaves] - tol <= targets)
        assert np.all(targets <= edges[leaves + 1] + tol)

def test_find_with_single_positive_leaf_always_returns_it() -> None:
    tree = SumTree(1000)
    tree.set(np.array([613]), np.array([1e-300]))
    targets = np.array([0.0, 5e-301, 1e-300, np.nextafter(1e-300, np.inf)])
    assert tree.find(targets).tolist() == [613] * 4


def test_find_rounding_prone_masses() -> None:
    # 0.1 + 0.2 rounds up; left subtree sums can exceed the exact prefix, so right-hand zero
    # subtrees must be skipped by mass, not by arithmetic.
    tree = SumTree(6)
    tree.set_all(np.array([0.1, 0.2, 0.3, 0.0, 0.0, 0.0]))
    total = tree.total()
    got = tree.find(np.array([0.3, 0.30000000000000004, 0.6, total, np.nextafter(total, 1.0)]))
    assert np.all(got <= 2)
    assert got[-1] == 2


def test_find_shape_and_dtype() -> None:
    tree = SumTree(7)
    tree.set_all(np.arange(7, dtype=np.float64))
    got = tree.find(np.array([[0.0, 1.5], [20.0, 20.5]]))
    assert got.dtype == np.int64
    assert got.tolist() == [[1, 2], [6, 6]]


@pytest.mark.parametrize("bad", [-1e-12, np.nan, np.inf, 10.0 * (1.0 + 1e-6)])
def test_find_rejects_out_of_range_targets(bad: float) -> None:
    tree = SumTree(7)
    tree.set(np.array([2, 5]), np.array([4.0, 6.0]))
    with pytest.raises(ValueError, match="targets must lie"):
        tree.find(np.array([1.0, bad]))


def test_find_on_empty_tree_raises() -> None:
    tree = SumTree(7)
    with pytest.raises(ValueError, match="total mass is 0"):
        tree.find(np.array([0.0]))
    tree.set(np.array([3]), np.array([2.0]))
    tree.set(np.array([3]), np.array([0.0]))
    with pytest.raises(ValueError, match="total mass is 0"):
        tree.find(np.array([0.0]))


# --------------------------------------------------------------------------- statistics


# Upper 0.1% point of the chi-square distribution with 39 degrees of freedom, used only when scipy
# is missing (scipy.stats.chi2.ppf(0.999, 39) == 72.0546...).
_CHI2_999_DF39 = 72.0546


def _chi2_rejects(observed: np.ndarray, expected: np.ndarray) -> bool:
    """True if a chi-square goodness-of-fit test rejects at the 0.1% level (df = len - 1 = 39)."""
    assert observed.size == 40
    try:
        from scipy.stats import chisquare
    except ImportError:
        stat = float(np.sum((observed - expected) ** 2 / expected))
        return stat > _CHI2_999_DF39
    return bool(chisquare(observed, expected).pvalue < 1e-3)


def test_find_frequencies_match_masses() -> None:
    rng = np.random.default_rng(20240521)
    masses = rng.uniform(0.2, 2.0, size=50)
    zero = np.array([0, 1, 9, 17, 18, 30, 31, 32, 48, 49])  # 10 zeros -> 40 positive, df = 39
    masses[zero] = 0.0
    tree = SumTree(50)
    tree.set_all(masses)
    n = 200_000
    counts = np.bincount(tree.find(rng.random(n) * tree.total()), minlength=50)
    assert counts[zero].sum() == 0
    positive = masses > 0.0
    expected = n * masses[positive] / masses.sum()
    assert not _chi2_rejects(counts[positive], expected)
    # power check: the same counts must reject a wrong (uniform) distribution
    assert _chi2_rejects(counts[positive], np.full(40, n / 40))


# --------------------------------------------------------------------------- 0/1 masses


def _assert_kth_one(tree: SumTree, mask: np.ndarray, rng: np.random.Generator) -> None:
    ones = np.flatnonzero(mask)
    assert tree.total() == float(ones.size)  # integer masses: exact total
    if ones.size == 0:
        return
    k = np.arange(ones.size, dtype=np.float64)
    np.testing.assert_array_equal(tree.find(k + 0.5), ones)
    np.testing.assert_array_equal(tree.find(k), ones)
    np.testing.assert_array_equal(tree.find(k + rng.random(ones.size) * 0.999999), ones)


@pytest.mark.parametrize("capacity", [1, 7, 50, 1000, 65_537])
def test_zero_one_masses_find_kth_one(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    mask = rng.random(capacity) < 0.4
    tree.set_all(mask.astype(np.float64))
    _assert_kth_one(tree, mask, rng)
    for _ in range(20):  # incremental 0/1 updates, as the uniform sampler does them
        idx = rng.integers(0, capacity, size=int(rng.integers(1, 64)))
        bits = rng.random(idx.size) < 0.5
        tree.set(idx, bits.astype(np.float64))
        for i, b in zip(idx, bits, strict=True):
            mask[i] = b
        _assert_kth_one(tree, mask, rng)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=300))
def test_zero_one_masses_hypothesis(bits: list[bool]) -> None:
    mask = np.array(bits)
    tree = SumTree(mask.size)
    tree.set(np.arange(mask.size), mask.astype(np.float64))
    tree.check_valid()
    _assert_kth_one(tree, mask, np.random.default_rng(0))


# --------------------------------------------------------------------------- set() semantics


def test_duplicate_indices_last_value_wins() -> None:
    tree = SumTree(7)
    tree.set(np.array([3, 3, 5, 3]), np.array([1.0, 2.0, 3.0, 4.0]))
    assert tree.get(np.array([3, 5])).tolist() == [4.0, 3.0]
    assert tree.total() == 7.0
    tree.set(np.array([5, 5]), np.array([9.0, 0.0]))
    assert tree.get(np.array([5])).tolist() == [0.0]
    assert tree.min_nonzero() == 4.0
    tree.check_valid()


def test_duplicate_indices_last_value_wins_large_batch() -> None:
    rng = np.random.default_rng(3)
    tree = SumTree(50)
    idx = rng.integers(0, 50, size=5000)
    tree.set(idx, np.arange(idx.size, dtype=np.float64))
    last = np.zeros(50)
    for pos, i in enumerate(idx.tolist()):
        last[i] = float(pos)
    np.testing.assert_array_equal(tree.get(np.arange(50)), last)
    tree.check_valid()


def test_scalar_value_broadcasts() -> None:
    tree = SumTree(7)
    tree.set(np.array([0, 4, 6]), 1.0)
    assert tree.get(np.arange(7)).tolist() == [1.0, 0, 0, 0, 1.0, 0, 1.0]


def _populated(capacity: int = 50) -> SumTree:
    tree = SumTree(capacity)
    tree.set_all(np.random.default_rng(7).uniform(0.5, 3.0, size=capacity))
    return tree


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0, -1e-300])
def test_bad_values_raise_and_leave_tree_unchanged(bad: float) -> None:
    tree = _populated()
    before = _snapshot(tree)
    with pytest.raises(ValueError, match=rf"finite and >= 0, got {bad!r}"):
        tree.set(np.array([1, 2, 3]), np.array([5.0, bad, 6.0]))
    _assert_unchanged(tree, before)
    values = np.ones(50)
    values[49] = bad
    with pytest.raises(ValueError, match="finite and >= 0"):
        tree.set_all(values)
    _assert_unchanged(tree, before)


@pytest.mark.parametrize("bad_index", [-1, 50, 51, 10**12])
def test_out_of_range_indices_raise_and_leave_tree_unchanged(bad_index: int) -> None:
    tree = _populated()
    before = _snapshot(tree)
    with pytest.raises(IndexError, match=f"leaf index {bad_index} out of range"):
        tree.set(np.array([0, bad_index, 4]), np.array([9.0, 9.0, 9.0]))
    _assert_unchanged(tree, before)
    with pytest.raises(IndexError):
        tree.get(np.array([bad_index]))


def test_malformed_arguments_raise() -> None:
    tree = _populated(7)
    before = _snapshot(tree)
    with pytest.raises(TypeError, match="integers"):
        tree.set(np.array([1.0]), np.array([1.0]))
    with pytest.raises(TypeError, match="integers"):
        tree.get(np.array([True, False]))
    with pytest.raises(ValueError, match="do not fit"):
        tree.set(np.array([1, 2]), np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="do not fit"):
        tree.set_all(np.ones(6))
    _assert_unchanged(tree, before)


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SumTree(capacity)


@pytest.mark.parametrize("capacity", [2.5, True, "8"])
def test_capacity_must_be_int(capacity: object) -> None:
    with pytest.raises(TypeError):
        SumTree(capacity)  # type: ignore[arg-type]


def test_fresh_tree_is_empty() -> None:
    tree = SumTree(13)
    assert tree.capacity == 13
    assert tree.total() == 0.0
    assert tree.min_nonzero() == math.inf
    assert tree.get(np.arange(13)).dtype == np.float64
    tree.check_valid()


# --------------------------------------------------------------------------- invariants and drift


@pytest.mark.parametrize(
    ("array", "node"),
    [("_sum", 1), ("_sum", 5), ("_min", 1), ("_min", 9)],
)
def test_check_valid_detects_corrupt_internal_node(array: str, node: int) -> None:
    tree = _populated(13)
    getattr(tree, array)[node] *= 1.0 + 1e-6
    # the corrupt node disagrees with its children and its parent with it; either may be named
    with pytest.raises(RuntimeError, match=f"node ({node}|{node // 2}) holds"):
        tree.check_valid()


def test_check_valid_detects_corrupt_leaves() -> None:
    tree = _populated(13)
    tree._sum[16 + 13] = 1.0  # padding leaf (P = 16)
    with pytest.raises(RuntimeError, match="padding"):
        tree.check_valid()
    tree = _populated(13)
    tree._min[16 + 2] = 123.0
    with pytest.raises(RuntimeError, match="min tree leaves"):
        tree.check_valid()


def test_check_valid_detects_corrupt_prefix_row() -> None:
    tree = _populated(1000)
    tree._levels[-1].prefix[3, 2] += 1e-9  # a running sum find() would bisect, not a node mass
    with pytest.raises(RuntimeError, match="prefix row of sum tree node"):
        tree.check_valid()

def test_no_drift_after_many_updates() -> None:
    rng = np.random.default_rng(99)
    tree = SumTree(1000)
    updates = 0
    while updates < 100_000:
        idx = rng.integers(0, 1000, size=int(rng.integers(1, 200)))
        vals = rng.random(idx.size) * 10.0 ** rng.integers(-6, 3, size=idx.size)
        vals[rng.random(idx.size) < 0.01] = 1e12  # spikes: delta updates would lose precision
        vals[rng.random(idx.size) < 0.1] = 0.0
        tree.set(idx, vals)
        updates += idx.size
    for chunk in np.array_split(rng.permutation(1000), 37):  # clear spikes through set(), too
        tree.set(chunk, rng.random(chunk.size))
    leaves = tree.get(np.arange(1000))
    assert math.isclose(tree.total(), math.fsum(leaves.tolist()), rel_tol=1e-9, abs_tol=0.0)
    assert tree.min_nonzero() == leaves[leaves > 0.0].min()
    tree.check_valid()


# --------------------------------------------------------------------------- level layout


@pytest.mark.parametrize("depth", range(41))
def test_level_bits_cover_the_depth_with_few_wide_levels(depth: int) -> None:
    bits = _level_bits(depth)
    assert sum(bits) == depth
    assert all(b >= 1 for b in bits)
    assert len(bits) >= min(depth, 3)  # small trees stay (close to) binary
    if depth <= 3:
        assert bits == (1,) * depth
    if bits:
        assert bits[0] <= 10  # the root row is rebuilt whole on every set()
        assert all(b <= 5 for b in bits[1:])  # rows gathered per updated leaf stay short


def _int_reference_find(masses: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Exact for integer masses: the first leaf whose running sum exceeds t; t >= total -> last
    positive leaf."""
    edges = np.cumsum(masses)
    got = np.searchsorted(edges, targets, side="right")
    return np.where(targets >= edges[-1], np.flatnonzero(masses)[-1], got)


@pytest.mark.parametrize("capacity", [70_000, 5_000])
def test_integer_masses_match_cumsum_reference_on_wide_levels(capacity: int) -> None:
    # Depth 17 (levels of 128, 32, 32 children) and 13 (32, 16, 16): exact equality, boundaries
    # included, through incremental updates with repeats and batches big enough to rebuild whole
    # levels.
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    masses = rng.integers(0, 50, size=capacity).astype(np.float64)
    tree.set_all(masses)
    for size in [1, 7, 32, 300, 5000, 32, 3]:
        idx = rng.integers(0, capacity, size=size)
        vals = rng.integers(0, 3, size=size).astype(np.float64)
        tree.set(idx, vals)
        last = {int(i): v for i, v in zip(idx, vals, strict=True)}  # the last repeat wins
        masses[list(last)] = list(last.values())
        tree.check_valid()
        np.testing.assert_array_equal(tree.get(np.arange(capacity)), masses)
        total = float(masses.sum())
        assert tree.total() == total
        edges = np.cumsum(masses)[rng.integers(0, capacity, size=200)]
        targets = np.concatenate(
            [rng.random(500) * total, edges, np.nextafter(edges, 0.0), [0.0, total]]
        )
        targets = np.clip(targets, 0.0, total)
        np.testing.assert_array_equal(tree.find(targets), _int_reference_find(masses, targets))


def test_incremental_updates_equal_a_rebuild_bit_for_bit() -> None:
    # The tree must be a function of its leaves (a loaded sampler must draw exactly like the one
    # that was saved), whatever mix of gathered and whole-level rebuilds produced it.
    rng = np.random.default_rng(11)
    capacity = 5000
    tree = SumTree(capacity)
    for _ in range(60):
        size = int(rng.choice([1, 5, 32, 200, 3000]))
        idx = rng.integers(0, capacity, size=size)
        vals = rng.random(size) * 10.0 ** rng.integers(-8, 5, size=size)
        vals[rng.random(size) < 0.2] = 0.0
        tree.set(idx, vals)
    rebuilt = SumTree(capacity)
    rebuilt.set_all(tree.get(np.arange(capacity)))
    np.testing.assert_array_equal(tree._sum, rebuilt._sum)
    np.testing.assert_array_equal(tree._min, rebuilt._min)
    targets = rng.random(20_000) * tree.total()
    np.testing.assert_array_equal(tree.find(targets), rebuilt.find(targets))
    tree.check_valid()


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_find_checked_and_arrays_agree_with_find(capacity):
    """`find_checked` (no target checks) walks as `find` does, and `arrays` views the live
    node arrays (a write through them shows in `total`)."""
    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity)
    tree.set(np.arange(capacity), rng.integers(0, 3, capacity).astype(np.float64) + 0.5)
    targets = rng.random(64) * tree.total()
    np.testing.assert_array_equal(tree.find_checked(targets), tree.find(targets))
    arrays = tree.arrays()
    assert arrays.sums[1] == tree.total() and arrays.leaf0 >= capacity
