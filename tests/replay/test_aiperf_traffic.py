"""The switches that make a replay send AIPerf's traffic (issue 24, item 3).

``--pauses end-to-start`` recomputes every pause from the recording, ``--idle-cap``
pulls pending sends forward only while nothing is in flight, ``--cache-bust
after-shared-prefix`` puts each play's marker after the system/tool prefix, ``--grace``
cuts what is still in flight after ``--duration``, and ``--aiperf-compatible`` turns
them all on. Arithmetic is checked on numbers and virtual time; the engine against a
local fake server, asserting on what the engine decided and recorded (intended send
times, prompts, phases), not on how fast the host is.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from agentload.replay.cli import AIPERF, Traffic, with_aiperf, with_preset
from agentload.replay.engine.core import (
    EngineOutcome,
    ReplayEngine,
    ReplayOptions,
    Target,
    build_http_client,
)
from agentload.replay.engine.fit import FitOptions, end_to_start_pause, fit_trace
from agentload.replay.engine.pacing import IdleCap
from agentload.replay.engine.plan import (
    declared_prefix_blocks,
    marker_block,
    marker_positions,
    plan_play,
    shared_block_ids,
)
from agentload.replay.journal import JOURNAL_NAME, Journal, read_journal
from agentload.replay.results.finalize import write_results
from agentload.replay.serve.server import free_port
from agentload.traces import Block, Request, Session, Trace
from agentload.traces.formats import load_any
from agentload.traces.model import RecordedTiming
from tests.support import DATA, run_cli, sse_completion

# The fake server: max_tokens picks how long a request takes before it streams.
SLOW, STUCK = 7, 9
SLOW_S, STUCK_S = 1.5, 20.0


def _app(prompts: list[list[int]]) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompts.append(body["prompt"])
        n = body["max_tokens"]
        wait = SLOW_S if n == SLOW else STUCK_S if n == STUCK else 0.0
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while loop.time() < until:  # stop early once the client has hung up
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)
            await asyncio.sleep(0.02)
        return await sse_completion(request, len(body["prompt"]), n)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def _replay(run_dir: Path, trace: Trace, **options: Any
            ) -> tuple[EngineOutcome, list[dict[str, Any]], list[dict[str, Any]], list[list[int]]]:
    """Replay ``trace`` against the fake server: (outcome, events, requests, prompts)."""
    prompts: list[list[int]] = []

    async def main() -> EngineOutcome:
        runner = web.AppRunner(_app(prompts))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        opts = ReplayOptions(**options)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with Journal(run_dir / JOURNAL_NAME) as journal:
                engine = ReplayEngine(trace, Target(f"http://127.0.0.1:{port}", "m"), opts,
                                      journal, build_http_client(opts))
                async with engine.client:
                    return await engine.run()
        finally:
            await runner.cleanup()

    outcome = asyncio.run(main())
    meta, rows = read_journal(run_dir / JOURNAL_NAME)
    return outcome, [m for m in meta if m.get("type") == "event"], rows, prompts


def _req(rid: str, sid: str, blocks: tuple[Block, ...], out: int = 2, deps: tuple[str, ...] = (),
         pause: float = 0.0, t: float | None = None, api: float | None = None,
         agent: str = "main") -> Request:
    recorded = RecordedTiming(t=t, api_time=api) if t is not None else None
    return Request(rid, sid, blocks, out, depends_on=deps, pause_s=pause, recorded=recorded,
                   agent_id=agent, agent_kind="main" if agent == "main" else "subagent")


# --pauses end-to-start ---------------------------------------------------------------


def _recorded_chain() -> Session:
    b = (Block(1, 8),)
    return Session("s", (
        _req("s/0", "s", b, t=0.0, api=2.0, pause=0.0),
        _req("s/1", "s", b, deps=("s/0",), t=5.0, api=1.0, pause=99.0),  # think_time 99
        _req("s/2", "s", b, deps=("s/1",), t=6.0, api=None, pause=0.0),
        _req("s/3", "s", b, deps=("s/2",), t=10.0, api=3.0, pause=0.0),
        _req("s/4", "s", b, deps=("s/3",), t=11.0, api=1.0, pause=0.0),  # overlaps s/3
        _req("s/5", "s", b, deps=("s/4",), pause=7.0),  # nothing recorded: kept
        _req("s/6", "s", b, deps=("s/1", "s/3"), t=20.0, api=0.5),  # a join: latest end
    ))


def test_end_to_start_pauses_are_the_recorded_gaps_after_each_end() -> None:
    trace = Trace("rec", (_recorded_chain(),), block_size=8)
    fitted, report = fit_trace(trace, FitOptions(pause_rule="end-to-start"))
    pauses = [r.pause_s for r in fitted.sessions[0].requests]
    # max(0, t_k - t_{k-1} - api_{k-1}); a missing api_time counts as 0; a root goes at once.
    assert pauses == [0.0, 3.0, 0.0, 4.0, 0.0, 7.0, 7.0]
    assert (report.pause_rule, report.pauses_from_recording,
            report.pauses_without_recording) == ("end-to-start", 6, 1)
    # The default keeps the importer's pauses (think_time included) untouched.
    kept, default = fit_trace(trace, FitOptions())
    assert [r.pause_s for r in kept.sessions[0].requests] == [0.0, 99.0, 0.0, 0.0, 0.0, 7.0,
                                                             0.0]
    assert default.pause_rule == "trace" and default.pauses_from_recording == 0
    # --pause-cap applies to whatever the rule gave.
    capped, rep = fit_trace(trace, FitOptions(pause_rule="end-to-start", pause_cap_s=3.5))
    assert [r.pause_s for r in capped.sessions[0].requests] == [0.0, 3.0, 0.0, 3.5, 0.0, 3.5,
                                                               3.5]
    assert rep.pauses_capped == 3


def test_weka_keeps_api_time_and_end_to_start_ignores_think_time(tmp_path: Path) -> None:
    (tmp_path / "w.json").write_text(json.dumps({"id": "w", "block_size": 64, "requests": [
        {"type": "s", "t": 0, "api_time": 2.5, "in": 64, "out": 4, "hash_ids": [1]},
        {"type": "s", "t": 10, "api_time": 1, "think_time": 1.5, "in": 128, "out": 4,
         "hash_ids": [1, 2]},
        {"type": "s", "t": 12, "in": 192, "out": 4, "hash_ids": [1, 2, 3]},
        {"type": "s", "t": 20, "in": 256, "out": 4, "hash_ids": [1, 2, 3, 4]}]}))
    trace = load_any(tmp_path / "w.json", "weka").trace
    reqs = trace.sessions[0].requests
    assert [r.recorded.api_time for r in reqs if r.recorded] == [2.5, 1.0, None, None]
    assert reqs[1].pause_s == 1.5  # the importer's pause: think_time
    by_id = {r.id: r for r in reqs}
    assert [end_to_start_pause(r, by_id) for r in reqs] == [0.0, 7.5, 1.0, 8.0]


def test_the_engine_waits_the_end_to_start_pause_after_the_previous_end(
        tmp_path: Path) -> None:
    b = (Block(1, 8),)
    session = Session("s", (_req("s/0", "s", b, t=0.0, api=1.0, pause=5.0),
                            _req("s/1", "s", b, deps=("s/0",), t=31.0, api=1.0, pause=0.0)))
    fitted, _ = fit_trace(Trace("e2s", (session,), block_size=8),
                          FitOptions(pause_rule="end-to-start"))
    _, _, rows, _ = _replay(tmp_path, fitted, users=1, time_scale=0.01)
    second = next(r for r in rows if r["request_id"] == "s/1")
    # Sent (31 - 0 - 1) * 0.01 = 0.3 s after the first request ended.
    assert second["intended_ns"] - second["ready_ns"] == 300_000_000
    first = next(r for r in rows if r["request_id"] == "s/0")
    assert first["ready_ns"] is None and second["ready_ns"] >= first["done_ns"]


# --idle-cap ---------------------------------------------------------------------------

S = 1_000_000_000


def test_idle_cap_pulls_every_timer_forward_only_once_nothing_is_in_flight() -> None:
    cap = IdleCap(10.0)
    cap.start(0)
    cap.sending()  # lane A's request streams
    b1, b2 = cap.add(100 * S), cap.add(130 * S)  # lane B and C wait out long pauses
    assert (b1.due_ns, b2.due_ns) == (100 * S, 130 * S)  # beside work: never shortened
    assert cap.pull() is None
    cap.finished(40 * S)  # the last request ends: idle from 40 s
    # The earliest fires at idle + cap; the other keeps its 30 s spacing.
    assert (b1.due_ns, b2.due_ns) == (50 * S, 80 * S)
    assert (cap.shifts, cap.shifted_ns) == (1, 50 * S)
    assert b1.moved.is_set() and b2.moved.is_set()
    # Already within the cap: nothing more moves.
    assert cap.pull() is None and b1.due_ns == 50 * S


def test_idle_cap_counts_from_when_the_system_went_idle() -> None:
    cap = IdleCap(10.0)
    cap.start(0)
    cap.sending()
    cap.finished(5 * S)
    cap.add(8 * S)  # due within the cap of the idle start: left alone
    late = cap.add(60 * S)
    assert late.due_ns == 60 * S and cap.shifts == 0
    cap.remove(next(t for t in cap.timers if t is not late))
    cap.pull()  # only the late timer is pending: it fires 10 s after the idle start
    assert late.due_ns == 15 * S
    cap.sending()
    later = cap.add(500 * S)
    assert later.due_ns == 500 * S  # a request is in flight again
    assert IdleCap(None).add(500 * S).due_ns == 500 * S  # no cap, no pull


def test_the_engine_caps_only_system_idle_gaps(tmp_path: Path) -> None:
    # Lane 0: a slow first request (1.5 s), then a 30 s pause. Lane 1: a 0.3 s pause while
    # lane 0's request streams. Only lane 0's pause, after everything ended, is pulled.
    a = (Block(1, 8),)
    b = (Block(2, 8),)
    trace = Trace("idle", (
        Session("a", (_req("a/0", "a", a, out=SLOW), _req("a/1", "a", a, deps=("a/0",),
                                                           pause=30.0))),
        Session("b", (_req("b/0", "b", b), _req("b/1", "b", b, deps=("b/0",), pause=0.3))),
    ), block_size=8)
    outcome, events, rows, _ = _replay(tmp_path, trace, users=2, idle_cap_s=0.2)
    by_id = {r["request_id"]: r for r in rows}
    assert by_id["b/1"]["intended_ns"] - by_id["b/1"]["ready_ns"] == 300_000_000
    assert by_id["b/1"]["sent_ns"] < by_id["a/0"]["done_ns"]  # it went beside a/0
    shifts = [e for e in events if e["kind"] == "idle_cap"]
    assert len(shifts) == 1 and outcome.idle_cap_shifts == 1
    shift = shifts[0]
    assert shift["idle_since_ns"] >= by_id["a/0"]["done_ns"] - 50_000_000
    assert shift["fire_ns"] == shift["idle_since_ns"] + 200_000_000
    assert by_id["a/1"]["intended_ns"] == shift["fire_ns"]
    # The shift removed the pause's dead air beyond the cap, nothing else.
    pause_left = by_id["a/1"]["intended_ns"] - by_id["a/1"]["ready_ns"]
    assert shift["shift_ns"] == 30_000_000_000 - pause_left
    assert outcome.completed == 4


# --cache-bust after-shared-prefix -----------------------------------------------------


def _shared_prefix_trace() -> Trace:
    sys_blocks = (Block(1, 8), Block(2, 8))  # the system/tool prefix every session sends
    sessions = []
    for s in range(2):
        own = (Block(10 + 10 * s, 8),)
        more = (*own, Block(11 + 10 * s, 8))
        sessions.append(Session(f"s{s}", (
            _req(f"s{s}/0", f"s{s}", (*sys_blocks, *own)),
            _req(f"s{s}/1", f"s{s}", (*sys_blocks, *more), deps=(f"s{s}/0",)))))
    return Trace("shared", tuple(sessions), block_size=8)


def test_the_marker_lands_after_the_shared_prefix() -> None:
    trace = _shared_prefix_trace()
    shared = shared_block_ids(trace)
    assert shared == {1, 2}
    session = trace.sessions[0]
    at = marker_positions(session, shared)
    assert at == {"s0/0": 2, "s0/1": 2}
    marker = marker_block(0, 0, 16)
    play = plan_play(session, 0, 0, marker=marker, marker_at=at)
    assert [[b.id for b in p.request.blocks] for p in play.requests] == [
        [1, 2, marker.id, 10], [1, 2, marker.id, 10, 11]]
    # A subagent whose first prompt does not start with the prefix gets none.
    sub = Session("x", (_req("x/0", "x", (Block(1, 8), Block(2, 8))),
                        _req("x/1", "x", (Block(5, 8), Block(1, 8)), agent="sa")))
    assert marker_positions(sub, shared) == {"x/0": 2, "x/1": 0}


def test_a_declared_weka_prefix_places_the_marker_as_aiperf_does() -> None:
    raw = json.loads((DATA / "weka" / "trace_0107.json").read_text())
    trace = load_any(DATA / "weka", "weka").trace
    declared = declared_prefix_blocks(trace)
    want = math.ceil((raw["tool_tokens"] + raw["system_tokens"]) / raw["block_size"])
    assert declared["trace_0107"] == want == 241
    session = next(s for s in trace.sessions if s.id == "trace_0107")
    at = marker_positions(session, shared_block_ids(trace), declared["trace_0107"])
    assert set(at.values()) == {241}  # hash ids are per file: nothing shared across files
    assert set(marker_positions(session, shared_block_ids(trace)).values()) == {0}
    # Mid-session starts: the priming, warm-up and measured requests carry one marker.
    marker = marker_block(3, 0, 16)
    play = plan_play(session, 3, 0, start_turn=2, warmup_turns=1, marker=marker,
                     marker_at=at)
    assert {p.phase for p in play.requests} == {"warmup", "measure"}
    for planned in play.requests:
        blocks = planned.request.blocks
        assert blocks[241] == marker and marker not in blocks[:241] + blocks[242:]


def test_every_play_gets_its_own_marker_after_the_prefix_and_isl_grows_by_it(
        tmp_path: Path) -> None:
    trace = _shared_prefix_trace()
    _, _, rows, prompts = _replay(tmp_path / "a", trace, users=2,
                                  cache_bust="after-shared-prefix", cache_salt=5)
    assert len(prompts) == 4
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    firsts, seconds = by_len[3 * 8 + 16], by_len[4 * 8 + 16]  # the marker adds 16 tokens
    assert len(firsts) == len(seconds) == 2
    assert firsts[0][:16] == firsts[1][:16] == seconds[0][:16]  # the prefix stays shared
    markers = {tuple(p[16:32]) for p in firsts}
    assert len(markers) == 2  # one per play
    assert {tuple(p[16:32]) for p in seconds} == markers  # and the same in its later turns
    assert sorted(r["isl_requested"] for r in rows) == [40, 40, 48, 48]
    # The default: no marker outside --recycle, the prompts are the trace's own.
    _, _, _, plain = _replay(tmp_path / "b", trace, users=2, cache_salt=5)
    assert sorted(len(p) for p in plain) == [24, 24, 32, 32]


def test_recycled_plays_of_one_session_get_different_markers(tmp_path: Path) -> None:
    session = Session("s0", (_req("s0/0", "s0", (Block(1, 8), Block(2, 8), Block(3, 8))),
                             _req("s0/1", "s0", (Block(1, 8), Block(2, 8), Block(3, 8),
                                                 Block(4, 8)), deps=("s0/0",))))
    trace = Trace("one", (session,), block_size=8, meta={"prefix_blocks": '{"s0": 2}'})
    _, _, rows, prompts = _replay(tmp_path, trace, users=1, recycle=True, max_requests=4,
                                  start_range=(0.0, 0.0), warmup_turns=0,
                                  cache_bust="after-shared-prefix", cache_salt=5)
    assert [r["play"] for r in sorted(rows, key=lambda r: r["sent_ns"])] == [0, 0, 1, 1]
    assert len({tuple(p[:16]) for p in prompts}) == 1  # the declared prefix, always first
    marks = [tuple(p[16:32]) for p in prompts]
    assert marks[0] == marks[1] != marks[2] == marks[3]


# --grace ------------------------------------------------------------------------------


def test_grace_cuts_what_is_still_in_flight_and_records_it(tmp_path: Path) -> None:
    b = (Block(1, 8),)
    trace = Trace("grace", (
        Session("stuck", (_req("stuck/0", "stuck", b, out=STUCK),)),
        Session("slow", (_req("slow/0", "slow", (Block(2, 8),), out=SLOW),)),
    ), block_size=8)
    outcome, _, rows, _ = _replay(tmp_path, trace, users=2, duration_s=1.0, grace_s=1.0)
    by_id = {r["request_id"]: r for r in rows}
    cut = by_id["stuck/0"]
    assert (cut["phase"], cut["ok"], cut["error_kind"]) == ("cut", False, "grace")
    assert cut["done_ns"] >= 2_000_000_000 - 50_000_000  # cut at duration + grace
    assert by_id["slow/0"]["phase"] == "measure" and by_id["slow/0"]["ok"]  # finished in grace
    assert (outcome.cut, outcome.completed, outcome.failed) == (1, 1, 0)
    assert outcome.cut_reason == "in flight 1 s after --duration 1 s (--grace)"
    summary = write_results(tmp_path, report=False).summary
    assert summary["requests_cut"] == 1 and summary["requests_completed"] == 1
    assert summary["requests_failed"] == 0 and summary["cut_reason"]


# --aiperf-compatible ------------------------------------------------------------------


def test_aiperf_compatible_expands_to_aiperfs_rules(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    chosen = with_aiperf(True, None, None, None, None, "pinned", None)
    assert chosen == AIPERF == Traffic(pauses="end-to-start", idle_cap=10.0,
                                       cache_bust="after-shared-prefix", api="chat",
                                       session_order="sequential", pause_cap=None)
    said = capsys.readouterr().err
    assert said.strip() == (
        "aiperf-compatible: --pauses end-to-start, --idle-cap 10, --session-order "
        "sequential, --cache-bust after-shared-prefix, no --pause-cap, --api chat (streaming, "
        "max_completion_tokens, ignore_eos, no temperature)")
    # Explicit flags win.
    assert with_aiperf(True, "trace", 3.0, "head", "completions", "pinned", 60.0) == Traffic(
        "trace", 3.0, "head", "completions", "sequential", 60.0)
    # Off: today's defaults.
    assert with_aiperf(False, None, None, None, None, "pinned", None) == Traffic(
        "trace", None, "head", "completions", "pinned", None)
    # With --preset agentx, no --pause-cap stays no pause cap.
    assert with_preset("agentx", False, None, None, "pool", keep_pause_cap=True) == (
        True, 3600.0, None, "pool")


def test_aiperf_compatible_chat_requests_name_max_completion_tokens(tmp_path: Path) -> None:
    trace = _shared_prefix_trace()
    with Journal(tmp_path / "j.jsonl") as journal:
        for compatible, field in ((True, "max_completion_tokens"), (False, "max_tokens")):
            opts = ReplayOptions(api="chat", aiperf_compatible=compatible)
            engine = ReplayEngine(trace, Target("http://127.0.0.1:9", "m"), opts, journal,
                                  build_http_client(opts))
            body = orjson.loads(engine._payload(trace.sessions[0].requests[0]))
            other = "max_tokens" if compatible else "max_completion_tokens"
            assert body[field] == 2 and other not in body
            assert ("temperature" in body) is not compatible  # AIPerf leaves it to the server
            assert body["ignore_eos"] and body["stream"] and "messages" in body


def test_aiperf_compatible_on_the_command_line_says_what_it_applied() -> None:
    done = run_cli("replay", str(DATA / "weka"), "--target", "http://127.0.0.1:9",
                   "--aiperf-compatible", "--idle-cap", "5", timeout=120)
    assert done.returncode != 0  # nothing listens there
    assert ("aiperf-compatible: --pauses end-to-start, --idle-cap 5, --session-order "
            "sequential, --cache-bust after-shared-prefix, no --pause-cap") in done.stderr
