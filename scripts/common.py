"""The parts the scripts share, so each script keeps only what is its own.

    from common import prepare_run_dir, run_main   # `python scripts/x.py` puts scripts/ on sys.path

Arguments are not parsed here: each script declares an ``Args`` dataclass (a docstring under
each field) and calls ``tyro.cli(Args, description=__doc__)``, as cleanrl's scripts do.

- **Run directories**: `prepare_run_dir` refuses a directory that already holds a run unless
  ``--resume`` or ``--overwrite`` says what to do with it (``--overwrite`` removes it first).
- **Exit behaviour**: `run_main(main)` turns ordinary mistakes (`mmreplay.errors.MmreplayError`,
  `FileNotFoundError`, `UsageError`, ``SystemExit("message")``) into one line on stderr and
  exit status 2, no traceback. Ctrl-C runs the callbacks registered with `on_interrupt`
  (flush and close the store), prints where the run can be resumed and exits with 130;
  `StopFlag` lets a training loop finish its step first and do the same.
- **Environments and networks**: `is_atari`, `make_env` (ALE games with the usual DQN
  preprocessing, anything else as `gym.make` builds it), `QNetwork` (the Nature CNN for
  stacked 84x84 frames, a small MLP for vector observations), `nature_cnn`, `mlp`, and the
  agent's side of frame stacking (`push_frames`), `linear_schedule`, and the DQN `Learner`
  (networks, optimizer, one gradient step, checkpoint state).
- **Disk usage**: `dir_bytes` (file sizes) and `dir_blocks` (allocated blocks).

gymnasium and ale_py are imported by the functions that need them, and the networks and the
learner are defined in nets.py (loaded on first use through this module), so the bench
scripts and their workers, which make no env or network, import neither gymnasium nor torch.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

if TYPE_CHECKING:
    import gymnasium as gym

NETWORKS = ("nature_cnn", "mlp", "QNetwork", "Learner")  # defined in nets.py (imports torch)
INTERRUPTED = 130  # exit status of a run stopped by Ctrl-C (128 + SIGINT)
USAGE = 2  # exit status of an ordinary mistake (that of an argument error too)


class UsageError(ValueError):
    """An argument or a run directory the script cannot work with; shown as one line."""


# -- run directories ---------------------------------------------------------------------------


def holds_run(path: Path) -> bool:
    """Whether `path` exists and is not an empty directory."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def prepare_run_dir(run_dir: Path, *, resume: bool = False, overwrite: bool = False,
                    resumable: bool = True, remote: bool = False) -> Path:
    """Make `run_dir` ready: new (created), continued (``--resume``: must hold a run, unless
    `remote`: the run is in object storage) or replaced (``--overwrite``: removed first). A
    run dir that holds a run is refused unless one of the two flags says what to do with
    it; `resumable` scripts offer both."""
    if resume and overwrite:
        raise UsageError("pass --resume or --overwrite, not both")
    if resume:
        if not holds_run(run_dir):
            if not remote:
                raise UsageError(f"{run_dir} holds no run to resume; leave out --resume to "
                                 f"start one")
            run_dir.mkdir(parents=True, exist_ok=True)  # a new machine: the bucket holds it
        return run_dir
    if holds_run(run_dir):
        if not overwrite:
            choices = "--resume or --overwrite" if resumable else "--overwrite"
            raise UsageError(f"{run_dir} already holds a run: pass {choices}")
        if not run_dir.is_dir():
            raise UsageError(f"{run_dir} is a file, not a run directory; not deleting it")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# -- runs mirrored to object storage -------------------------------------------------------------


CHECKPOINT_FILES = ("checkpoint.pt", "checkpoint.pt.pending")


