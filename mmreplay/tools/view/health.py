"""The overview's health card: ``mmreplay verify`` run on demand, in the background, bounded.

One run at a time, in a daemon thread; the page starts it (``/api/health?run=1``) and
polls its state. A run checks what `tools.verify.verify_store` checks (read-only: every
checksum and invariant) and stops when it passes its time limit or the server closes,
between two frame chunks; it then says how far it got. The result is kept for the
generation it checked: asking again on that generation returns it without a new run.
Verify reads a store directory, so a store opened from a URL has no health check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mmreplay.errors import MmreplayError

DEFAULT_LIMIT_S = 120.0


class _Stopped(Exception):
    """Raised between two chunks to end a run (time limit or server closing)."""


class HealthCheck:
    """The state of the newest verify run of one store directory."""

    def __init__(self, path: Path | None, *, limit_s: float = DEFAULT_LIMIT_S,
                 generation: Callable[[], int | None]) -> None:
        self.path, self.limit_s, self._generation = path, limit_s, generation
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._state: dict[str, Any] = {"state": "never", "generation": None}
        self._thread: threading.Thread | None = None

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {**self._state, "limit_s": self.limit_s}

    def run(self) -> dict[str, Any]:
        """Start a run unless one is running or the newest result is for this generation."""
        if self.path is None:
            return {"state": "unavailable", "limit_s": self.limit_s, "generation": None,
                    "error": "verify reads a store directory; for a store in a bucket, "
                             "`mmreplay verify URL` pulls a copy and checks that"}
        with self._lock:
            current = self._generation()
            if self._state["state"] == "running" or (
                    self._state["state"] == "done" and self._state["generation"] == current):
                return {**self._state, "limit_s": self.limit_s}
            self._state = {"state": "running", "generation": current, "elapsed_s": 0.0,
                           "chunks_done": 0, "chunks_total": None, "report": None}
            self._thread = threading.Thread(target=self._work, name="mmreplay-view-verify",
                                            daemon=True)
            self._thread.start()
            return {**self._state, "limit_s": self.limit_s}

    def close(self) -> None:
        self._closing.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _work(self) -> None:
        from mmreplay.tools.verify import verify_store  # only when asked

        assert self.path is not None
        start = time.monotonic()
        try:
            report = verify_store(self.path, progress=self._progress(start))
            self._finish(start, "done", report=_report_json(asdict(report), report.ok))
        except _Stopped as exc:
            self._finish(start, "stopped", error=str(exc))
        except (MmreplayError, OSError, ValueError) as exc:
            self._finish(start, "failed", error=f"{type(exc).__name__}: {exc}")

    def _progress(self, start: float) -> Callable[[Iterable[Any], int], Iterator[Any]]:
        def progress(items: Iterable[Any], total: int) -> Iterator[Any]:
            with self._lock:
                self._state["chunks_total"] = total
            for done, item in enumerate(items):
                elapsed = time.monotonic() - start
                with self._lock:
                    self._state.update(chunks_done=done, elapsed_s=round(elapsed, 2))
                if self._closing.is_set():
                    raise _Stopped("the server is closing")
                if elapsed > self.limit_s:
                    raise _Stopped(f"stopped at the time limit ({self.limit_s:g} s) after "
                                   f"{done} of {total} frame chunks: the rest was not "
                                   f"checked (`mmreplay verify` checks it all)")
                yield item

        return progress

    def _finish(self, start: float, state: str, *, report: dict[str, Any] | None = None,
                error: str | None = None) -> None:
        with self._lock:
            self._state.update(state=state, report=report, error=error,
                               elapsed_s=round(time.monotonic() - start, 2))


def _report_json(report: dict[str, Any], ok: bool) -> dict[str, Any]:
    return {**report, "problems": list(report["problems"]), "ok": ok}
