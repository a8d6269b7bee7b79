"""Datasets in and out of stores: Dopamine checkpoints, Minari datasets, episode files.

Each format reads and writes through `ReplayStore`'s public API, staged in a temporary
store so a failed import leaves nothing half-written.

    dopamine    import Dopamine's ``$store$_*.gz`` replay checkpoints
    minari      import and export Minari datasets (needs ``pip install "mmreplay[minari]"``)
    episodes    whole episodes read from and written to a store
    staging     a temporary store renamed into place only when an import completes
"""
