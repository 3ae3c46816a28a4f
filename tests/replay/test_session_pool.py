"""--session-order pool: every lane takes the next session from one seeded shuffle."""

from __future__ import annotations

from pathlib import Path

from tests.replay.test_duration_bound import _long_pauses, _run


def test_pool_plays_every_session_once_in_a_seeded_order(tmp_path: Path) -> None:
    trace = _long_pauses(6, 1, 0.0)
    _, outcome, rows = _run(tmp_path / "a", trace, users=2, session_order="pool", seed=7)
    assert sorted(r["session_id"] for r in rows) == [f"s{i}" for i in range(6)]
    assert outcome.skipped == 0  # type: ignore[attr-defined]
    first = [r["session_id"] for r in sorted(rows, key=lambda r: r["sent_ns"])]
    _, _, again = _run(tmp_path / "b", trace, users=2, session_order="pool", seed=7)
    assert [r["session_id"] for r in sorted(again, key=lambda r: r["sent_ns"])] == first
    assert first != [f"s{i}" for i in range(6)]  # shuffled, not file order


def test_pinned_lanes_keep_their_own_sessions(tmp_path: Path) -> None:
    _, _, rows = _run(tmp_path, _long_pauses(6, 1, 0.0), users=2)
    lanes = {r["session_id"]: r["lane"] for r in rows}
    assert lanes == {f"s{i}": i % 2 for i in range(6)}
