"""AIPerf's system idle cap (``--idle-cap``): shorten dead air, never a pause beside work.

``--pause-cap`` caps every pause of the trace, wherever it falls. AIPerf caps a gap
only while the whole system is idle: when no request is in flight on any lane and the
next send of every lane is more than ``cap`` seconds after the moment the last request
finished (``idle_since``), every pending timer is pulled forward by the same amount,
so the earliest fires exactly at ``idle_since + cap`` and the others keep their
spacing. A lane waiting out a long pause while another lane's request streams is not
shortened: that pause overlaps real work.

``IdleCap`` holds the state (requests in flight, when the system went idle, the
pending timers) and does the arithmetic; every method that needs the time takes it,
so the rule is tested on virtual time. ``wait`` is the engine's sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shift:
    """One pull-forward: at ``idle_since_ns`` the system went idle; the earliest timer
    now fires at ``fire_ns`` (``idle_since_ns + cap``), every one ``shift_ns`` earlier."""

    idle_since_ns: int
    fire_ns: int
    shift_ns: int
    timers: int


class Timer:
    """A pending send: due at ``due_ns`` (moved earlier by shifts); ``moved`` wakes it."""

    __slots__ = ("due_ns", "moved")

    def __init__(self, due_ns: int) -> None:
        self.due_ns = due_ns
        self.moved = asyncio.Event()


class IdleCap:
    """The requests in flight across all lanes and the pending send timers.

    ``cap_s`` None turns the cap off (timers are still tracked, never moved). Times are
    ns on the caller's clock; ``on_shift`` hears of every pull-forward.
    """

    def __init__(self, cap_s: float | None, on_shift: Callable[[Shift], None] | None = None,
                 defer: Callable[[Callable[[], None]], None] | None = None) -> None:
        if cap_s is not None and cap_s < 0:
            raise ValueError(f"the idle cap must be >= 0 s, got {cap_s}")
        self.cap_ns = None if cap_s is None else round(cap_s * 1e9)
        self.on_shift = on_shift
        self.in_flight = 0
        self.idle_since_ns: int | None = 0
        self.timers: set[Timer] = set()
        self.shifts = 0
        self.shifted_ns = 0
        # AIPerf checks the cap after a return has dispatched what follows it
        # (``callback_handler._finish_return_processing``): the next request of the
        # finished one's chain is a timer by then. ``defer(check)`` runs the check once
        # such follow-ups have had their turn; None checks at once (virtual-time tests).
        self.defer = defer
        self._deferred = False

    def start(self, now_ns: int) -> None:
        """The run starts idle at ``now_ns``."""
        self.idle_since_ns = now_ns if self.in_flight == 0 else None

    def sending(self) -> None:
        self.in_flight += 1
        self.idle_since_ns = None

    def finished(self, now_ns: int) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle_since_ns = now_ns
            if self.defer is None:
                self.pull()
            elif not self._deferred:
                self._deferred = True
                self.defer(self._deferred_pull)

    def _deferred_pull(self) -> None:
        self._deferred = False
        self.pull()

    def add(self, due_ns: int) -> Timer:
        timer = Timer(due_ns)
        self.timers.add(timer)
        if not self._deferred:  # a return's follow-ups are still being added
            self.pull()
        return timer

    def remove(self, timer: Timer) -> None:
        self.timers.discard(timer)

    def pull(self) -> Shift | None:
        """Pull every timer forward if the system is idle past the cap (else None)."""
        if (self.cap_ns is None or self.in_flight or self.idle_since_ns is None
                or not self.timers):
            return None
        earliest = min(t.due_ns for t in self.timers)
        fire = self.idle_since_ns + self.cap_ns
        if earliest <= fire:
            return None
        shift = Shift(self.idle_since_ns, fire, earliest - fire, len(self.timers))
        for timer in self.timers:
            timer.due_ns -= shift.shift_ns
            timer.moved.set()
        self.shifts += 1
        self.shifted_ns += shift.shift_ns
        if self.on_shift is not None:
            self.on_shift(shift)
        return shift

    async def wait(self, due_ns: int, clock: Callable[[], int], closed: asyncio.Event) -> int:
        """Sleep until ``due_ns`` (or earlier, if pulled forward) or until ``closed``;
        return the due time it ended with (``due_ns`` less any shifts)."""
        timer = self.add(due_ns)
        try:
            while not closed.is_set():
                delay = (timer.due_ns - clock()) / 1e9
                if delay <= 0:
                    break
                timer.moved.clear()
                moved = asyncio.ensure_future(timer.moved.wait())
                ended = asyncio.ensure_future(closed.wait())
                try:
                    await asyncio.wait((moved, ended), timeout=delay,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in (moved, ended):
                        task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.gather(moved, ended, return_exceptions=True)
            return timer.due_ns
        finally:
            self.remove(timer)
