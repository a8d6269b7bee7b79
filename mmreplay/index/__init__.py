"""The in-RAM index: which slot holds which step, and what may be sampled.

No pixels, codecs or files: plain numpy arrays and index arithmetic.

    ring        per-env cursors, step columns, episode bounds, stack / n-step lookups
    sum_tree    a flat sum tree over slot priorities (float64, vectorised walks)
    samplers    uniform, proportional and rank distributions over slots (RNG passed in)
    sequences   fixed-length sequence windows over the ring and their priorities
"""
