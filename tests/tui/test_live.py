"""The engine side of the dashboard: the LiveBoard, its snapshots, and journal playback.

The board is fed by the real engine over a small local SSE server (aiohttp, fixed
TTFT and ITL), and the numbers it publishes are checked against ``summarize`` over
the journal the same run wrote; playback of that journal must end in the same place.
"""

from __future__ import annotations

import asyncio
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web

from agentload.replay.client import diagnostics
from agentload.replay.client.diagnostics import ClientDiagnostics, LogHistogram, saturation_reasons
from agentload.replay.engine.core import ReplayEngine, ReplayOptions, Target, build_http_client
from agentload.replay.journal import Journal, read_journal, request_frame
from agentload.replay.live import (
    CLIENT_KEYS,
    Header,
    JournalPlayback,
    LiveBoard,
    LiveSnapshot,
    weighted_quantile,
)
from agentload.replay.results.metrics import summarize
from agentload.replay.serve.server import free_port
from agentload.traces import Block, Request, Session, Trace
from agentload.tui.synthetic import write_synthetic_run


def _chunk(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_app(ttft_s: float = 0.02, itl_s: float = 0.004, fail_every: int = 0) -> web.Application:
    """A tiny OpenAI-completions SSE server: ``max_tokens`` tokens, ``itl_s`` apart."""
    count = {"n": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count["n"] += 1
        if fail_every and count["n"] % fail_every == 0:
            return web.json_response({"error": "overloaded"}, status=503)
        n = int(body["max_tokens"])
        prompt = body.get("prompt") or []
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(ttft_s)
        for _ in range(n):
            await resp.write(_chunk({"choices": [{"text": "x"}]}))
            await asyncio.sleep(itl_s)
        await resp.write(_chunk({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": n}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(request: web.Request) -> web.Response:
        text = (f"vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n"
                f"vllm:kv_cache_usage_perc 0.25\nvllm:prefix_cache_queries_total "
                f"{100 * count['n']}\nvllm:prefix_cache_hits_total {60 * count['n']}\n")
        return web.Response(text=text)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 1 << 20}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


def small_trace(sessions: int = 4, turns: int = 4, subagents: bool = True) -> Trace:
    out = []
    for s in range(sessions):
        reqs: list[Request] = []
        prev: str | None = None
        for t in range(turns):
            blocks = tuple(Block(id=1000 * s + i, tokens=16) for i in range(t + 2))
            deps: tuple[str, ...] = (prev,) if prev else ()
            if subagents and t == 1:
                subs = [Request(id=f"s{s}-t{t}-sub{j}", session_id=f"s{s}", blocks=blocks[:1],
                                output_tokens=8, depends_on=deps, pause_s=0.01,
                                agent_kind="subagent", agent_id=f"sub{j}") for j in range(2)]
                reqs += subs
                deps = tuple(r.id for r in subs)
            req = Request(id=f"s{s}-t{t}", session_id=f"s{s}", blocks=blocks,
                          output_tokens=12, depends_on=deps, pause_s=0.05)
            reqs.append(req)
            prev = req.id
        out.append(Session(id=f"s{s}", requests=tuple(reqs)))
    return Trace(name="small", sessions=tuple(out), block_size=16)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def run_engine(tmp_path: Path, trace: Trace, users: int = 2, fail_every: int = 0,
                     publish_every_s: float = 0.05) -> tuple[ReplayEngine, list[LiveSnapshot]]:
    """Replay ``trace`` against the fake server, publishing snapshots as run.py does."""
    runner, url = await _serve(sse_app(fail_every=fail_every))
    snaps: list[LiveSnapshot] = []
    try:
        options = ReplayOptions(users=users, cache_salt=7)
        with Journal(tmp_path / "journal.jsonl") as journal:
            journal.write_run({"target": {"label": "fake", "gpus": 2},
                               "trace": {"name": trace.name, "requests": trace.num_requests},
                               "options": {"users": users}})
            client = build_http_client(options)
            engine = ReplayEngine(trace, Target(url, "m", gpus=2, label="fake"), options,
                                  journal, client)
            async with client:
                task = asyncio.create_task(engine.run())
                await asyncio.sleep(0)  # the run's clock starts before the first publish
                while not task.done():
                    snaps.append(engine.live.publish(engine.now_ns()))
                    await asyncio.sleep(publish_every_s)
                await task
            snaps.append(engine.live.publish(engine.now_ns()))
    finally:
        await runner.cleanup()
    return engine, snaps


async def test_board_follows_a_real_engine_run(tmp_path: Path) -> None:
    trace = small_trace()
    _engine, snaps = await run_engine(tmp_path, trace)
    final = snaps[-1]
    assert final.finished and final.totals.requests_done == trace.num_requests
    # Lanes went through the states a request passes (seen in some snapshot).
    seen = {lane.state for s in snaps for lane in s.lanes}
    assert {"decoding", "pausing"} <= seen
    assert "subagents" in seen or any(lane.subagents for s in snaps for lane in s.lanes)
    # Numbers grew while it ran, and the final ones match summarize() over the journal.
    done = [s.totals.requests_done for s in snaps]
    assert done == sorted(done) and done[0] < done[-1]
    _, rows = read_journal(tmp_path / "journal.jsonl")
    summary = summarize(request_frame(rows), gpus=2)
    head = final.headline("request")
    for key in ("p90_interactivity_tok_s", "p50_interactivity_tok_s", "ttft_p90_s",
                "e2e_norm_p90_interactivity_tok_s", "decode_throughput_tok_s",
                "output_throughput_tok_s", "throughput_per_gpu_tok_s"):
        assert getattr(head, key) == pytest.approx(summary[key], rel=1e-9), key
    assert final.totals.verdict == "valid"
    # Per-lane: turn k/n of the session, the user's P90 and last ITL are filled in.
    lane0 = final.lanes[0]
    assert lane0.session is not None and lane0.turn == lane0.turns == 4
    assert lane0.p90_interactivity_tok_s and lane0.last_itl_s
    assert any(e.kind == "end" for e in final.events)
    # Immutable and picklable (sent to the dashboard process as is).
    back = pickle.loads(pickle.dumps(final))
    assert back.lanes == final.lanes and back.totals == final.totals
    assert back.headlines == final.headlines and back.seq == final.seq
    with pytest.raises(AttributeError):
        final.elapsed_s = 0.0  # type: ignore[misc]


async def test_errors_and_server_samples_reach_the_board(tmp_path: Path) -> None:
    engine, _snaps = await run_engine(tmp_path, small_trace(subagents=False), fail_every=5)
    board = engine.live
    board.server_sample(engine.now_ns(), {"vllm:num_requests_waiting": 3.0,
                                          "vllm:kv_cache_usage_perc": 0.5,
                                          "vllm:prefix_cache_queries_total": 10.0,
                                          "vllm:prefix_cache_hits_total": 5.0,
                                          "vllm:prompt_tokens_total": 100.0})
    board.server_sample(engine.now_ns() + 1, {"vllm:prompt_tokens_total": 10.0})
    board.server_sample(engine.now_ns() + 2, None)
    final = board.publish(engine.now_ns() + 3)
    assert final.totals.requests_failed > 0
    assert dict(final.totals.errors_by_kind) == {"http_5xx": final.totals.requests_failed}
    kinds = [e.kind for e in final.events]
    assert "error" in kinds
    texts = " | ".join(e.text for e in final.events)
    assert "server restarted" in texts and "server metrics unavailable" in texts
    assert final.server is not None and not final.server.ok


async def test_playback_of_the_journal_ends_where_the_run_ended(tmp_path: Path) -> None:
    trace = small_trace()
    _, snaps = await run_engine(tmp_path, trace)
    live_final = snaps[-1]
    clock = [0.0]
    playback = JournalPlayback(tmp_path, speed=1.0, clock=lambda: clock[0])
    first = playback.snapshot()
    assert first is not None and first.header.mode == "playback"
    assert first.header.label == "fake" and first.header.gpus == 2
    clock[0] = 3600.0
    last = playback.snapshot()
    assert last is not None and last.finished
    assert last.totals.requests_done == live_final.totals.requests_done
    assert last.headline("request").p90_interactivity_tok_s == pytest.approx(
        live_final.headline("request").p90_interactivity_tok_s)
    assert last.note == "end of the recorded run"
    playback.close()


def test_playback_speed_and_hold(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", users=10, duration_s=60, seed=3)
    clock = [0.0]
    pb = JournalPlayback(run.run_dir, speed=10.0, clock=lambda: clock[0])
    clock[0] = 1.0
    s1 = pb.snapshot()
    assert s1 is not None and s1.elapsed_s == pytest.approx(10.0)
    pb.hold(True)
    clock[0] = 5.0
    s2 = pb.snapshot()
    assert s2 is not None and s2.elapsed_s == pytest.approx(10.0)  # held: clock stopped
    pb.hold(False)
    clock[0] = 6.0
    s3 = pb.snapshot()
    assert s3 is not None and s3.elapsed_s == pytest.approx(20.0)
    assert s3.totals.requests_done > s1.totals.requests_done
    assert s3.series_by_key("kv_usage") is not None
    assert s3.series_by_key("kv_usage").last() is not None  # type: ignore[union-attr]
    pb.close()


def test_playback_follows_a_growing_journal(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "full", users=4, duration_s=30, seed=5)
    lines = (run.run_dir / "journal.jsonl").read_bytes().splitlines(keepends=True)
    growing = tmp_path / "growing"
    growing.mkdir()
    (growing / "run.json").write_bytes((run.run_dir / "run.json").read_bytes())
    half = len(lines) // 2
    (growing / "journal.jsonl").write_bytes(b"".join(lines[:half]) + lines[half][:10])
    clock = [0.0]
    pb = JournalPlayback(growing, speed=1000.0, clock=lambda: clock[0])
    clock[0] = 100.0
    s1 = pb.snapshot()
    assert s1 is not None and not s1.finished
    assert s1.note is not None and "has not ended" in s1.note
    with open(growing / "journal.jsonl", "ab") as fh:
        fh.write(lines[half][10:] + b"".join(lines[half + 1:]))
    clock[0] = 200.0
    s2 = pb.snapshot()
    assert s2 is not None and s2.finished
    assert s2.totals.requests_done + s2.totals.requests_failed == run.requests
    pb.close()


def test_weighted_quantile_gives_each_group_its_weight() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0])
    # Equal weights: the midpoint rule (Hazen), between numpy's "linear" neighbours.
    assert weighted_quantile(x, np.ones(4), 0.5) == pytest.approx(2.5)
    assert weighted_quantile(x, np.ones(4), 0.0) == 1.0
    assert weighted_quantile(x, np.ones(4), 1.0) == 4.0
    # One user with many fast requests does not hide a slow user when users weigh equally.
    values = np.concatenate([np.full(90, 0.01), np.full(10, 0.1)])
    per_user = np.concatenate([np.full(90, 1 / 90), np.full(10, 1 / 10)])
    assert weighted_quantile(values, np.ones(100), 0.5) == pytest.approx(0.01)
    assert weighted_quantile(values, per_user, 0.9) == pytest.approx(0.1)
    assert weighted_quantile(np.array([math.nan]), np.ones(1), 0.5) is None


def test_user_weighting_differs_from_request_weighting(tmp_path: Path) -> None:
    board = LiveBoard(Header("arm", "t", 1, 2, 0, None))
    from agentload.replay.journal import RequestRecord

    def rec(i: int, lane: int, itl_ms: float) -> RequestRecord:
        first = i * 10**9
        return RequestRecord(f"r{i}", f"s{lane}", lane, "main", 0, "measure", first - 1000,
                             first - 1000, first, first + int(itl_ms * 1e6) * 9,
                             first + int(itl_ms * 1e6) * 9, 10, 10, 10, 10, "server", None,
                             0, 10, True, 200, None)

    for i in range(9):
        board.finished(rec(i, 0, 10.0))
    board.finished(rec(9, 1, 100.0))
    snap = board.publish(20 * 10**9)
    by_req = snap.headline("request").p90_interactivity_tok_s
    by_user = snap.headline("user").p90_interactivity_tok_s
    assert by_req is not None and by_user is not None and by_user < by_req


# --------------------------------------------------------------------------- client health

SATURATED = {"kernel_stamps": True, "stamp_error_p99_s": 0.0004, "events_per_read": 1.6,
             "multi_event_read_share": 0.25, "loop_lag_p99_s": 0.2, "cpu_cores": 0.4}


def test_a_saturated_client_makes_the_snapshot_invalid_with_its_reasons() -> None:
    board = LiveBoard(Header("x", "t", 1, 2, 10, None))
    assert board.publish(0).client is None
    healthy = {**SATURATED, "events_per_read": 1.0, "multi_event_read_share": 0.0,
               "loop_lag_p99_s": 0.002}
    healthy["saturation_reasons"] = saturation_reasons(healthy)
    board.client_sample(1_000_000_000, healthy)
    snap = board.publish(1_000_000_000)
    assert snap.client is not None and snap.client.verdict == "valid"
    assert snap.client.loop_lag_p99_s == pytest.approx(0.002) and not snap.client.final
    bad = {**SATURATED, "saturation_reasons": saturation_reasons(SATURATED)}
    board.client_sample(2_000_000_000, bad)
    snap = board.publish(2_000_000_000)
    c = snap.client
    assert c is not None and c.verdict == "invalid"
    # Two budgets broken: multi-event reads (25 % > 10 %) and loop lag (200 ms > 50 ms).
    assert len(c.reasons) == 2
    assert "25% of token reads" in c.reasons[0] and "p99 200.0 ms" in c.reasons[1]
    assert c.events_per_read == pytest.approx(1.6) and c.cpu_cores == pytest.approx(0.4)
    logged = [e for e in snap.events if e.kind == "client"]
    assert len(logged) == 1 and logged[0].level == "error"
    assert logged[0].text == "client INVALID: " + "; ".join(c.reasons)
    # Still saturated: no second line; recovered: said once.
    board.client_sample(3_000_000_000, bad)
    board.client_sample(4_000_000_000, healthy, final=True)
    snap = board.publish(4_000_000_000)
    assert [e.text for e in snap.events if e.kind == "client"][1:] == [
        "client keeps up again (valid)"]
    assert snap.client is not None and snap.client.final and snap.client.verdict == "valid"
    assert pickle.loads(pickle.dumps(snap)).client == snap.client


def test_log_histogram_quantiles_are_within_three_percent() -> None:
    rng = np.random.default_rng(5)
    values = rng.lognormal(12.0, 1.8, 50_000).astype(np.int64)
    h = LogHistogram()
    for part in np.array_split(values, 7):  # fed in pieces, as the probe does
        h.add(part)
    assert h.n == values.size
    for q in (0.5, 0.9, 0.99):
        exact = float(np.percentile(values, q * 100)) / 1e9
        assert h.quantile_s(q) == pytest.approx(exact, rel=0.03), q
    low = LogHistogram()
    low.add(np.array([-20, 0, 999], dtype=np.int64))
    assert low.quantile_s(0.99) == pytest.approx(1e-6)
    assert LogHistogram().quantile_s(0.5) is None


def test_live_figures_agree_with_the_summary() -> None:
    d = ClientDiagnostics()
    rng = np.random.default_rng(1)
    d.stamp_error_ns.extend(int(x) for x in rng.lognormal(11.0, 1.0, 5000))
    d.loop_lag_ns.extend(int(x) for x in rng.lognormal(13.0, 1.0, 800))
    d.reads, d.events, d.multi_event_reads, d.kernel_chunks = 1000, 1300, 150, 5000
    # Not started: no CPU window (None in both), so the verdicts compare exactly.
    live, exact = d.live(), d.summary()
    for key in ("stamp_error_p99_s", "loop_lag_p99_s"):
        assert live[key] == pytest.approx(exact[key], rel=0.03), key
    assert live["events_per_read"] == exact["events_per_read"] == 1.3
    assert live["multi_event_read_share"] == exact["multi_event_read_share"] == 0.15
    # The same verdict: 15 % multi-event reads are over the 10 % budget.
    assert live["saturation_reasons"] == exact["saturation_reasons"]
    assert len(exact["saturation_reasons"]) == 1
    # stop() hands the exact summary over, marked final.
    seen: list[tuple[dict[str, Any], bool]] = []
    d.on_figures = lambda figures, final: seen.append((figures, final))
    d.start()
    d.stop()
    assert len(seen) == 1 and seen[0][1] is True
    assert seen[0][0]["stamp_error_p99_s"] == exact["stamp_error_p99_s"]
    # Samples added after a live() call are counted by the next one.
    d.stamp_error_ns.extend([10**9] * 5000)
    assert d.live()["stamp_error_p99_s"] == pytest.approx(1.0, rel=0.03)


async def test_client_figures_are_journaled_shown_live_and_played_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnostics, "LIVE_EVERY_S", 0.05)
    runner, url = await _serve(sse_app())
    try:
        options = ReplayOptions(users=2, cache_salt=7)
        trace = small_trace()
        with Journal(tmp_path / "journal.jsonl") as journal:
            journal.write_run({"target": {"label": "fake", "gpus": 2},
                               "trace": {"name": trace.name, "requests": trace.num_requests},
                               "options": {"users": 2}})
            client = build_http_client(options, url)
            engine = ReplayEngine(trace, Target(url, "m", gpus=2, label="fake"), options,
                                  journal, client)
            async with client:
                # As run.py's _replay does it.
                engine.diagnostics.start()
                probe = asyncio.create_task(engine.diagnostics.probe())
                await engine.run()
                engine.diagnostics.stop()
                probe.cancel()
            final = engine.live.publish(engine.now_ns())
    finally:
        await runner.cleanup()
    lines = [orjson.loads(x) for x in (tmp_path / "journal.jsonl").read_bytes().splitlines()]
    client_lines = [x for x in lines if x.get("kind") == "client"]
    assert len(client_lines) >= 3  # live ones, then the final one
    assert [x["final"] for x in client_lines] == [False] * (len(client_lines) - 1) + [True]
    summary = engine.diagnostics.summary()
    last = client_lines[-1]
    for key in CLIENT_KEYS:
        assert last[key] == summary[key], key
    assert last["saturation_reasons"] == summary["saturation_reasons"]
    c = final.client
    assert c is not None and c.final
    assert c.stamp_error_p99_s == summary["stamp_error_p99_s"]
    assert c.events_per_read == summary["events_per_read"]
    assert c.loop_lag_p99_s == summary["loop_lag_p99_s"]
    assert c.verdict == ("invalid" if summary["saturation_reasons"] else "valid")
    clock = [0.0]
    playback = JournalPlayback(tmp_path, clock=lambda: clock[0])
    clock[0] = 3600.0
    played = playback.snapshot()
    playback.close()
    assert played is not None and played.client is not None
    assert played.client == c


def test_playback_of_an_old_journal_takes_the_client_from_summary_json(
        tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", users=3, duration_s=20, seed=2)
    path = run.run_dir / "journal.jsonl"
    kept = [x for x in path.read_bytes().splitlines() if b'"kind":"client"' not in x]
    path.write_bytes(b"\n".join(kept) + b"\n")
    figures = {**SATURATED, "saturation_reasons": saturation_reasons(SATURATED)}
    (run.run_dir / "summary.json").write_bytes(orjson.dumps({"client": figures}))
    clock = [0.0]
    pb = JournalPlayback(run.run_dir, clock=lambda: clock[0])
    assert pb.snapshot().client is None  # type: ignore[union-attr]
    clock[0] = 3600.0
    snap = pb.snapshot()
    pb.close()
    assert snap is not None and snap.client is not None and snap.client.final
    assert snap.client.reasons == tuple(figures["saturation_reasons"])
