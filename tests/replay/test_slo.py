"""--slo: goodput and the users and sessions that met it, on requests of known timing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from agentload.replay.errors import ReplayError
from agentload.replay.results.metrics import with_request_metrics
from agentload.replay.results.slo import parse_slo, slo_line, slo_summary
from tests.support import run_cli

MS = 1_000_000


def _requests() -> pl.DataFrame:
    """Two users (lanes), one session each. Lane 0: TTFT 100 ms, ITL 10 ms on all three
    requests. Lane 1: TTFT 100, 100 and 900 ms (its P90 breaks a 500 ms bound), ITL 30 ms,
    and one failed request."""
    rows = []
    for lane, ttfts, itl, ok in ((0, (100, 100, 100), 10, (True,) * 3),
                                 (1, (100, 100, 900, 100), 30, (True, True, True, False))):
        for i, (ttft, good) in enumerate(zip(ttfts, ok, strict=True)):
            sent = i * 1000 * MS
            rows.append({"phase": "measure", "ok": good, "lane": lane, "play": 0,
                         "session_id": f"s{lane}", "sent_ns": sent,
                         "first_token_ns": sent + ttft * MS if good else None,
                         "last_token_ns": sent + (ttft + 10 * itl) * MS if good else None,
                         "osl": 11 if good else None})
    return with_request_metrics(pl.DataFrame(rows))


def test_goodput_counts_the_requests_meeting_every_bound() -> None:
    s = slo_summary(_requests(), parse_slo("ttft=500ms,itl=20ms"), window_s=10.0)
    # Lane 0's three requests meet both bounds; lane 1's meet TTFT at most, never ITL.
    assert s["requests_meeting_share"] == pytest.approx(3 / 7)
    assert s["requests_meeting_ttft_share"] == pytest.approx(5 / 7)
    assert s["requests_meeting_itl_share"] == pytest.approx(3 / 7)
    assert s["goodput_req_s"] == pytest.approx(0.3)
    assert s["goodput_tok_s"] == pytest.approx(3.3)  # 3 x 11 tokens over 10 s


def test_users_and_sessions_are_judged_by_their_p90() -> None:
    s = slo_summary(_requests(), parse_slo("ttft=500ms"), window_s=10.0)
    # Lane 1's TTFT P90 (of 100, 100, 900 ms) is 740 ms, and it has a failure: it misses.
    assert s["users"] == {"count": 2, "share_meeting_ttft": 0.5, "share_meeting_all": 0.5}
    assert s["sessions"]["share_meeting_all"] == 0.5
    loose = slo_summary(_requests(), parse_slo("ttft=2s"), window_s=10.0)
    assert loose["users"]["share_meeting_all"] == 0.5  # the failure alone still counts
    assert slo_line(loose) == ("SLO (ttft <= 2 s): 85.7% of requests, goodput 0.6 req/s, "
                               "6.6 tok/s, users 50%, sessions 50% met it")


@pytest.mark.parametrize("text, message", [
    ("ttft=2", "with a unit"), ("speed=2s", "unknown bound 'speed'"),
    ("ttft=1s,ttft=2s", "names ttft twice")])
def test_bad_slo_text_is_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        parse_slo(text)
    assert parse_slo("e2e_norm=40ms, e2el=3s, itl=250us") == {
        "e2e_norm": pytest.approx(0.04), "e2el": 3.0, "itl": pytest.approx(0.00025)}


def test_report_judges_a_real_run_against_an_slo(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "gpu" / "run_moe_ngram_eager", run)
    done = run_cli("report", str(run), "--slo", "ttft=2s,itl=20ms")
    assert done.returncode == 0, done.stderr
    assert "SLO (ttft <= 2 s, itl <= 20 ms):" in done.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["slo"]["users"]["count"] == 16
    assert 0 < summary["goodput_req_s"] < summary["requests_completed"]
    bad = run_cli("report", str(run), "--slo", "ttft=fast")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0


def test_report_of_one_run_refuses_an_output_folder(tmp_path: Path) -> None:
    # One run is rebuilt in place; an -o that was silently ignored rewrote the run instead.
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parents[1] / "data" / "gpu" / "run_moe_ngram_eager", run)
    done = run_cli("report", str(run), "-o", str(tmp_path / "elsewhere"))
    assert done.returncode == 2 and "rebuilt in place" in done.stderr
    assert not (run / "report.html").exists() and not (tmp_path / "elsewhere").exists()


def test_the_dashboard_shows_who_met_the_slo_as_the_summary_does() -> None:
    """The live board, fed the requests of ``_requests``, says what the summary says."""
    from agentload.replay.journal import RequestRecord
    from agentload.replay.live import Header, LiveBoard

    slo = parse_slo("ttft=2s")
    board = LiveBoard(Header("arm", "t", 1, 2, 0, None, slo=tuple(slo.items())))
    plain = LiveBoard(Header("arm", "t", 1, 2, 0, None))
    for lane, ttfts, itl, ok in ((0, (100, 100, 100), 10, (True,) * 3),
                                 (1, (100, 100, 900, 100), 30, (True, True, True, False))):
        for i, (ttft, good) in enumerate(zip(ttfts, ok, strict=True)):
            sent = i * 1000 * MS
            first = sent + ttft * MS if good else None
            last = sent + (ttft + 10 * itl) * MS if good else None
            rec = RequestRecord(f"r{lane}-{i}", f"s{lane}", lane, "main", i, "measure", sent,
                                sent, first, last, last or sent + MS, 10, 11, 10,
                                11 if good else None, "server", None, 0, 11, good,
                                200 if good else 500, None if good else "boom",
                                error_kind=None if good else "http")
            board.finished(rec)
            plain.finished(rec)
    text = board.publish(10_000 * MS).totals.slo_text
    # The window runs from the first send to the last token: 0 to 3.2 s.
    assert text == ("SLO (ttft <= 2 s): 85.7% of requests, goodput 1.88 req/s, 20.6 tok/s, "
                    "users 50%, sessions 50% met it")
    assert plain.publish(10_000 * MS).totals.slo_text is None
