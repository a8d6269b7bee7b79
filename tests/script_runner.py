"""Running a script of `scripts/` inside the test process, as ``python scripts/x.py`` would.

`run_here(name, *args)` executes the script as ``__main__`` (``runpy``) with `args` as its
command line and returns its exit status and what it printed. Its imports (torch, gymnasium,
matplotlib, stable-baselines3) and the compiled kernels are then paid once per test session
instead of once per run: use it where what a test checks is the script's behaviour, not the
process boundary (a kill, a signal, a fresh interpreter's imports, a shell's view of a
command line: those tests start a real process).

What a script changes in the process and a real run would leave behind with its process is
put back afterwards: ``sys.argv``, the SIGINT/SIGTERM handlers (`common.StopFlag` takes them),
the global RNGs of numpy and `random`, and torch's thread count and RNG where torch was
imported before the run (the test modules that run torch scripts import it first).
"""

from __future__ import annotations

import contextlib
import io
import random
import runpy
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@dataclass
class Outcome:
    """How a script run ended: its exit status and what it wrote to stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _process_state_kept():
    """Put back what a script run changes in the process (module docstring)."""
    argv, handlers = sys.argv[:], {s: signal.getsignal(s) for s in (signal.SIGINT,
                                                                  signal.SIGTERM)}
    py_rng, np_rng = random.getstate(), np.random.get_state()  # noqa: NPY002 (SB3 seeds it)
    torch = sys.modules.get("torch")  # not imported for a script that does not use it
    kept = (torch.get_num_threads(), torch.random.get_rng_state()) if torch else None
    try:
        yield
    finally:
        sys.argv[:] = argv
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        random.setstate(py_rng)
        np.random.set_state(np_rng)  # noqa: NPY002
        if torch is not None and kept is not None:
            torch.set_num_threads(kept[0])
            torch.random.set_rng_state(kept[1])


def run_here(name: str, *args: str, torch_threads: int | None = None) -> Outcome:
    """`scripts/<name> args...` run as ``__main__`` in this process (module docstring);
    `torch_threads` sets torch's thread count for the run, as ``OMP_NUM_THREADS`` would for
    a process."""
    path = SCRIPTS / name
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    if torch_threads is not None:
        import torch  # before the state is kept, so that its thread count is put back
    with _process_state_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        sys.argv[:] = [str(path), *args]
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message goes to stderr
        err.write(f"{code}\n")
        code = 1
    return Outcome(int(code), out.getvalue(), err.getvalue())
