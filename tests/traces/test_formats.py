"""Importers on real files (tests/data: public files copied unmodified, see its README) and
on hand-written files for the formats no fixture covers; every malformed-input class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from agentload.traces import TraceError
from agentload.traces.files import load_native, save_trace
from agentload.traces.formats import ImportOptions, detect_format, import_trace, load_any
from agentload.traces.stats import trace_stats
from agentload.traces.validate import validate_path
from tests.support import ROOT, run_cli

DATA = ROOT / "tests" / "data"
WEKA_DIR = DATA / "weka"
MOONCAKE = DATA / "mooncake" / "synthetic_trace_head500.jsonl"


def _weka_counts(entries: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    """(requests, subagent requests, input tokens, output tokens), counted independently."""
    n = sub = tin = tout = 0
    for e in entries:
        if e.get("type") == "subagent":
            a, _, c, d = _weka_counts(e["requests"])
            n, sub, tin, tout = n + a, sub + a, tin + c, tout + d
        else:
            n, tin, tout = n + 1, tin + e["in"], tout + e["out"]
    return n, sub, tin, tout


def test_weka_directory_counts_match_an_independent_count_of_the_files() -> None:
    trace = import_trace("weka", WEKA_DIR).trace
    files = sorted(WEKA_DIR.glob("*.json"))
    assert [s.id for s in trace.sessions] == [json.loads(f.read_text())["id"] for f in files]
    for f, session in zip(files, trace.sessions, strict=True):
        raw = json.loads(f.read_text())
        n, sub, tin, tout = _weka_counts(raw["requests"])
        assert len(session.requests) == n
        assert sum(r.agent_kind == "subagent" for r in session.requests) == sub
        assert sum(r.input_tokens for r in session.requests) == tin
        assert sum(r.output_tokens for r in session.requests) == tout
        totals = raw["totals"]["combined_tokens"]
        assert (tin, tout) == (totals["input"], totals["output"])  # and the file's own totals
    stats = trace_stats(trace)
    assert (stats["sessions"], stats["requests"], stats["subagent_requests"]) == (4, 46, 12)


def _flat(entries: list[dict[str, Any]], base: float = 0.0) -> list[tuple[float, Any]]:
    """(absolute start time, request) of every request, nested subagents included."""
    out: list[tuple[float, Any]] = []
    for e in entries:
        if e.get("type") == "subagent":
            out.extend(_flat(e["requests"], base + e["t"]))
        else:
            out.append((base + e["t"], e))
    return out


def test_weka_blocks_map_one_to_one_onto_each_files_hash_ids() -> None:
    trace = import_trace("weka", WEKA_DIR).trace
    owner: dict[int, str] = {}
    for f, session in zip(sorted(WEKA_DIR.glob("*.json")), trace.sessions, strict=True):
        raw = sorted(_flat(json.loads(f.read_text())["requests"]), key=lambda p: p[0])
        got = sorted(session.requests, key=lambda r: r.recorded.t)  # type: ignore[union-attr]
        mapping: dict[int, int] = {}
        for (t, e), req in zip(raw, got, strict=True):
            assert req.recorded is not None and req.recorded.t == pytest.approx(t)
            assert req.input_tokens == e["in"]
            hashed, tail = req.blocks[: len(e["hash_ids"])], req.blocks[len(e["hash_ids"]):]
            assert all(b.tokens == 64 for b in hashed)
            assert sum(b.tokens for b in tail) == e["in"] - 64 * len(e["hash_ids"]) < 64
            for h, b in zip(e["hash_ids"], hashed, strict=True):
                assert mapping.setdefault(h, b.id) == b.id  # one hash, one block id
        assert len(set(mapping.values())) == len(mapping)  # and one block id, one hash
        for block_id in mapping.values():  # local scope: no id is shared across files
            assert owner.setdefault(block_id, session.id) == session.id


def test_weka_subagents_spawn_after_the_parent_turn_and_join_the_first_turn_after_they_end(
) -> None:
    session = import_trace("weka", WEKA_DIR / "trace_0291.json").trace.sessions[0]
    by_id = {r.id: r for r in session.requests}
    first_sub = by_id["trace_0291/sa:agent_001/0"]
    assert first_sub.depends_on == ("trace_0291/15",)
    assert first_sub.agent_kind == "subagent" and first_sub.agent_id == "agent_001"
    assert first_sub.model == "claude-haiku-4-5-20251001"  # from the subagent's "models"
    # 1148.013 (start) - (1085 + 15.64) (parent's end)
    assert first_sub.pause_s == pytest.approx(47.373, abs=1e-3)
    assert by_id["trace_0291/sa:agent_001/1"].pause_s == 3.0  # think_time inside the chain
    # agent_001 ends at 1194.669, before turn 16 (t=1209); agent_002 ends 1259.737 < 1269.
    assert by_id["trace_0291/16"].depends_on == ("trace_0291/15", "trace_0291/sa:agent_001/4")
    assert by_id["trace_0291/16"].pause_s == pytest.approx(1209 - 1194.669, abs=1e-3)
    assert by_id["trace_0291/17"].depends_on == ("trace_0291/16", "trace_0291/sa:agent_002/6")
    assert by_id["trace_0291/2"].pause_s == 88.0  # think_time on the main chain
    assert by_id["trace_0291/3"].recorded.api_time == 42.24  # type: ignore[union-attr]


def test_nested_subagents_nest(tmp_path: Path) -> None:
    inner = {"t": 1.0, "type": "subagent", "agent_id": "inner", "duration_ms": 1000,
             "requests": [{"t": 0.0, "type": "s", "in": 70, "out": 5, "hash_ids": [9]}]}
    outer = {"t": 5.0, "type": "subagent", "agent_id": "outer", "duration_ms": 4000,
             "requests": [{"t": 0.0, "type": "s", "in": 64, "out": 5, "hash_ids": [5],
                           "api_time": 0.5}, inner,
                          {"t": 3.0, "type": "s", "in": 128, "out": 5, "hash_ids": [5, 6]}]}
    doc = {"id": "nest", "block_size": 64, "requests": [
        {"t": 0.0, "type": "s", "in": 64, "out": 3, "hash_ids": [1], "api_time": 1.0},
        outer,
        {"t": 20.0, "type": "s", "in": 100, "out": 3, "hash_ids": [1]}]}
    path = tmp_path / "nest.json"
    path.write_text(json.dumps(doc))
    reqs = {r.id: r for r in import_trace("weka", path).trace.sessions[0].requests}
    assert reqs["nest/sa:outer/sa:inner/0"].depends_on == ("nest/sa:outer/0",)
    assert reqs["nest/sa:outer/1"].depends_on == ("nest/sa:outer/0",
                                                  "nest/sa:outer/sa:inner/0")
    assert reqs["nest/1"].depends_on == ("nest/0", "nest/sa:outer/1")
    assert reqs["nest/1"].blocks[0] == reqs["nest/0"].blocks[0]  # hash 1, same content
    assert reqs["nest/1"].blocks[1].tokens == 36  # the unhashed tail
    assert reqs["nest/sa:outer/1"].blocks[0] == reqs["nest/sa:outer/0"].blocks[0]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_imports_reexport_losslessly(tmp_path: Path, suffix: str) -> None:
    for fmt, src in (("weka", WEKA_DIR), ("mooncake", MOONCAKE)):
        trace = import_trace(fmt, src).trace
        out = tmp_path / f"{fmt}{suffix}"
        save_trace(trace, out)
        assert load_native(out) == trace
        again = tmp_path / f"{fmt}-again{suffix}"
        save_trace(load_native(out), again)
        assert again.read_bytes() == out.read_bytes()


def test_mooncake_rows_become_open_loop_single_request_sessions() -> None:
    trace = import_trace("mooncake", MOONCAKE).trace
    rows = [orjson.loads(line) for line in MOONCAKE.read_bytes().splitlines() if line.strip()]
    assert trace.block_size == 512 and len(trace.sessions) == len(rows) == 500
    assert trace.num_requests == 500
    assert sum(r.input_tokens for r in trace.requests()) == sum(r["input_length"] for r in rows)
    assert sum(r.output_tokens for r in trace.requests()) == sum(
        max(1, r["output_length"]) for r in rows)
    for row, req in zip(rows, trace.requests(), strict=True):
        assert req.arrival_s == pytest.approx(row["timestamp"] / 1000)
        assert len(req.blocks) == len(row["hash_ids"])
        assert req.blocks[-1].tokens == row["input_length"] - 512 * (len(row["hash_ids"]) - 1)
        assert not req.depends_on
    # Rows whose hash lists start alike share block ids exactly that far.
    reqs = list(trace.requests())
    pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, min(i + 40, len(rows)))
             if rows[i]["hash_ids"][:2] == rows[j]["hash_ids"][:2]
             and len(rows[i]["hash_ids"]) > 2]
    assert len(pairs) >= 5, "the fixture's rows reuse prefixes"
    for i, j in pairs:
        assert reqs[i].blocks[:2] == reqs[j].blocks[:2]
    assert validate_path(MOONCAKE, "mooncake").errors == 0


def test_mooncake_sessions_extension(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"session_id": "a", "timestamp": 1000, "input_length": 600, "output_length": 4,
         "hash_ids": [1, 2]},
        {"session_id": "b", "timestamp": 1500, "input_length": 100, "output_length": 4},
        {"session_id": "a", "delay": 250, "input_length": 1100, "output_length": 4,
         "hash_ids": [1, 2, 3]},
    ]))
    trace = import_trace("mooncake", path).trace
    a, b = trace.sessions
    assert [r.id for r in a.requests] == ["a/0", "a/1"]
    assert a.requests[0].arrival_s == 0.0 and b.requests[0].arrival_s == 0.5
    assert a.requests[1].depends_on == ("a/0",) and a.requests[1].pause_s == 0.25
    assert a.requests[1].arrival_s is None
    # Hash 2 is partial (88 tokens) in a/0 but full in a/1: different content, different ids.
    assert a.requests[0].blocks[1].tokens == 88 and a.requests[1].blocks[1].tokens == 512
    assert a.requests[0].blocks[1].id != a.requests[1].blocks[1].id
    assert a.requests[0].blocks[0] == a.requests[1].blocks[0]


def _jsonl(path: Path, *rows: Any) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_dynamo_v1_dependencies_delays_and_arrivals(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "d.jsonl",
        {"request_id": "r1", "session_id": "A", "timestamp": 5000, "input_length": 700,
         "output_length": 10, "hash_ids": [1, 2]},
        {"request_id": "r2", "session_id": "A", "wait_for": ["r1"], "delay": 120,
         "tool_wait_ms": 3400, "input_length": 1200, "output_length": 20,
         "hash_ids": [1, 2, 3]},
        {"request_id": "r3", "session_id": "A", "wait_for": ["r1"], "delay": 10,
         "input_length": 900, "output_length": 5, "hash_ids": [1, 7]},
        {"request_id": "r4", "session_id": "A", "wait_for": ["r2", "r3"],
         "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"request_id": "x1", "session_id": "B", "timestamp": 6000, "input_length": 50,
         "output_length": 2},
    )
    trace = import_trace("dynamo", path).trace
    a, b = trace.sessions
    r = {q.id: q for q in a.requests}
    assert r["r1"].arrival_s == 0.0 and b.requests[0].arrival_s == 1.0
    assert r["r2"].depends_on == ("r1",) and r["r2"].pause_s == pytest.approx(3.52)
    assert r["r4"].depends_on == ("r2", "r3") and r["r4"].arrival_s is None
    assert r["r2"].blocks[:2] == r["r4"].blocks[:2]
    assert trace.block_size == 512


def test_dynamo_v2_header_dispatch_and_spawn(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "v2.jsonl",
        {"schema": "dynamo.agentic_trace", "version": 2, "block_size": 64,
         "hash_id_scope": "local"},
        {"request_id": "m0", "session_id": "S", "not_before_ms": 0, "input_length": 64,
         "output_length": 8, "hash_ids": [1], "model": "k3"},
        {"request_id": "s0", "session_id": "S", "input_length": 64, "output_length": 8,
         "dependencies": [{"request_id": "m0", "trigger": "completion", "delay_ms": 50,
                           "relation": "spawn"}]},
        {"request_id": "s1", "session_id": "S", "input_length": 128, "output_length": 8,
         "dependencies": [{"request_id": "s0", "trigger": "completion",
                           "relation": "sequence"}]},
        {"request_id": "m1", "session_id": "S", "input_length": 128, "output_length": 8,
         "dependencies": [{"request_id": "s0", "trigger": "dispatch", "delay_ms": 200,
                           "relation": "sequence"}]},
        {"request_id": "m2", "session_id": "S", "input_length": 128, "output_length": 8,
         "dependencies": [{"request_id": "m1", "trigger": "completion"},
                          {"request_id": "s1", "trigger": "completion", "relation": "join"}]},
    )
    trace = import_trace("dynamo", path).trace
    r = {q.id: q for q in trace.sessions[0].requests}
    assert trace.block_size == 64 and r["m0"].model == "k3"
    assert r["s0"].agent_kind == "subagent" and r["s1"].agent_kind == "subagent"
    assert r["m2"].agent_kind == "main"
    # "200 ms after s0 was sent" = s0's own trigger (m0 done) + s0's pause + 200 ms.
    assert r["m1"].depends_on == ("m0",) and r["m1"].pause_s == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"session_id": "A", "input_length": 5, "output_length": 1}],
         "d.jsonl:1 field request_id: is missing"),
        ([{"request_id": "a", "timestamp": 0, "input_length": 5, "output_length": 1},
          {"request_id": "a", "timestamp": 0, "input_length": 5, "output_length": 1}],
         "d.jsonl:2 field request_id: 'a' is also at"),
        ([{"request_id": "a", "session_id": "A", "timestamp": 0, "input_length": 5,
           "output_length": 1},
          {"request_id": "b", "session_id": "B", "wait_for": ["a"], "input_length": 5,
           "output_length": 1}],
         "d.jsonl:2 field wait_for: request 'a' is not in session 'B'"),
        ([{"request_id": "a", "session_id": "A", "wait_for": ["b"], "input_length": 5,
           "output_length": 1},
          {"request_id": "b", "session_id": "A", "wait_for": ["a"], "input_length": 5,
           "output_length": 1}],
         "field wait_for: dependency cycle"),
        ([{"request_id": "a", "timestamp": 0, "input_length": 5, "output_length": 1,
           "dependencies": [{"request_id": "z", "trigger": "eventually"}]}],
         "dependencies[0] field trigger: must be completion or dispatch"),
        ([{"request_id": "a", "timestamp": 0, "input_length": "5", "output_length": 1}],
         "d.jsonl:1 field input_length: must be a non-negative integer"),
        ([{"request_id": "a", "timestamp": 0, "input_length": 2000, "output_length": 1,
           "hash_ids": [1]}], "field hash_ids: 1 blocks of 512 tokens disagree"),
    ],
)
def test_dynamo_errors_name_line_and_field(tmp_path: Path, rows: list[Any],
                                           message: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", *rows)
    with pytest.raises(TraceError) as info:
        import_trace("dynamo", path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{not json", "w.json: not JSON"),
        ({"id": "x"}, "field requests: is missing"),
        ({"id": "x", "requests": [{"t": 0, "type": "s", "out": 3, "hash_ids": []}]},
         "requests[0] field in: is missing"),
        ({"id": "x", "requests": [{"t": 0, "type": "s", "in": "9", "out": 3}]},
         "requests[0] field in: must be a non-negative integer"),
        ({"id": "x", "requests": [{"t": 0, "type": "s", "in": 100, "out": 3,
                                   "hash_ids": [1, 2, 3]}]},
         "requests[0] field hash_ids: 3 blocks of 64 tokens disagree with the prompt's 100"),
        ({"id": "x", "requests": [{"t": 0, "type": "q", "in": 100, "out": 3}]},
         "requests[0] field type: unknown request type 'q'"),
        ({"id": "x", "requests": [{"type": "s", "in": 100, "out": 3}]},
         "requests[0] field t: is missing"),
        ({"id": "x", "requests": [{"t": -1, "type": "s", "in": 100, "out": 3}]},
         "requests[0] field t: must be a finite non-negative number"),
        ({"id": "x", "requests": [{"t": 0, "type": "subagent", "requests": [
            {"t": 0, "in": 10, "out": "many"}]}]},
         "requests[0].requests[0] field out: must be a non-negative integer"),
    ],
)
def test_weka_errors_name_the_request_and_field(tmp_path: Path, doc: Any, message: str) -> None:
    path = tmp_path / "w.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(TraceError) as info:
        import_trace("weka", path)
    assert message in str(info.value)


def test_weka_directory_rejects_a_duplicate_session(tmp_path: Path) -> None:
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(
            {"id": "same", "requests": [{"t": 0, "in": 5, "out": 1}]}))
    with pytest.raises(TraceError, match=r"b\.json field id: session 'same' is also in"):
        import_trace("weka", tmp_path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "m.jsonl:1: not JSON"),
        ('{"timestamp": 0, "output_length": 3}', "m.jsonl:1 field input_length: is missing"),
        ('{"timestamp": 0, "input_length": 100, "output_length": 3, "hash_ids": [1, 2]}',
         "m.jsonl:1 field hash_ids: 2 blocks of 512 tokens disagree"),
        ('{"timestamp": 0, "input_length": 100, "output_length": 3, "hash_ids": [1, "a"]}',
         "field hash_ids: must be a list of integer block hashes"),
        ('{"timestamp": -4, "input_length": 100, "output_length": 3}',
         "m.jsonl:1 field timestamp: must be a finite non-negative number"),
        ('{"input_length": 100, "output_length": 3}', "m.jsonl:1 field timestamp: is missing"),
        ('{"timestamp": 0, "messages": [], "output_length": 3}',
         "field messages: holds content; import such rows with"),
    ],
)
def test_mooncake_errors_name_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError) as info:
        import_trace("mooncake", path)
    assert message in str(info.value)


SHAREGPT = [
    {"id": "c1", "conversations": [
        {"from": "system", "value": "You are a coding agent. " * 40},
        {"from": "human", "value": "Fix the failing test in parser.py please."},
        {"from": "gpt", "value": "I will read the file first. " * 10},
        {"from": "human", "value": "Here is the file content: " + "x = 1\n" * 100},
        {"from": "gpt", "value": "The bug is on line 3."},
        {"from": "human", "value": "thanks"}]},
    {"id": "c2", "conversations": [
        {"from": "system", "value": "You are a coding agent. " * 40},
        {"from": "human", "value": "Another question entirely."},
        {"from": "gpt", "value": "Sure."}]},
]


def test_openai_messages_turns_reuse_their_history_and_shared_system_prompts(
        tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    result = import_trace("openai-messages", path, ImportOptions(chars_per_token=4.0,
                                                                 pause_s=2.0))
    c1, c2 = result.trace.sessions
    assert [len(s.requests) for s in (c1, c2)] == [2, 1]
    t0, t1 = c1.requests
    full = [b for b in t0.blocks if b.tokens == 64]
    assert t1.blocks[: len(full)] == tuple(full)  # turn 2 starts with turn 1's full blocks
    assert t1.depends_on == (t0.id,) and t1.pause_s == 2.0
    assert t0.output_tokens == round(len("I will read the file first. " * 10) / 4)
    system_tokens = round(len("You are a coding agent. " * 40) / 4)
    shared = system_tokens // 64
    assert shared >= 3 and c2.requests[0].blocks[:shared] == t0.blocks[:shared]
    assert t0.messages is None
    assert any("estimated at 4 characters per token" in n for n in result.notes)
    assert any("unanswered" in n for n in result.notes)


def test_openai_messages_with_a_real_tokenizer_and_kept_content(tmp_path: Path) -> None:
    from agentload.replay.serve.tiny_model import ensure_tiny_model

    model_dir = ensure_tiny_model()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps({"id": c["id"], "messages": [
        {"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
         "content": m["value"]} for m in c["conversations"]]}) for c in SHAREGPT))
    trace = import_trace("openai-messages", path, ImportOptions(
        tokenizer=model_dir, keep_content=True)).trace
    t0 = trace.sessions[0].requests[0]
    msgs = SHAREGPT[0]["conversations"]
    expect_in = sum(len(tok.encode(m["value"], add_special_tokens=False).ids) for m in msgs[:2])
    assert t0.input_tokens == expect_in
    assert t0.output_tokens == len(tok.encode(msgs[2]["value"], add_special_tokens=False).ids)
    assert t0.messages is not None and [m.role for m in t0.messages] == ["system", "user"]


@pytest.mark.parametrize(
    ("doc", "options", "message"),
    [
        ([{"id": "a", "messages": [{"role": "wizard", "content": "hi"}]}], {},
         "field messages[0]: has an unknown role 'wizard'"),
        ([{"id": "a", "messages": "hello"}], {}, "field messages: must be a list"),
        ([{"id": "a", "messages": [{"role": "user", "content": 5}]}], {},
         "field messages[0]: content must be a string"),
        ([{"id": "a", "messages": [{"role": "user", "content": "q"}]}], {},
         "no conversation has an assistant message"),
        (SHAREGPT, {"tokenizer": Path("/nonexistent/tok")}, "tokenizer not found"),
        (SHAREGPT, {"tokenizer": Path("/x"), "chars_per_token": 3.0}, "not both"),
        (SHAREGPT, {"chars_per_token": -1.0}, "--chars-per-token must be positive"),
    ],
)
def test_openai_messages_errors(tmp_path: Path, doc: Any, options: dict[str, Any],
                                message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError) as info:
        import_trace("openai-messages", path, ImportOptions(**options))
    assert message in str(info.value)


def test_formats_are_recognised_from_their_first_record(tmp_path: Path) -> None:
    sharegpt = tmp_path / "c.json"
    sharegpt.write_text(json.dumps(SHAREGPT))
    dyn = _jsonl(tmp_path / "d.jsonl", {"request_id": "a", "timestamp": 0,
                                        "input_length": 5, "output_length": 1})
    native = tmp_path / "n.parquet"
    save_trace(import_trace("weka", WEKA_DIR).trace, native)
    assert detect_format(WEKA_DIR) == "weka"
    assert detect_format(WEKA_DIR / "trace_0291.json") == "weka"
    assert detect_format(MOONCAKE) == "mooncake"
    assert detect_format(dyn) == "dynamo"
    assert detect_format(sharegpt) == "openai-messages"
    assert detect_format(native) == "native"
    assert load_any(MOONCAKE).trace.num_requests == 500
    odd = _jsonl(tmp_path / "odd.jsonl", {"hello": 1})
    with pytest.raises(TraceError, match=r"cannot tell the trace format.*pass --format"):
        detect_format(odd)


HEADER = '{"agentload_trace": 1, "name": "t", "block_size": 64}'


def test_validate_lists_every_problem_with_line_session_request_and_field(
        tmp_path: Path) -> None:
    lines = [
        HEADER,
        # line 2: a cycle, and a negative pause on another request
        '{"session": "s0", "requests": [{"id": "a", "blocks": [[1, 64]], "out": 5, '
        '"deps": ["b"]}, {"id": "b", "blocks": [[1, 64]], "out": 5, "deps": ["a"]}, '
        '{"id": "c", "blocks": [[1, 64]], "out": 5, "pause_s": -2}]}',
        # line 3: a dangling dependency and two bad fields in one request
        '{"session": "s1", "requests": [{"id": "a", "blocks": [[2, 64]], "out": 5, '
        '"deps": ["ghost"]}, {"id": "z", "blocks": [[2, 0]], "out": "x"}]}',
        # line 4: block 1 with another length, a block longer than 64, a mid partial block
        '{"session": "s2", "requests": [{"id": "a", "blocks": [[1, 32], [7, 100], [8, 10], '
        '[9, 64]], "out": 5}]}',
        # line 5: a session id used twice, and block 1 at a third length
        '{"session": "s2", "requests": [{"id": "q", "blocks": [[1, 64]], "out": 1}]}',
        "not json at all",
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = validate_path(path)
    text = [p.describe(str(path)) for p in report.problems]
    expected = [
        ":2: session 's0' request 'a' field deps: dependency cycle a -> b -> a",
        ":2: session 's0' request 'c' field pause_s: pause must be finite and >= 0 s",
        ":3: session 's1' request 'z' field blocks[0]: has 0 tokens",
        ":3: session 's1' request 'z' field out: must be an integer token count",
        ":3: session 's1' request 'a' field deps: depends on 'ghost', which is not a request",
        ":5: session 's2' request 'q' field blocks[0]: block id 1 has 64 tokens here but 32",
        ":4: session 's2' request 'a' field blocks[1]: block 7 holds 100 tokens, more than",
        ":4: warning: session 's2' request 'a' field blocks[2]: block 8 is partial",
        ":5: session 's2' field session: session id appears twice (also at line 4)",
        ":6: not JSON",
    ]
    for want in expected:
        assert any(want in t for t in text), (want, text)
    assert report.errors == len(expected) - 1 and report.warnings == 2  # blocks[0], [2]
    proc = run_cli("traces", "validate", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stdout.count(str(path)) == len(expected) + 1
    assert "9 error(s), 2 warning(s)" in proc.stderr


def test_validate_accepts_clean_files_of_every_kind(tmp_path: Path) -> None:
    out = tmp_path / "w.parquet"
    save_trace(import_trace("weka", WEKA_DIR).trace, out)
    for src in (WEKA_DIR, MOONCAKE, out):
        proc = run_cli("traces", "validate", str(src))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ": ok," in proc.stdout


def test_cli_import_stats_and_help(tmp_path: Path) -> None:
    out = tmp_path / "weka.jsonl"
    proc = run_cli("traces", "import", "weka", str(WEKA_DIR), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "imported 46 requests (12 subagent) in 4 sessions" in proc.stdout
    stats = json.loads(run_cli("traces", "stats", str(out), "--json").stdout)
    for key in ("sessions", "requests", "subagent_requests", "input_tokens", "output_tokens",
                "theoretical_prefix_cache_hit_rate"):
        assert key in stats
    assert stats["input_tokens"] == 3_549_243 and stats["output_tokens"] == 23_248
    assert 0.8 < stats["theoretical_prefix_cache_hit_rate"] < 0.95
    direct = json.loads(run_cli("traces", "stats", str(MOONCAKE), "--json").stdout)
    assert direct["requests"] == 500 and direct["open_loop_requests"] == 500
    help_text = run_cli("traces", "import", "weka", "--help").stdout
    assert "Dropped" in help_text and "think_time" in help_text
    bad = run_cli("traces", "import", "mooncake", str(tmp_path / "missing.jsonl"), "-o",
                  str(tmp_path / "x.jsonl"))
    assert bad.returncode == 2 and bad.stderr.startswith("agentload: error: trace source not")


def test_weka_hash_ids_of_the_ceil_length_rule_import(tmp_path: Path) -> None:
    # Scaled WEKA files hash the partial last block too: ceil(in / 64) ids (AIPerf's rule).
    doc = {"id": "scaled", "block_size": 64, "requests": [
        {"t": 0, "type": "s", "in": 100, "out": 3, "hash_ids": [7, 8]},
        {"t": 5, "type": "s", "in": 100, "out": 3, "hash_ids": [7, 8]},
        {"t": 9, "type": "s", "in": 128, "out": 3, "hash_ids": [7, 8]},
    ]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(doc))
    a, b, c = import_trace("weka", path).trace.sessions[0].requests
    assert [blk.tokens for blk in a.blocks] == [64, 36]
    assert a.blocks == b.blocks  # the same partial hash at the same length is shared
    assert c.blocks[0] == a.blocks[0] and c.blocks[1] != a.blocks[1]  # full block 8 is not
    assert [blk.tokens for blk in c.blocks] == [64, 64]
