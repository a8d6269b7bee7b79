"""The dataset verbs of the ``mmreplay`` command: thin wrappers over the importers.

    mmreplay import-dopamine DIR STORE [--checkpoints 0-3]
    mmreplay export-minari STORE DATASET_ID [--env-id ID]
    mmreplay import-minari DATASET_ID STORE

Optional dependencies (minari) are imported inside the verb that needs them, so the
command itself never pays for them; a missing one is a one-line error naming the extra.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from typing import Any

from mmreplay.errors import MmreplayError


def add_dataset_commands(sub: Any, *, positive_int: Callable[[str], int]) -> None:
    _add_import_dopamine(sub, positive_int)
    _add_export_minari(sub, positive_int)
    _add_import_minari(sub, positive_int)


def _store_options(cmd: argparse.ArgumentParser, positive_int: Callable[[str], int],
                   default_stack: int | None) -> None:
    """The new store's stacking and return options, shared by the import verbs."""
    cmd.add_argument("--frame-stack", type=positive_int, default=default_stack,
                     help=f"frames per state (default: {default_stack or 'from the dataset'})")
    cmd.add_argument("--n-step", type=positive_int, default=None, help="n-step returns")
    cmd.add_argument("--gamma", type=float, default=None, help="discount (default 0.99)")
    cmd.add_argument("--capacity", type=positive_int, default=None,
                     help="frames to keep (default: every frame imported)")
    cmd.add_argument("--codec", choices=("lz4", "lz4hc", "zstd"), default="lz4",
                     help="frame chunk codec (lz4hc: ~20%% smaller chunks that decode faster, "
                          "encoded ~5x slower; zstd: about half the disk, slower sampling)")


# -- import-dopamine ----------------------------------------------------------------------
def _add_import_dopamine(sub: Any, positive_int: Callable[[str], int]) -> None:
    text = "import Dopamine replay checkpoints (DQN Replay Dataset) into a new store"
    cmd = sub.add_parser("import-dopamine", help=text, description=text)
    cmd.add_argument("directory", metavar="DIR", help="directory of *_ckpt.N.gz files")
    cmd.add_argument("store", metavar="STORE", help="new store directory (must not exist)")
    cmd.add_argument("--checkpoints", type=parse_checkpoints, default=None, metavar="LIST",
                     help="e.g. 0-3, 7 or 1,3,5-6 (default: every checkpoint in DIR)")
    _store_options(cmd, positive_int, default_stack=4)
    cmd.set_defaults(run=cmd_import_dopamine)


def cmd_import_dopamine(args: argparse.Namespace) -> int:
    from mmreplay.datasets import dopamine

    done = dopamine.import_dopamine(
        args.directory, args.store, checkpoints=args.checkpoints, frame_stack=args.frame_stack,
        n_step=args.n_step or 1, gamma=0.99 if args.gamma is None else args.gamma,
        capacity=args.capacity, codec=args.codec)
    print(f"imported checkpoints {_ranges(done.checkpoints)} into {args.store}: "
          f"{done.records} records -> {done.frames} frames, {done.transitions} transitions, "
          f"{done.episodes} episodes ({done.terminated} terminated, {done.truncated} "
          f"truncated); dropped {done.padding_records} padding records and "
          f"{done.dropped_records} without a next frame")
    return 0


def parse_checkpoints(text: str) -> list[int]:
    """``"0-3"``, ``"7"`` or ``"1,3,5-6"`` as a list of checkpoint numbers (kept in order)."""
    numbers: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise argparse.ArgumentTypeError(
                f"checkpoints must look like 0-3, 7 or 1,3,5-6; got {text!r}")
        first = int(m.group(1))
        numbers += range(first, int(m.group(2) or first) + 1)
    if len(set(numbers)) != len(numbers):
        raise argparse.ArgumentTypeError(f"checkpoints {text!r} name a checkpoint twice")
    return numbers


def _ranges(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    groups: list[list[int]] = []
    for n in numbers:
        if groups and groups[-1][1] == n - 1:
            groups[-1][1] = n
        else:
            groups.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)


# -- Minari -------------------------------------------------------------------------------
def _minari() -> Any:
    try:
        from mmreplay.datasets import minari
    except ImportError as exc:
        raise MmreplayError(str(exc).splitlines()[0]) from None
    return minari


def _add_export_minari(sub: Any, positive_int: Callable[[str], int]) -> None:
    text = "export a store's finished episodes to a new local Minari dataset"
    cmd = sub.add_parser("export-minari", help=text, description=text)
    cmd.add_argument("store", metavar="STORE", help="store directory (opened read-only)")
    cmd.add_argument("dataset_id", metavar="DATASET_ID", help="e.g. breakout/random-v0")
    cmd.add_argument("--env-id", default=None, help="env id recorded in the metadata")
    cmd.add_argument("--num-actions", type=positive_int, default=None,
                     help="size of a Discrete action space (default: largest action + 1)")
    cmd.add_argument("--description", default=None)
    cmd.set_defaults(run=cmd_export_minari)


def cmd_export_minari(args: argparse.Namespace) -> int:
    minari = _minari()
    from mmreplay.tools.inspection import open_readonly

    with open_readonly(args.store) as store:
        done = minari.export_minari(store, args.dataset_id, env_id=args.env_id,
                                    num_actions=args.num_actions, description=args.description)
    print(f"exported {done.episodes} episodes ({done.steps} steps) to Minari dataset "
          f"{done.dataset_id} at {done.path} ({done.bytes_on_disk / 2**20:.1f} MiB)")
    return 0


def _add_import_minari(sub: Any, positive_int: Callable[[str], int]) -> None:
    text = "import a local Minari dataset into a new store"
    cmd = sub.add_parser("import-minari", help=text, description=text)
    cmd.add_argument("dataset_id", metavar="DATASET_ID")
    cmd.add_argument("store", metavar="STORE", help="new store directory (must not exist)")
    _store_options(cmd, positive_int, default_stack=None)
    cmd.set_defaults(run=cmd_import_minari)


def cmd_import_minari(args: argparse.Namespace) -> int:
    minari = _minari()
    done = minari.import_minari(args.dataset_id, args.store, frame_stack=args.frame_stack,
                                n_step=args.n_step, gamma=args.gamma, capacity=args.capacity,
                                codec=args.codec)
    print(f"imported {done.episodes} episodes ({done.steps} steps, {done.frames} frames) "
          f"from Minari dataset {done.dataset_id} into {args.store}")
    return 0
