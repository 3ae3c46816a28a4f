"""Plays: mid-session starts, warmup, per-play salt markers, and recycling lanes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson

from agentload.replay.engine.core import ReplayEngine, ReplayOptions, Target
from agentload.replay.engine.plan import marker_block, plan_play
from agentload.replay.journal import Journal, read_journal
from agentload.traces import Block, SynthConfig, synthesize
from tests.replay.test_client import Slow


def _session():  # type: ignore[no-untyped-def]
    trace = synthesize(SynthConfig(sessions=3, seed=5, subagent_probability=1.0))
    return next(s for s in trace.sessions if any(r.agent_kind == "subagent"
                                                 for r in s.requests))


def test_a_play_from_the_start_is_the_session() -> None:
    session = _session()
    play = plan_play(session, lane=0, index=0)
    assert [p.request for p in play.requests] == list(session.requests)
    assert all(p.phase == "measure" for p in play.requests)
    assert [p.depends_on for p in play.requests] == [r.depends_on for r in session.requests]


def test_mid_session_start_primes_then_warms_up_then_measures() -> None:
    session = _session()
    main = [r for r in session.requests if r.agent_kind == "main"]
    marker = marker_block(2, 0, 16)
    play = plan_play(session, lane=2, index=0, start_turn=3, warmup_turns=2, marker=marker)
    prime, w1, w2, first = play.requests[:4]
    assert prime.prime and prime.phase == "warmup" and prime.request.output_tokens == 1
    assert prime.request.blocks[1:] == main[1].blocks  # the first warmup turn's prompt
    assert [w1.request.id, w2.request.id] == [main[1].id, main[2].id]
    assert w1.depends_on == (prime.request.id,) and w2.depends_on == (w1.request.id,)
    assert first.request.id == main[3].id and first.phase == "measure"
    assert main[2].id in first.depends_on
    measured = [p.request.id for p in play.requests if p.phase == "measure"]
    assert measured[0] == main[3].id and main[0].id not in measured
    # Every prompt of the play starts with the play's marker, nothing else does.
    assert all(p.request.blocks[0] == marker for p in play.requests)
    assert marker.id < 0 and marker != marker_block(2, 1, 16)


def test_no_warmup_turns_still_primes_a_mid_session_start() -> None:
    session = _session()
    main = [r for r in session.requests if r.agent_kind == "main"]
    play = plan_play(session, lane=0, index=0, start_turn=3, warmup_turns=0)
    prime, first = play.requests[:2]
    assert prime.prime and prime.request.blocks == main[2].blocks  # the turn before
    assert first.request.id == main[3].id and prime.request.id in first.depends_on
    assert sum(p.phase == "warmup" for p in play.requests) == 1
    assert not plan_play(session, 0, 0, start_turn=0, warmup_turns=0).requests[0].prime


class _Server:
    """Counts requests; answers each with one SSE token and usage."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        self.prompts.append(body["prompt"])
        n = body["max_tokens"]
        events = [b'data: {"choices":[{"text":"x"}]}\n\n'] * n
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        events.append(b'data: {"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        return httpx.Response(200, stream=Slow([*events, b"data: [DONE]\n\n"], 0.0))


def test_recycling_lanes_stop_at_max_requests_and_journal_warmup(tmp_path: Path) -> None:
    trace = synthesize(SynthConfig(sessions=2, seed=1))
    server = _Server()
    options = ReplayOptions(users=3, recycle=True, max_requests=30, time_scale=0.0, seed=4)
    client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    with Journal(tmp_path / "j.jsonl") as journal:
        engine = ReplayEngine(trace, Target("http://x", "m"), options, journal, client)
        outcome = asyncio.run(engine.run())
    _, rows = read_journal(tmp_path / "j.jsonl")
    measured = [r for r in rows if r["phase"] == "measure"]
    assert outcome.sent == len(measured) == 30 and outcome.stop_reason == "max requests reached"
    assert any(r["phase"] == "warmup" for r in rows)
    plays = {(r["lane"], r["play"]) for r in rows}
    assert max(p for _, p in plays) >= 1  # lanes recycled to fresh plays
    # Two plays never share a prompt prefix: each starts with its own marker tokens.
    firsts = {tuple(p[:16]) for p in server.prompts}
    assert len(firsts) == len(plays)


def test_finalize_writes_chunks_plays_and_server_metrics(tmp_path: Path) -> None:
    import polars as pl

    from agentload.replay.journal import JOURNAL_NAME, finalize

    trace = synthesize(SynthConfig(sessions=2, seed=1))
    options = ReplayOptions(users=2, recycle=True, max_requests=12, time_scale=0.0, seed=2)
    client = httpx.AsyncClient(transport=httpx.MockTransport(_Server()))
    with Journal(tmp_path / JOURNAL_NAME) as journal:
        engine = ReplayEngine(trace, Target("http://x", "m"), options, journal, client)
        asyncio.run(engine.run())
        journal.write_server_metrics(1, {"vllm:prefix_cache_hits_total": 5.0})
        journal.write_server_metrics(2, {"vllm:prefix_cache_hits_total": 9.0})
    requests = finalize(tmp_path)
    chunks = pl.read_parquet(tmp_path / "chunks.parquet")
    per_request = chunks.group_by("request_id", "lane", "play").agg(
        n=pl.len(), tokens=pl.col("tokens").sum())
    joined = requests.join(per_request, on=["request_id", "lane", "play"])
    assert joined.height == requests.height
    assert (joined["n"] == joined["chunks"]).all() and (joined["tokens"] == joined["osl"]).all()
    assert (chunks.group_by("request_id", "lane", "play").agg(
        mono=pl.col("t_ns").diff().drop_nulls().min() >= 0)["mono"].fill_null(True)).all()
    plays = pl.read_parquet(tmp_path / "sessions.parquet")
    assert set(zip(plays["lane"], plays["play"], strict=True)) == set(
        zip(requests["lane"], requests["play"], strict=True))
    first = plays.filter(pl.col("play") == 0)
    assert (first["start_turn"] > 0).any() and (plays["marker_block"] < 0).all()
    metrics = pl.read_parquet(tmp_path / "server_metrics.parquet")
    assert metrics["d_prefix_cache_hits_total"].to_list() == [None, 4.0]


class _IdServer(_Server):
    """Returns token ids 7, 8, 9, ... as the generated tokens (return_token_ids)."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        self.prompts.append(body["prompt"])
        assert body.get("return_token_ids") is True
        n = body["max_tokens"]
        events = [b'data: {"choices":[{"text":"x","token_ids":[' + str(7 + i).encode() + b"]}]}\n\n"
                  for i in range(n)]
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        events.append(b'data: {"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        return httpx.Response(200, stream=Slow([*events, b"data: [DONE]\n\n"], 0.0))


def test_actual_outputs_replace_the_answer_blocks_in_later_prompts(tmp_path: Path) -> None:
    from agentload.replay.engine.prompts import TokenPrompts
    from agentload.traces import Request, Session, Trace

    sys_blocks = tuple(Block(i, 64) for i in range(1, 5))
    r0 = Request("s/0", "s", sys_blocks, 10)
    r1 = Request("s/1", "s", (*sys_blocks, Block(5, 64), Block(6, 32)), 4, ("s/0",))
    r2 = Request("s/2", "s", (*r1.blocks, Block(8, 64), Block(9, 16)), 3, ("s/1",))
    trace = Trace("t", (Session("s", (r0, r1, r2)),))
    server = _IdServer()
    options = ReplayOptions(users=1, time_scale=0.0, cache_salt=9, output_mode="actual")
    client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    with Journal(tmp_path / "j.jsonl") as journal:
        engine = ReplayEngine(trace, Target("http://x", "m"), options, journal, client)
        asyncio.run(engine.run())
    ids = TokenPrompts(9)
    p0, p1, p2 = server.prompts
    assert p0 == ids.prompt(sys_blocks)
    answer0 = list(range(7, 17))  # what the "model" generated for s/0
    assert p1 == p0 + answer0 + ids.prompt([Block(6, 32)])  # block 5 (64 tokens) replaced
    # s/2 carries both answers: s/0's inside s/1's context, and s/1's own (block 8).
    assert p2 == [*p1, 7, 8, 9, 10, *ids.prompt([Block(9, 16)])]
    _, rows = read_journal(tmp_path / "j.jsonl")
    assert [r["isl_requested"] for r in rows] == [len(p0), len(p1), len(p2)]
