"""`UniformSampler`: uniform over the sampleable slots, through a 0/1 sum tree."""

from __future__ import annotations

import ctypes

import numpy as np

from mmreplay.index.samplers.protocol import Draw, FloatArray, array_nbytes
from mmreplay.index.sum_tree import SumTree
from mmreplay.kernels import samples as sample_kernels
from mmreplay.kernels.structs import TreeDraw


class UniformSampler:
    """Uniform over sampleable slots via a 0/1 sum tree.

    A draw picks ``k ~ U{0..count-1}`` and returns the k-th sampleable slot in
    slot order, so the result depends only on the set of sampleable slots and
    the RNG state, not on the history that produced that set (exact resume).
    """

    def __init__(self, num_slots: int) -> None:
        self._tree = SumTree(num_slots)
        self._source: tuple[np.random.BitGenerator, int, int] | None = None  # `_bit_source`

    def update(self, slots: np.ndarray, valid: np.ndarray, ids: np.ndarray) -> None:
        self._tree.set(slots, valid.astype(np.float64))

    def count(self) -> int:
        return int(round(self._tree.total()))

    def sample(self, rng: np.random.Generator, batch_size: int, beta: float = 0.0) -> Draw:
        # ``rng.integers``' draws (compiled in `_targets`) keep those of a seed (and of a saved
        # RNG state) the same across versions: the golden stores pin them
        # (tests/test_format.py), so a run resumed by a newer version draws what the old would.
        targets = self._targets(rng, batch_size)
        slots = self._tree.find_checked(targets)  # k + 0.5 < count == total
        return Draw(slots=slots, weights=np.ones(batch_size, np.float32))

    def tree_draw(self, rng: np.random.Generator, batch_size: int,
                  beta: float = 0.0) -> TreeDraw:
        return TreeDraw(self._targets(rng, batch_size), False, 0.0, self._tree.arrays())

    def _targets(self, rng: np.random.Generator, batch_size: int) -> FloatArray:
        """``rng.integers(0, count, batch_size) + 0.5``: the same values and the same
        generator state afterwards, drawn in one compiled call where numpy's draw takes
        32-bit words (2 <= count < 2**32; ~0.7 against ~7 µs for 32)."""
        count = self.count()
        source = self._source
        if source is None or source[0] is not rng.bit_generator:
            source = self._source = _bit_source(rng.bit_generator)
        if not 2 <= count < 1 << 32 or source[1] == 0:
            return rng.integers(0, count, size=batch_size) + 0.5
        out = np.empty(batch_size, np.float64)
        with source[0].lock:  # as numpy holds it while it draws
            sample_kernels().uniform_targets(source[1], source[2], count, out)
        return out

    def check_valid(self) -> None:
        self._tree.check_valid()

    def nbytes(self) -> int:
        return array_nbytes(self)


def _bit_source(bits: np.random.BitGenerator) -> tuple[np.random.BitGenerator, int, int]:
    """``(bits, next_uint32 address, state address)`` of a numpy bit generator, for
    `sample_kernels.uniform_targets`; addresses 0 if it exposes none (numpy then draws)."""
    try:
        iface = bits.ctypes
        return bits, int(ctypes.cast(iface.next_uint32, ctypes.c_void_p).value or 0), int(
            iface.state_address)
    except (AttributeError, TypeError, ctypes.ArgumentError):
        return bits, 0, 0
