"""``--duration``, ``--max-requests`` and stop are wall-clock bounds: sleeping lanes wake.

Real WEKA sessions pause for up to an hour between turns; a lane used to sleep out such
a pause before it looked at the deadline, so a 150 s run went on for 855 s with nothing
in flight. Against a local fake server that answers at once, a trace whose pauses are
far longer than the run must end within the duration plus the time to finish what is
in flight.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from agentload.replay.engine.core import ReplayEngine, ReplayOptions, Target, build_http_client
from agentload.replay.journal import Journal, read_journal
from agentload.replay.serve.server import free_port
from agentload.traces import Block, Request, Session, Trace
from tests.support import sse_completion


def _app() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await sse_completion(request, len(body["prompt"]), body["max_tokens"])

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _long_pauses(sessions: int, turns: int, pause_s: float) -> Trace:
    out = []
    for s in range(sessions):
        reqs = tuple(Request(f"s{s}/{t}", f"s{s}", (Block(100 * s + t + 1, 8),), 2,
                             pause_s=0.0 if t == 0 else pause_s)
                     for t in range(turns))
        out.append(Session(f"s{s}", reqs))
    return Trace("long-pauses", tuple(out), block_size=8)


def _run(tmp_path: Path, trace: Trace, **options: object) -> tuple[float, object, list]:
    async def main() -> tuple[float, object]:
        runner = web.AppRunner(_app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        opts = ReplayOptions(**options)  # type: ignore[arg-type]
        try:
            tmp_path.mkdir(parents=True, exist_ok=True)
            with Journal(tmp_path / "j.jsonl") as journal:
                engine = ReplayEngine(trace, Target(f"http://127.0.0.1:{port}", "m"), opts,
                                      journal, build_http_client(opts))
                started = time.monotonic()
                async with engine.client:
                    outcome = await engine.run()
                return time.monotonic() - started, outcome
        finally:
            await runner.cleanup()

    took, outcome = asyncio.run(main())
    _, rows = read_journal(tmp_path / "j.jsonl")
    return took, outcome, rows


def test_duration_ends_a_run_whose_pauses_outlast_it(tmp_path: Path) -> None:
    # Every session's second turn waits an hour: only the first turns fit in 1.5 s.
    took, outcome, rows = _run(tmp_path, _long_pauses(3, 4, 3600.0), users=3, duration_s=1.5)
    assert took < 1.5 + 1.0, took  # not 3600 s: the lanes woke at the deadline
    assert outcome.stop_reason == "duration reached"  # type: ignore[attr-defined]
    assert sorted(r["request_id"] for r in rows) == ["s0/0", "s1/0", "s2/0"]
    assert outcome.skipped == 9  # type: ignore[attr-defined]


def test_recycled_lanes_wake_at_the_deadline_too(tmp_path: Path) -> None:
    took, outcome, _ = _run(tmp_path, _long_pauses(2, 6, 3600.0), users=2, duration_s=1.5,
                            recycle=True, start_range=(0.0, 0.0), warmup_turns=0)
    assert took < 1.5 + 1.0, took
    assert outcome.stop_reason == "duration reached"  # type: ignore[attr-defined]


def test_max_requests_wakes_lanes_waiting_to_send(tmp_path: Path) -> None:
    took, outcome, rows = _run(tmp_path, _long_pauses(3, 4, 3600.0), users=3, max_requests=3)
    assert took < 2.0, took
    assert len(rows) == 3
    assert outcome.stop_reason == "max requests reached"  # type: ignore[attr-defined]


def test_headless_progress_says_when_the_run_turns_invalid() -> None:
    from agentload.replay.engine.core import ProgressSnapshot
    from agentload.replay.run import progress_line

    base = dict(elapsed_s=3.0, requests_total=10, requests_done=4, requests_failed=2,
                requests_skipped=0, in_flight=1, users_active=1, users=1,
                p90_interactivity_tok_s=None, ttft_p90_s=None, eta_s=1.0, finished=False)
    assert "INVALID" not in progress_line(ProgressSnapshot(**base))  # type: ignore[arg-type]
    line = progress_line(ProgressSnapshot(**base, invalid_reasons=(  # type: ignore[arg-type]
        "error rate 33.3% > 10%",)))
    assert line.endswith("| INVALID: error rate 33.3% > 10%")
    assert "requests 4/10 done" in line
    # A recycling run bounded by time has no total: "?", not "/0".
    bounded = progress_line(ProgressSnapshot(**{**base, "requests_total": 0}))  # type: ignore[arg-type]
    assert "requests 4/? done" in bounded
