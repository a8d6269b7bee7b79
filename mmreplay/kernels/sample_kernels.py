"""Compiled kernels of a whole batch in one call: draw, look up, read.

A sampled batch used to take three compiled calls with Python between them (the tree walk,
the ring lookup, the frame read). Each is quick alone, but a batch's read writes ~1.8 MB of
frames, which leaves the CPU's caches cold for the Python that follows. Here the three run
back to back in one call::

    TreeDraw --(draw_slots)--> flat slots, weights --(lookup)--> stacks, returns, flags, ids
        --(read_frames | table_read)--> frames

Arguments come in named tuples (`kernels.structs`), as their owners hand them out: ``draw``
is a `TreeDraw` of the sampler, ``ring`` the ring's `RingColumns`, ``outs`` a `SampleOut`
and ``read`` what the frame store's read takes (`OnePassRead` or `TableRead`). The statuses
are the reads' own (`numba_kernels.read_frames`, `table_kernels.table_read`): whatever the
call cannot finish, the frame store finishes with its plain read of the stacks the call
looked up.

The uniform sampler's targets come from here too (`uniform_targets`): numpy's bounded
integers of ``rng.integers(0, count, size)``, drawn from the generator's own bit source,
the same values and the same generator state afterwards, without numpy's per-call cost.

Loaded on first use through `mmreplay.kernels.samples()`, never by ``import mmreplay``.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from mmreplay.kernels.numba_kernels import lookup, read_frames
from mmreplay.kernels.structs import OnePassRead, RingColumns, SampleOut, TableRead, TreeDraw
from mmreplay.kernels.table_kernels import table_read
from mmreplay.kernels.tree_kernels import tree_find, tree_stratified


@intrinsic  # type: ignore[misc]
def _next_uint32_intrinsic(typingctx, fn, state):  # type: ignore[no-untyped-def]
    """``fn(state)`` for the address of a bit generator's ``uint32_t next_uint32(void *)``."""
    sig = types.uint32(types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        void_p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [void_p])
        call = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(call, [builder.inttoptr(args[1], void_p)])

    return sig, codegen


_next_uint32: Any = _next_uint32_intrinsic  # called from compiled code only


@numba.njit(nogil=True, cache=True)
def uniform_targets(fn: int, state: int, count: int, out: np.ndarray) -> None:
    """``out[i] = k_i + 0.5`` where ``k`` is what ``rng.integers(0, count, out.size)`` gives
    (2 <= `count` < 2**32), drawn in the same order from the same bit source: `fn` and
    `state` are the addresses of the generator's ``next_uint32`` and state (numpy's
    ``random_bounded_uint64_fill``: Lemire's multiply and reject on 32-bit draws)."""
    excl = np.uint64(count)
    threshold = np.uint64((np.uint64(0xFFFFFFFF) - (excl - np.uint64(1))) % excl)
    low = np.uint64(0xFFFFFFFF)
    for i in range(out.size):
        m = np.uint64(_next_uint32(fn, state)) * excl
        if m & low < excl:
            while m & low < threshold:
                m = np.uint64(_next_uint32(fn, state)) * excl
        out[i] = np.float64(m >> np.uint64(32)) + 0.5


@numba.njit(nogil=True, cache=True)
def draw_slots(draw: TreeDraw, flat: np.ndarray, weights: np.ndarray) -> None:
    """The slots and importance weights of a `TreeDraw`: what the sampler's `sample` draws
    (`SumTree.find_checked` of the targets, or `SumTree.stratified_checked` of the
    uniforms); a tree without levels (one leaf) draws leaf 0, weight 1."""
    tree = draw.tree
    flat[:] = 0
    weights[:] = 1.0
    if tree.offsets.size == 0:
        return
    if draw.stratified:
        tree_stratified(tree, draw.values, draw.beta, flat, weights)
    else:
        tree_find(tree.prefix, tree.offsets, tree.fanouts, draw.values, flat)


@numba.njit(nogil=True, cache=True)
def draw_and_look(draw: TreeDraw, ring: RingColumns, outs: SampleOut) -> None:
    """`draw_slots`, then the ring's `lookup` of the slots drawn, into ``outs`` (alone: a
    ``device=`` store's sample, whose frames are gathered on its device)."""
    draw_slots(draw, outs.flat, outs.weights)
    lookup(outs.flat, ring, outs.look)


@numba.njit(nogil=True, cache=True)
def sample_one_pass(draw: TreeDraw, ring: RingColumns, outs: SampleOut,
                    read: OnePassRead) -> int:
    """Draw, look up and `read_frames` the stacks (``outs.stacks``, every frame once a row of
    ``read.out``) of a store without a decoded-chunk table; returns `read_frames`' status."""
    draw_and_look(draw, ring, outs)
    return read_frames(outs.stacks.reshape(-1), read, 0, 1)


@numba.njit(nogil=True, cache=True)
def sample_table(draw: TreeDraw, ring: RingColumns, outs: SampleOut, read: TableRead) -> int:
    """Draw, look up and `table_read` the stacks through a decoded-chunk table; returns
    `table_read`'s status."""
    draw_and_look(draw, ring, outs)
    stacks = outs.stacks
    return table_read(stacks.reshape(-1), read, stacks.shape[2])