class RunBucket:
    """A run's copy in object storage (``--store s3://bucket/prefix``), laid out as the run
    directory is, so that a machine that never saw the run can resume it::

        PREFIX/store/                  the store, mirrored by the store as it commits
        PREFIX/checkpoint.pt(.pending) the checkpoint files, uploaded as they are written
        PREFIX/summary.json            at the end of a run

    Credentials and endpoint come from the AWS environment variables
    (docs/object-storage.md); a ``file:///dir`` URL works too.
    """

    def __init__(self, url: str) -> None:
        from mmreplay.storage.objects import is_url, open_objects

        if not is_url(url):
            raise UsageError(f"--store takes s3://bucket/prefix or file:///dir, got {url!r}")
        self.url = url.rstrip("/")
        self.store_url = f"{self.url}/store"
        self.objects = open_objects(self.url)

    def holds_run(self) -> bool:
        """Whether the prefix holds a store (a run was mirrored there)."""
        return self.objects.head("store/manifest.json") is not None

    def upload(self, run_dir: Path, name: str) -> None:
        """Put the run directory's file `name` into the prefix (whole, atomic for readers)."""
        self.objects.put(name, (run_dir / name).read_bytes())

    def download_checkpoints(self, run_dir: Path) -> None:
        """The checkpoint files the prefix holds, into `run_dir` (for a first resume here)."""
        from mmreplay.storage.objects import ObjectMissingError

        for name in CHECKPOINT_FILES:
            try:
                data = self.objects.get(name)
            except ObjectMissingError:
                continue
            (run_dir / name).write_bytes(data)

    def pull_store(self, run_dir: Path, *, take_over: bool = False) -> None:
        """The store's newest complete generation into ``run_dir/store`` unless it holds
        the store already (refused if the bucket holds a newer generation than it, or while
        another writer holds the prefix, unless `take_over`)."""
        from mmreplay.storage.objects import open_objects
        from mmreplay.storage.pull import working_copy

        working_copy(open_objects(self.store_url), run_dir / "store", take_over=take_over)


@dataclass
class StoreArgs:
    """The flags of a run mirrored to object storage (both DQN scripts take them)."""

    store: str = ""
    """mirror the run to this URL (s3://bucket/prefix: the store at PREFIX/store, the
    checkpoints beside it); with `--resume` on a machine that never saw the run, the run
    directory starts empty and the run comes down from there"""
    take_over: bool = False
    """with `--store`: take the prefix's writer lease even if another writer seems to hold
    it (the machine that held it is gone: a preempted run)"""


def prepare_run(run_dir: Path, *, resume: bool, overwrite: bool,
                store: str) -> tuple[Path, RunBucket | None]:
    """`prepare_run_dir`, and the `RunBucket` of ``--store`` (None without): a new run needs
    a prefix that holds no run; ``--resume`` in an empty run directory (a new machine)
    brings the checkpoint files down (the store comes down as it opens)."""
    if not store:
        return prepare_run_dir(run_dir, resume=resume, overwrite=overwrite), None
    bucket = RunBucket(store)
    if resume and not bucket.holds_run() and not holds_run(run_dir):
        raise UsageError(f"neither {run_dir} nor {bucket.url} holds a run to resume")
    if not resume and bucket.holds_run():
        raise UsageError(f"{bucket.url} already holds a run: pass --resume to continue it, "
                         f"or mirror this run to another prefix")
    run_dir = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite, remote=True)
    if resume and not any(run_dir.glob("checkpoint.pt*")):
        bucket.download_checkpoints(run_dir)
    return run_dir, bucket


def resume_command(run_dir: Path, *, script: str | None = None, store: str = "") -> str:
    """The command line that continues the run in `run_dir` (mirrored to `store`)."""
    if script is None:
        script = os.path.relpath(sys.argv[0]) if sys.argv[0] else "<script>"
    mirrored = f" --store {shlex.quote(store)}" if store else ""
    return (f"python {shlex.quote(script)} --resume --run-dir "
            f"{shlex.quote(str(run_dir))}{mirrored}")


# -- exit behaviour ----------------------------------------------------------------------------


_on_interrupt: list[tuple[Callable[[], object], str | None]] = []


def on_interrupt(cleanup: Callable[[], object], *, message: str | None = None) -> None:
    """On Ctrl-C, `run_main` calls `cleanup()` (newest first), then prints `message`
    (for example where to resume)."""
    _on_interrupt.append((cleanup, message))


