"""The live board's own helpers (``replay/live/_board.py``), tested where they live."""

from __future__ import annotations

from agentload.replay.live._board import _Intervals


def test_intervals_union() -> None:
    iv = _Intervals()
    for a, b in [(0, 10), (5, 15), (20, 30), (12, 22), (40, 41), (-5, -1)]:
        iv.add(a, b)
    assert iv.total == (30 - 0) + 1 + 4
    assert iv.starts == [-5, 0, 40] and iv.ends == [-1, 30, 41]
