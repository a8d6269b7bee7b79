"""The named arguments of the compiled kernels, declared once and passed whole.

numba takes a named tuple in nopython mode field by field, so a kernel reads ``read.layout.chunk``
where it used to take its nineteenth positional parameter: moving a field moves no call site.
This module imports numpy only, so the owners of the arrays (the ring, the sum tree, the
samplers, the frame store) build these without loading numba. A field keeps one type across
calls (ints are Python or numpy int64, flags bools, arrays their fixed dtypes), so each kernel
compiles once.

Which kernel takes which::

    FrameLayout, ChunkBytes, TableArrays   table_kernels (claim_row, table_plan, table_read),
                                           scratch_plan, numba_kernels (read_keys, read_frames)
    OnePassRead, TableRead                 read_frames, table_read, sample_kernels
    RingColumns, LookupOut                 numba_kernels.lookup, sample_kernels
    TreeArrays                             tree_kernels (tree_set, tree_stratified, tree_draw),
                                           priority_kernels, sample_kernels.draw_slots
    TreeDraw, SampleOut                    sample_kernels
    IdMap, Priorities, Written             priority_kernels
    StepEvents, RecordColumns, RecordOut   record_kernels.record_events
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# -- frames (`storage.frame_store`, `storage.chunk_table`) -------------------------------------


class FrameLayout(NamedTuple):
    """Where a read's frames are. Flat slot ``f = env * slots + slot`` lies in chunk
    ``slot // chunk`` of its env (key ``env * num_chunks + c``), except the chunk an env is
    filling (``next_slot[env] // chunk``) below ``tail_fill[env]``: that frame is row
    ``env * chunk + offset`` of the RAM tails, ``tail_rows`` (one frame's bytes a row)."""

    slots: int
    chunk: int
    num_chunks: int
    next_slot: np.ndarray
    tail_fill: np.ndarray
    tail_rows: np.ndarray


class ChunkBytes(NamedTuple):
    """Where each chunk's encoded bytes are, by chunk key: the writer's RAM first
    (``ram_src``/``ram_size``, address 0: none), else its mapped shard file (``src``/``size``,
    address 0: not mapped yet), the file then marked used: ``used[env * shards + shard] =
    tick`` (`shards.ShardFiles.read_state`)."""

    src: np.ndarray
    size: np.ndarray
    ram_src: np.ndarray
    ram_size: np.ndarray
    used: np.ndarray
    tick: int
    shard_chunks: int


class TableArrays(NamedTuple):
    """A decoded-chunk table's arrays (`chunk_table.ChunkTable`, which draws them)."""

    rows: np.ndarray
    row_of: np.ndarray
    key_of: np.ndarray
    ref: np.ndarray
    pin: np.ndarray
    state: np.ndarray


class OnePassRead(NamedTuple):
    """A read in one pass with no table (`numba_kernels.read_frames`): ``scratch`` holds one
    decoded chunk, ``out`` gets a frame a row, ``missing`` the keys of files to map."""

    layout: FrameLayout
    chunks: ChunkBytes
    scratch: np.ndarray
    out: np.ndarray
    missing: np.ndarray


class TableRead(NamedTuple):
    """A read through a decoded-chunk table (`table_kernels.table_read`): ``sources`` gets
    each frame's source, ``out`` a frame a row, ``missing`` the keys of files to map."""

    layout: FrameLayout
    chunks: ChunkBytes
    table: TableArrays
    sources: np.ndarray
    out: np.ndarray
    missing: np.ndarray


# -- the ring's lookup (`index.ring`) ----------------------------------------------------------


class RingColumns(NamedTuple):
    """What `numba_kernels.lookup` reads of a ring: its cursors, geometry and flat step
    columns (``env * slots + slot``); ``gamma_pow[j] = gamma ** j``."""

    written: np.ndarray
    slots: int
    stack: int
    n_step: int
    pad_first: bool
    gamma_pow: np.ndarray
    pos: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    step_id: np.ndarray


class LookupOut(NamedTuple):
    """What `numba_kernels.lookup` writes, one row per slot looked up (``obs``/``next_obs``:
    ``(B, stack)`` flat slots, -1 = zero padding)."""

    obs: np.ndarray
    next_obs: np.ndarray
    ret: np.ndarray
    term: np.ndarray
    trunc: np.ndarray
    discount: np.ndarray
    steps: np.ndarray
    ids: np.ndarray


# -- sum trees and draws (`index.sum_tree`, `index.samplers`) ----------------------------------


class TreeArrays(NamedTuple):
    """A sum tree's node arrays and level table (see `sum_tree.SumTree` for the layout), as
    the compiled walks and updates take them; leaf ``j`` is node ``leaf0 + j``."""

    sums: np.ndarray
    mins: np.ndarray
    prefix: np.ndarray
    offsets: np.ndarray
    fanouts: np.ndarray
    firsts: np.ndarray
    shifts: np.ndarray
    leaf0: int


class TreeDraw(NamedTuple):
    """A draw for a compiled call to finish (`sample_kernels.draw_slots`): the same slots and
    weights `Sampler.sample` gives for the same RNG state. ``values`` are the targets to find
    (uniform: ``k + 0.5`` for the k-th sampleable slot) or, `stratified`, one uniform in
    [0, 1) per slice of the mass; ``tree`` is the sampler's tree (`SumTree.arrays`)."""

    values: np.ndarray
    stratified: bool
    beta: float
    tree: TreeArrays


class SampleOut(NamedTuple):
    """What a batch drawn in one call gets (`sample_kernels`): the flat slots drawn, their
    weights, and their lookup, whose ``obs``/``next_obs`` are the halves of ``stacks``
    (``(2, B, stack)``, the frames to read)."""

    flat: np.ndarray
    weights: np.ndarray
    stacks: np.ndarray
    look: LookupOut


# -- priority updates (`index.samplers`, `kernels.priority_kernels`) ---------------------------


class IdMap(NamedTuple):
    """Where transition ids live, for compiled callers: id ``i`` in ``[0, next_id)`` is at flat
    slot ``loc[i % loc.size]`` if ``slot_ids`` there is ``i``; otherwise see `StepRing.spilled`.
    Views of the ring's arrays: valid until the ring next changes. A named tuple: one is
    made per priority update, and it costs a third of a frozen dataclass."""

    loc: np.ndarray
    slot_ids: np.ndarray
    valid: np.ndarray
    next_id: int
    spills: bool  # some live ids are only in the spill table


class Priorities(NamedTuple):
    """What a priority update writes: raw priorities ``p``, the tree of masses
    ``(p + eps) ** alpha``, and (``marks`` not empty) ``marks[slot % period // group]``."""

    eps: float
    alpha: float
    p: np.ndarray
    tree: TreeArrays
    marks: np.ndarray
    period: int
    group: int


class Written(NamedTuple):
    """What a priority update reports: the slots it wrote (the first `count`, increasing),
    their values, and ``top[0]`` the largest value written (0.0 if none)."""

    slots: np.ndarray
    values: np.ndarray
    top: np.ndarray


# -- recording (`index.blocks.record_block`, `kernels.record_kernels`) -------------------------


class StepEvents(NamedTuple):
    """A block of events in order: event ``j`` of env ``env_of[j]``, an episode start
    (``auto[j]``) or a step with its flags and reward."""

    env_of: np.ndarray
    auto: np.ndarray
    term: np.ndarray
    trunc: np.ndarray
    reward: np.ndarray


class RecordColumns(NamedTuple):
    """The ring's columns `record_events` writes: the step records as flat ``(num_envs *
    slots,)`` views, the per-env cursors, the id map and ``counters = [next_id,
    next_episode]``."""

    slots: int
    pos: np.ndarray
    episode: np.ndarray
    ids: np.ndarray
    has_step: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    rewards: np.ndarray
    written: np.ndarray
    running: np.ndarray
    step_count: np.ndarray
    ord_of_frame: np.ndarray
    frame_of_ord: np.ndarray
    id_loc: np.ndarray
    counters: np.ndarray


class RecordOut(NamedTuple):
    """What `record_events` reports per event (``new_flat``, ``step_flat``: -1 for a start),
    per env (``touched``: lowered to the first frame touched) and per spilled id."""

    new_flat: np.ndarray
    step_flat: np.ndarray
    touched: np.ndarray
    spill_ids: np.ndarray
    spill_flat: np.ndarray