def _interrupted() -> int:
    while _on_interrupt:
        cleanup, message = _on_interrupt.pop()
        try:
            cleanup()
        except Exception as exc:  # report it and go on with the others
            print(f"interrupted; cleaning up failed: {exc}", file=sys.stderr)
        if message:
            print(message, file=sys.stderr)
    print("interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def run_main(main: Callable[[], object]) -> NoReturn:
    """Run `main` and exit with the status it returns (an int; anything else means 0).
    Ordinary mistakes are one line on stderr and status 2; Ctrl-C cleans up
    (`on_interrupt`) and exits with 130."""
    from mmreplay.errors import MmreplayError

    prog = Path(sys.argv[0]).name or "script"
    try:
        result = main()
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except KeyboardInterrupt:
        code = _interrupted()
    except (MmreplayError, FileNotFoundError, UsageError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        code = USAGE
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(f"{prog}: error: {exc.code}", file=sys.stderr)
        code = USAGE
    sys.stdout.flush()
    sys.exit(code)


class StopFlag:
    """SIGINT and SIGTERM set a flag that a training loop reads between steps (an interrupt
    inside `store.add` would leave a half-recorded step); a second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        signal.signal(signal.SIGINT, self._request)
        signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __bool__(self) -> bool:
        return bool(self.signals)

    def exit_status(self, resume: str | None = None) -> int:
        """128 + the signal's number after one (130 for Ctrl-C, 143 for SIGTERM), printing
        `resume`, the way to continue; else 0."""
        if not self.signals:
            return 0
        print(f"interrupted; to continue: {resume}" if resume else "interrupted",
              file=sys.stderr, flush=True)
        return 128 + self.signals[0]


# -- environments and networks -----------------------------------------------------------------


def is_atari(env_id: str) -> bool:
    """Whether `env_id` is an ALE game (its entry point lives in ale_py)."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    try:
        return "ale_py" in str(gym.spec(env_id).entry_point)
    except gym.error.Error as exc:
        raise UsageError(f"unknown environment id {env_id!r} ({exc})") from None


def make_env(env_id: str, *, terminal_on_life_loss: bool = False, **ale_kwargs: Any) -> gym.Env:
    """`env_id` as the scripts train on it: an ALE game with DQN preprocessing (84x84
    grayscale, frame skip 4 with max-pooling, up to 30 no-op starts, no env-side frame
    stacking: the store stacks), anything else as `gym.make` builds it. `ale_kwargs` go to
    the ALE env (``obs_type="grayscale"`` spares it an RGB copy per skipped frame)."""
    import gymnasium as gym

    if not is_atari(env_id):
        return gym.make(env_id)
    from gymnasium.wrappers import AtariPreprocessing

    env = gym.make(env_id, frameskip=1, **ale_kwargs)
    return AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                              terminal_on_life_loss=terminal_on_life_loss, grayscale_obs=True)


def linear_schedule(start: float, end: float, duration: float, t: int) -> float:
    """`start` moving linearly to `end` over `duration` steps, then `end`."""
    slope = (end - start) / max(duration, 1.0)
    return max(slope * t + start, end) if end < start else min(slope * t + start, end)


def crossed(before: int, now: int, every: int) -> int:
    """How many multiples of `every` lie in (before, now]."""
    return now // every - before // every


def push_frames(stack: np.ndarray, frames: np.ndarray, fresh: np.ndarray) -> None:
    """Shift each env's last-k frames left and append its new frame; `fresh` envs restart
    from zeros, the way the store pads stacks at an episode's start (stack_padding="zero")."""
    stack[fresh] = 0
    stack[:, :-1] = stack[:, 1:]
    stack[:, -1] = frames


# -- disk usage --------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    """Sum of the sizes of the files under `path` (symlinks not followed)."""
    total = 0
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            total += dir_bytes(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def dir_blocks(path: Path) -> int:
    """Bytes the filesystem allocated under `path`: blocks of its files and folders."""
    return sum(p.lstat().st_blocks * 512 for p in Path(path).rglob("*"))


def __getattr__(name: str) -> Any:
    """`NETWORKS` come from nets.py on first use, so a script that makes no network (the
    benches, their workers, a command line refused at argument parsing) never imports torch."""
    if name in NETWORKS:
        import nets

        return getattr(nets, name)
    raise AttributeError(f"module 'common' has no attribute {name!r}")
