"""``--aiperf-compatible`` sends AIPerf's requests: its lanes, start points, warm-up.

AIPerf 0.13.0's AgentX scenario gives lane i the i-th session of a sequential sampler
over the traces in file order, and each lane's first play starts at an instant t* drawn
by numpy from a seed hashed from (seed, trace, lane); the sessions live at t* are primed
with their last earlier request (one output token) and measured from their next one.
These tests check agentload draws the same t* and cuts the same requests, with pinned
numbers in CI and against AIPerf's own ``TrajectorySource`` when its virtualenv is here.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest

from agentload.replay.engine.core import ReplayEngine, ReplayOptions, Target, build_http_client
from agentload.replay.engine.plan import aiperf_start_s, plan_play_at
from agentload.replay.journal import Journal
from agentload.replay.results.metrics import summarize
from agentload.traces import Trace
from agentload.traces.formats import load_any
from tests.support import DATA

WEKA_MINI = DATA / "aiperf" / "weka-mini"
ORACLE = DATA / "aiperf" / "trajectory_oracle.py"
PEER_PYTHON = Path(__file__).resolve().parents[2] / ".peers" / "aiperf" / "bin" / "python"

# AIPerf's t* (ms) for seed 0 and 4 lanes on weka-mini, as its log printed them
# (sample_time 57 %, 70 %, 7 %, 84 %; root_next 2/4, 4/7, 2/20, 2/3).
T_STAR_MS = {"trace_0107": 7540.821220376434, "trace_0146": 7840.533201905707,
             "trace_0291": 5835.548674165595, "trace_0504": 161232.25818066185}


def _mini() -> Trace:
    return load_any(WEKA_MINI, "weka").trace


def test_the_start_instants_are_aiperfs_for_the_same_seed() -> None:
    trace = _mini()
    for lane, session in enumerate(trace.sessions):
        start = aiperf_start_s(0, session, lane)
        assert start is not None
        assert start * 1e3 == pytest.approx(T_STAR_MS[session.id], abs=1e-6)
    # Another lane or seed draws another instant; a narrower range stays inside it.
    s = trace.sessions[2]
    assert aiperf_start_s(0, s, 1) != aiperf_start_s(0, s, 2) != aiperf_start_s(1, s, 2)
    narrow = aiperf_start_s(0, s, 2, (0.5, 0.5))
    assert narrow == pytest.approx(85.1875 / 2)


def test_the_cut_primes_each_live_agent_and_measures_from_t_star() -> None:
    session = next(s for s in _mini().sessions if s.id == "trace_0291")
    play = plan_play_at(session, 2, 0, start_s=T_STAR_MS["trace_0291"] / 1e3)
    primes = [p for p in play.requests if p.prime]
    assert [p.request.id for p in primes] == ["trace_0291/1#prime"]
    assert primes[0].request.output_tokens == 1 and primes[0].phase == "warmup"
    measured = [p for p in play.requests if p.phase == "measure"]
    assert measured[0].request.id == "trace_0291/2" and play.start_turn == 2
    # The first measured request waits for the priming and then t - t*.
    assert measured[0].depends_on == ("trace_0291/1#prime",)
    assert measured[0].request.pause_s == pytest.approx(7.125 - 5.835548674165595)
    assert len(measured) == len(session.requests) - 2


def test_a_cut_inside_a_subagent_primes_it_and_starts_the_unspawned_one_later() -> None:
    session = next(s for s in _mini().sessions if s.id == "trace_0291")
    play = plan_play_at(session, 0, 0, start_s=72.5)
    by_id = {p.request.id: p for p in play.requests}
    assert sorted(p.request.id for p in play.requests if p.prime) == [
        "trace_0291/15#prime", "trace_0291/sa:agent_001/2#prime"]
    first_sub = by_id["trace_0291/sa:agent_001/3"]
    assert first_sub.request.pause_s == pytest.approx(72.6883125 - 72.5)
    # agent_002 began after t*: nothing to prime, it starts at its offset.
    later = by_id["trace_0291/sa:agent_002/0"]
    assert later.phase == "measure" and later.request.pause_s == pytest.approx(1.2845625)
    # The main chain's next turn still joins agent_001's last request.
    assert by_id["trace_0291/16"].depends_on == ("trace_0291/sa:agent_001/4",)
    assert play.start_turn == 16


def test_sequential_order_gives_lanes_the_traces_in_order_then_wraps() -> None:
    trace = _mini()
    opts = ReplayOptions(users=4, recycle=True, session_order="sequential", duration_s=1)
    with Journal(Path("/dev/null")) as journal:
        engine = ReplayEngine(trace, Target("http://127.0.0.1:9", "m"), opts, journal,
                              build_http_client(opts))
    order = engine._sequential(list(trace.sessions))
    ids = [next(order).id for _ in range(6)]
    assert ids == ["trace_0107", "trace_0146", "trace_0291", "trace_0504", "trace_0107",
                   "trace_0146"]


def test_the_theoretical_hit_rate_never_passes_100_percent() -> None:
    # Reported: 101.3 % when the server counted fewer prompt tokens than were requested
    # (chat rendering): the hits (requested tokens) were divided by the server's ISL.
    frame = pl.DataFrame({
        "request_id": ["a", "b"], "session_id": ["s", "s"], "phase": ["measure"] * 2,
        "ok": [True, True], "isl": [900, 950], "isl_requested": [1000, 1000],
        "theoretical_cached_tokens": [960, 960], "osl": [4, 4], "osl_requested": [4, 4],
        "sent_ns": [0, 10], "first_token_ns": [5, 15], "last_token_ns": [8, 18],
        "done_ns": [8, 18], "cached_tokens": [None, None]},
        schema_overrides={"cached_tokens": pl.Int64()})
    from agentload.replay.journal import REQUEST_SCHEMA
    full = frame.with_columns(pl.lit(None, dtype=dtype).alias(name)
                              for name, dtype in REQUEST_SCHEMA.items()
                              if name not in frame.columns).select(list(REQUEST_SCHEMA))
    s = summarize(full.cast(dict(REQUEST_SCHEMA)), gpus=1)  # type: ignore[arg-type]
    assert s["theoretical_prefix_cache_hit_rate"] == pytest.approx(0.96)
    assert s["theoretical_prefix_cache_hit_rate_all"] == pytest.approx(0.96)


def _oracle_spec(trace: Trace, seed: int, lanes: int) -> dict[str, object]:
    sessions = []
    for s in trace.sessions:
        streams: dict[str, dict[str, object]] = {}
        for r in s.requests:
            st = streams.setdefault(r.agent_id, {"id": r.agent_id,
                                                 "t_ms": [], "spawn_turn": None})
            assert r.recorded is not None and r.recorded.t is not None
            st["t_ms"].append(r.recorded.t * 1e3)  # type: ignore[union-attr]
            if r.agent_kind != "main" and st["spawn_turn"] is None:
                mains = [q.id for q in s.requests if q.agent_kind == "main"]
                spawn = next(d for d in r.depends_on if d in mains)
                st["spawn_turn"] = mains.index(spawn)
        sessions.append({"id": s.id, "streams": [streams["main"], *(
            v for k, v in streams.items() if k != "main")]})
    return {"seed": seed, "lanes": lanes, "sessions": sessions}


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="AIPerf's virtualenv (make peers)")
@pytest.mark.parametrize(("seed", "lanes"), [(0, 4), (7, 6), (42, 3), (3, 8), (11, 2)])
def test_the_schedule_is_the_one_aiperf_builds(seed: int, lanes: int) -> None:
    trace = _mini()
    done = subprocess.run([str(PEER_PYTHON), str(ORACLE)], input=json.dumps(
        _oracle_spec(trace, seed, lanes)), capture_output=True, text=True, timeout=120,
        check=True)
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    sessions = list(trace.sessions)
    for lane, want in enumerate(theirs["lanes"]):
        session = sessions[lane % len(sessions)]  # agentload's sequential order
        assert want["trace"] == session.id
        start = aiperf_start_s(seed, session, lane)
        assert start is not None and start * 1e3 == pytest.approx(want["t_star_ms"], abs=1e-6)
        play = plan_play_at(session, lane, 0, start_s=start)
        # Each live stream: AIPerf's next turn is agentload's first measured request of
        # that agent, and its turn before (if any) the primed one.
        for conv, nxt in want["next"].items():
            agent = "main" if "::sa:" not in conv else conv.split("::sa:")[1]
            mine = [p for p in play.requests if p.request.agent_id == agent]
            reqs = [r for r in session.requests if r.agent_id == agent]
            first = next(p for p in mine if p.phase == "measure")
            assert first.request.id == reqs[nxt].id
            primed = [p.request.id for p in mine if p.prime]
            assert primed == ([f"{reqs[nxt - 1].id}#prime"] if nxt else [])
    # Recycles draw on from the same sampler: the trace after the last lane's, wrapping.
    assert theirs["recycle"] == [sessions[(lanes + k) % len(sessions)].id
                                 for k in range(len(theirs["recycle"]))]


def test_the_engine_warms_every_lane_before_measuring_and_then_starts_the_clock(
        tmp_path: Path) -> None:
    from agentload.traces import Block, Session
    from tests.replay.test_aiperf_traffic import _replay, _req

    def chain(sid: str) -> Session:
        b = (Block(1, 8),)
        return Session(sid, tuple(
            _req(f"{sid}/{k}", sid, b, deps=(f"{sid}/{k - 1}",) if k else (), t=float(k),
                 api=0.1, pause=0.9 if k else 0.0) for k in range(6)))

    trace = Trace("t", (chain("a"), chain("b")), block_size=8)
    _, events, rows, _ = _replay(tmp_path, trace, users=2, recycle=True, duration_s=1.5,
                                 session_order="sequential", start_at="time", seed=3,
                                 start_range=(0.0, 1.0), time_scale=0.1, max_connections=8)
    warmed = next(e for e in events if e["kind"] == "warmup_done")
    primes = [r for r in rows if r["request_id"].endswith("#prime")]
    starts = {s.id: aiperf_start_s(3, s, lane) for lane, s in enumerate(trace.sessions)}
    # Each lane primed its last request before t* (none if t* precedes its second).
    want = sorted(f"{sid}/{math.ceil(t) - 1}#prime" for sid, t in starts.items()
                  if t is not None and math.ceil(t) >= 1)
    assert sorted(r["request_id"] for r in primes) == want
    assert warmed["primes"] == len(primes)
    first_plays = [r for r in rows if r["phase"] == "measure" and r.get("play", 0) == 0]
    assert first_plays and all(r["intended_ns"] >= warmed["t_ns"] for r in first_plays)
    for sid, t in starts.items():
        assert t is not None
        ids = {r["request_id"] for r in first_plays if r["request_id"].startswith(sid)}
        assert ids <= {f"{sid}/{k}" for k in range(6) if k >= t}


def test_chat_text_is_as_long_as_the_blocks_on_average_and_stable_per_block() -> None:
    from agentload.replay.engine.prompts import TextPrompts
    from agentload.traces import Block

    texts = TextPrompts(salt=3, words_per_token=0.3)
    blocks = [Block(i, 64) for i in range(1, 2001)]
    words = sum(len(texts.text([b]).split()) for b in blocks)
    # 19.2 words a block on average, not round(19.2) = 19 every time (1 % short).
    assert words / len(blocks) == pytest.approx(64 * 0.3, rel=0.005)
    # A block is the same words wherever it appears, so prefixes stay prefixes.
    assert texts.text(blocks[:3]).startswith(texts.text(blocks[:2]))
    assert texts.text([blocks[5]]) == texts.text([blocks[5]])


def test_chat_messages_follow_aiperfs_turn_structure_and_extend_each_other() -> None:
    from agentload.replay.engine.plan import (
        chat_segments,
        declared_prefix_blocks,
        marker_block,
        marker_positions,
    )
    from agentload.replay.engine.prompts import TextPrompts

    trace = _mini()
    session = next(s for s in trace.sessions if s.id == "trace_0291")
    at = marker_positions(session, frozenset(), declared_prefix_blocks(trace)[session.id])
    segs = chat_segments(session, at, trace.block_size)
    # Turn 0: the tool/system prefix as a system message, the rest a user message.
    assert segs["trace_0291/0"] == (("system", 16), ("user", 2))
    # Turn 1 keeps turn 0's messages, then the previous output (27 tokens: one block) as
    # an assistant message and the new input as a user message.
    assert segs["trace_0291/1"] == (("system", 16), ("user", 1), ("assistant", 1),
                                    ("user", 1))
    for req in session.requests:
        assert sum(n for _, n in segs[req.id]) == len(req.blocks)
        assert segs[req.id][-1][0] == "user"
    # Rendered with a marker: a prompt's messages start with its previous prompt's,
    # except where the previous one ended (its unshared tail block).
    texts = TextPrompts(salt=1, words_per_token=0.3)
    marker = marker_block(2, 0, 16)
    first, second = session.requests[3], session.requests[4]
    m1 = texts.messages_in((*first.blocks[:16], marker, *first.blocks[16:]), segs[first.id])
    m2 = texts.messages_in((*second.blocks[:16], marker, *second.blocks[16:]),
                           segs[second.id])
    assert [m["role"] for m in m1][:2] == ["system", "user"]
    assert m2[:2] == m1[:2] and m1[1]["content"].startswith(texts.text([marker]))


def test_the_idle_cap_waits_for_what_a_return_releases_before_it_pulls() -> None:
    # Seen in a run: the last request ended, the cap pulled a lane's 30 s wait forward
    # before the next request of the finished chain (due 5.5 s later) was a timer.
    # AIPerf checks after the return's follow-ups are dispatched; so does agentload.
    from agentload.replay.engine.pacing import IdleCap

    s = 1_000_000_000
    checks: list[Callable[[], None]] = []
    cap = IdleCap(10.0, defer=checks.append)
    cap.start(0)
    cap.sending()
    far = cap.add(40 * s)
    cap.finished(16 * s)
    assert far.due_ns == 40 * s and len(checks) == 1  # not yet
    near = cap.add(int(21.5 * s))  # the finished chain's next request
    checks.pop()()
    assert (far.due_ns, near.due_ns, cap.shifts) == (40 * s, int(21.5 * s), 0)
    # With nothing near, the deferred check pulls as before.
    cap.remove(near)
    cap.sending()
    cap.finished(30 * s)
    checks.pop()()
    assert far.due_ns == 40 * s  # within 10 s of 30 s: left alone
    cap.sending()
    cap.finished(25 * s)
    late = cap.add(60 * s)
    checks.pop()()
    assert (far.due_ns, late.due_ns) == (35 * s, 55 * s)


def test_end_to_start_spawns_and_joins_subagents_at_once_as_aiperf_does() -> None:
    from agentload.replay.engine.fit import end_to_start_pause

    session = next(s for s in _mini().sessions if s.id == "trace_0291")
    by_id = {r.id: r for r in session.requests}
    # A subagent's first request (recorded 2.96 s after its spawn ended) and the join
    # turn (0.90 s after the subagent's last request ended) go at once; inside a chain
    # the recorded gap stays.
    assert end_to_start_pause(by_id["trace_0291/sa:agent_001/0"], by_id) == 0.0
    assert end_to_start_pause(by_id["trace_0291/16"], by_id) == 0.0
    gap = end_to_start_pause(by_id["trace_0291/sa:agent_001/1"], by_id)
    assert gap is not None and gap > 0
    assert end_to_start_pause(by_id["trace_0291/5"], by_id) == pytest.approx(
        47.0 - 12.3125 - (by_id["trace_0291/4"].recorded.api_time or 0.0))  # type: ignore[union-attr]
