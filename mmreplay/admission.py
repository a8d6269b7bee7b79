"""Inserts admitted without the rate limiter's lock: its gates.

A *gate* is a number of insert calls (`budget`), of at most `cap` steps each, that surely
fit below the limiter's upper edge; the limiter computes it under its lock from the
counters it has folded (`RateLimiter` in `rate_limit.py` owns the rule). An insert takes
a ticket instead of the lock::

    i = next(gate.tickets)         # itertools.count: atomic with the GIL
    if i < gate.budget:            # admitted: write the count (deque.append: atomic)
        gate.slots.append(n)
    else:                          # refused: void ticket i (a negative entry), take the lock
        gate.slots.append(~i)

Every ticket is written exactly once, so a fold that pops the written entries knows how many
admitted calls are still between their ticket and their write: at most `cap` steps each,
which the next gate and the locked path reserve.

`retire` closes a gate (new tickets are refused) and records its `end`, the tickets issued
before: the limiter retires the live gate whenever something may raise `diff` or change the
rules, and keeps folding retired gates until their last ticket is written. Samples only
lower `diff`, so they leave the live gate open. This module knows no band, only counts.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque

ENDLESS = sys.maxsize  # a budget or cap this large is never reached


class Gate:
    """`budget` calls of at most `cap` steps, each admitted by a ticket (see the module)."""

    __slots__ = ("budget", "cap", "done", "end", "slots", "tickets")

    def __init__(self, budget: int, cap: int) -> None:
        self.budget = self.end = budget  # end: tickets below it are written, then folded
        self.cap = cap
        self.tickets = itertools.count()
        self.slots: deque[int] = deque()  # steps of admitted calls; ~i: ticket i refused
        self.done = 0  # tickets below `end` folded (an admitted one is always below)

    def retire(self) -> None:
        """Refuse new tickets; `end` becomes the tickets issued before (under the lock).
        The budget goes first: a writer that read the old budget took its ticket before
        this one, so it lies below `end`."""
        self.budget = 0
        self.end = min(next(self.tickets), self.end)

    @property
    def unwritten(self) -> int:
        """Tickets below `end` not yet folded (of a retired gate: admitted or refused calls
        still between ticket and write, or written after the last fold)."""
        return self.end - self.done


class Gates:
    """The live gate and the retired ones still owed writes; the limiter calls it under its
    lock only (writers read `live` and use the gate itself)."""

    def __init__(self) -> None:
        self.live = Gate(0, 1)
        self.retired: list[Gate] = []

    def retire(self) -> None:
        """Retire the live gate (kept until its tickets are folded); a closed one takes
        its place until `open`."""
        self.live.retire()
        if self.live.unwritten:
            self.retired.append(self.live)
        self.live = Gate(0, 1)

    def open(self, budget: int, cap: int) -> None:
        """Open a gate of `budget` calls of at most `cap` steps (after `retire`: the
        budget reserves what the retired gates may still add). A live gate with a budget
        (one opened while an insert waited) is retired first: a gate without one owes
        nothing (its tickets were all refused)."""
        if self.live.budget:
            self.retire()
        self.live = Gate(budget, cap)

    def reserved_steps(self) -> int:
        """Steps that retired gates may still add: `cap` for each ticket not yet folded."""
        return sum(gate.unwritten * gate.cap for gate in self.retired)

    def take(self, inserts: int, min_size: int) -> tuple[int | None, int]:
        """Pop every written slot, oldest gate first: (`inserts` after the first count that
        brought it to `min_size` or past, None if none did; `inserts` plus every count).
        Diff grows with inserts: these are where the folded inserts made it lowest and
        highest past min size. Retired gates with nothing left to write are dropped."""
        first = None
        for gate in (*self.retired, self.live):
            slots, end, done = gate.slots, gate.end, 0
            for _ in range(len(slots)):  # writers go on appending behind these
                n = slots.popleft()
                if n >= 0:
                    done += 1
                    inserts += n
                    if first is None and inserts >= min_size:
                        first = inserts
                else:
                    done += ~n < end
            gate.done += done
        if self.retired:
            self.retired = [gate for gate in self.retired if gate.unwritten]
        return first, inserts

    def check_valid(self) -> None:
        """Internal invariants (tests call it through the limiter's)."""
        for gate in (*self.retired, self.live):
            assert 0 <= gate.done <= gate.end and gate.budget >= 0 and gate.cap >= 1
        assert all(gate.budget == 0 for gate in self.retired)

