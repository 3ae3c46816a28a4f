"""``agentload traces export``: round trips, scaled exports, bad input, and AIPerf's loader.

A round trip import -> export -> import must give back what the format holds: the
sessions, each request's input and output length, its pause (within rounding), its
dependencies where the format can say them, and the prefix sharing a prefix cache sees.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import orjson
import pytest

from agentload.cli import main
from agentload.replay.engine.fit import FitOptions, fit_trace
from agentload.replay.engine.prompts import TokenPrompts
from agentload.traces import Request, Session, Trace, TraceError
from agentload.traces.formats import import_trace
from agentload.traces.formats._export import ExportFormat, PrefixBlocks
from agentload.traces.formats.export import EXPORTS, export_trace
from agentload.traces.model import Block, theoretical_prefix_hits
from agentload.traces.synth import make_config, synthesize
from tests.support import DATA, ROOT

WEKA = DATA / "weka"
MOONCAKE = DATA / "mooncake" / "synthetic_trace_head500.jsonl"
AIPERF_PYTHON = ROOT / ".peers" / "aiperf" / "bin" / "python"


def _chains(session: Session) -> dict[tuple[str, int], Request]:
    """Requests by (agent, place in that agent's chain): ids the importer may rename."""
    seen: dict[str, int] = {}
    out = {}
    for req in session.requests:
        k = seen[req.agent_id] = seen.get(req.agent_id, -1) + 1
        out[(req.agent_id, k)] = req
    return out


def _assert_same_workload(before: Trace, after: Trace, *, kinds: bool = True) -> None:
    """Sessions, lengths, pauses, dependencies and prefix hits agree, request for request."""
    assert [s.id for s in after.sessions] == [s.id for s in before.sessions]
    for s1, s2 in zip(before.sessions, after.sessions, strict=True):
        a, b = _chains(s1), _chains(s2)
        assert a.keys() == b.keys()
        key_of = {r.id: key for key, r in a.items()}
        new_id = {r.id: b[key_of[r.id]].id for r in s1.requests}
        for key, r1 in a.items():
            r2 = b[key]
            assert (r2.input_tokens, r2.output_tokens) == (r1.input_tokens, r1.output_tokens)
            assert r2.pause_s == pytest.approx(r1.pause_s, abs=2e-3), key
            assert set(r2.depends_on) == {new_id[d] for d in r1.depends_on}, key
            assert r2.model == r1.model or r1.model is None
            if kinds:
                assert r2.agent_kind == r1.agent_kind
        # The same prefix hits, request for request (the re-import lists them in file order).
        hits1 = dict(zip([r.id for r in s1.requests],
                         theoretical_prefix_hits(list(s1.requests)), strict=True))
        hits2 = dict(zip([r.id for r in s2.requests],
                         theoretical_prefix_hits(list(s2.requests)), strict=True))
        assert {new_id[i]: h for i, h in hits1.items()} == hits2


def test_weka_round_trip_keeps_lengths_pauses_subagents_and_prefix_sharing(
        tmp_path: Path) -> None:
    trace = import_trace("weka", WEKA).trace
    result = export_trace(trace, "weka", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in WEKA.glob("*.json"))
    assert (result.sessions, result.requests) == (4, 46)
    assert result.notes == ()  # the WEKA fixtures hold nothing WEKA cannot
    again = import_trace("weka", tmp_path / "out").trace
    _assert_same_workload(trace, again)
    assert [r.id for r in again.requests()] == [r.id for r in trace.requests()]
    for r1, r2 in zip(trace.requests(), again.requests(), strict=True):
        assert r2.recorded is not None and r1.recorded is not None
        assert r2.recorded.api_time == r1.recorded.api_time
        assert r2.recorded.ttft == r1.recorded.ttft
    # Exporting the re-import writes the same bytes: nothing drifts on a second trip.
    export_trace(again, "weka", tmp_path / "out2")
    for path in (tmp_path / "out").iterdir():
        assert (tmp_path / "out2" / path.name).read_bytes() == path.read_bytes()


def test_weka_files_hold_only_the_schema_fields(tmp_path: Path) -> None:
    export_trace(import_trace("weka", WEKA).trace, "weka", tmp_path / "w")
    doc = json.loads((tmp_path / "w" / "trace_0291.json").read_text())
    assert set(doc) == {"id", "models", "block_size", "hash_id_scope", "requests"}
    assert (doc["block_size"], doc["hash_id_scope"]) == (64, "local")
    subs = [e for e in doc["requests"] if e["type"] == "subagent"]
    assert [e["agent_id"] for e in subs] == ["agent_001", "agent_002"]
    for entry in subs:
        assert set(entry) <= {"t", "type", "agent_id", "subagent_type", "status", "requests",
                              "models", "duration_ms"}
        assert all(r["t"] >= entry["t"] for r in entry["requests"])  # stamped from 0
    for req in [e for e in doc["requests"] if e["type"] == "s"]:
        assert set(req) <= {"t", "type", "model", "in", "out", "hash_ids", "api_time",
                            "think_time", "ttft"}
        assert len(req["hash_ids"]) == req["in"] // 64


def test_synthesized_subagents_and_aux_calls_survive_weka(tmp_path: Path) -> None:
    config = make_config("agentx-coding", sessions=8, seed=3, scale_context=0.05)
    trace = synthesize(config)
    assert any(r.agent_kind == "subagent" for r in trace.requests())
    export_trace(trace, "weka", tmp_path / "w")
    _assert_same_workload(trace, import_trace("weka", tmp_path / "w").trace)


def test_aux_chains_become_subagents_that_join_nothing(tmp_path: Path) -> None:
    blocks = (Block(1, 64), Block(2, 64))
    requests = (
        Request("m0", "s", blocks, 5),
        Request("x0", "s", blocks[:1], 3, depends_on=("m0",), pause_s=0.5, agent_id="aux1",
                agent_kind="aux"),
        Request("m1", "s", (*blocks, Block(3, 64)), 5, depends_on=("m0",), pause_s=2.0),
    )
    trace = Trace("t", (Session("s", requests),))
    result = export_trace(trace, "weka", tmp_path / "w")
    assert any("aux" in n for n in result.notes)
    again = import_trace("weka", tmp_path / "w").trace
    _assert_same_workload(trace, again, kinds=False)
    entry = json.loads((tmp_path / "w" / "s.json").read_text())["requests"][1]
    assert (entry["type"], entry["subagent_type"]) == ("subagent", "aux")


def test_mooncake_round_trip_keeps_rows_arrivals_and_prefix_sharing(tmp_path: Path) -> None:
    trace = import_trace("mooncake", MOONCAKE).trace
    export_trace(trace, "mooncake", tmp_path / "m.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    src = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in rows] == [
        (r["timestamp"], r["input_length"], r["output_length"]) for r in src]
    again = import_trace("mooncake", tmp_path / "m.jsonl").trace
    assert [r.arrival_s for r in again.requests()] == [r.arrival_s for r in trace.requests()]
    hits = theoretical_prefix_hits(list(trace.requests()))
    assert theoretical_prefix_hits(list(again.requests())) == hits
    assert sum(hits) > 0


def test_mooncake_sessions_are_chains_with_delays(tmp_path: Path) -> None:
    trace = synthesize(make_config("agentx-coding", sessions=4, seed=1, scale_context=0.05))
    result = export_trace(trace, "mooncake", tmp_path / "m.jsonl")
    again = import_trace("mooncake", tmp_path / "m.jsonl").trace
    assert {s.id for s in again.sessions} == {s.id for s in trace.sessions}
    side_by_side = 0
    for s1 in trace.sessions:
        s2 = next(s for s in again.sessions if s.id == s1.id)
        assert [(r.input_tokens, r.output_tokens) for r in s2.requests] == [
            (r.input_tokens, r.output_tokens) for r in s1.requests]
        assert [r.pause_s for r in s2.requests] == pytest.approx(
            [r.pause_s for r in s1.requests], abs=1e-6)
        side_by_side += any(r.agent_kind != "main" for r in s1.requests)
    if side_by_side:
        assert any("not one chain" in n for n in result.notes)


def test_aiperf_jsonl_is_one_session_a_line(tmp_path: Path) -> None:
    trace = import_trace("weka", WEKA).trace
    export_trace(trace, "aiperf-jsonl", tmp_path / "a.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [x["session_id"] for x in lines] == [s.id for s in trace.sessions]
    for line, session in zip(lines, trace.sessions, strict=True):
        assert [(t["input_length"], t["output_length"]) for t in line["turns"]] == [
            (r.input_tokens, r.output_tokens) for r in session.requests]
        assert line["turns"][0]["timestamp"] == 0
        assert [t["delay"] / 1000 for t in line["turns"][1:]] == pytest.approx(
            [r.pause_s for r in session.requests[1:]])


def test_scaled_export_sends_what_replay_sends(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """ISL / OSL of every exported request == the prompt replay builds after fitting."""
    fit = FitOptions(scale_tokens=0.1, max_context=4096)
    fitted, report = fit_trace(import_trace("weka", WEKA).trace, fit)
    assert report.requests_truncated > 0  # the cap bites, not only the scale
    _cli("traces", "export", "weka", str(WEKA), "-o", str(tmp_path / "w"),
         "--scale-tokens", "0.1", "--max-context", "4096")
    out = capsys.readouterr().out
    assert out.startswith("exported 4 sessions, 46 requests (")
    assert "prompts cut" in out
    sent = {r.id: r for r in fitted.requests()}
    prompts = TokenPrompts(salt=7)
    for req in import_trace("weka", tmp_path / "w").trace.requests():
        assert req.input_tokens == len(prompts.prompt(sent[req.id].blocks))
        assert req.output_tokens == sent[req.id].output_tokens
        assert req.input_tokens + req.output_tokens <= 4096
    # The same numbers in the row formats.
    _cli("traces", "export", "mooncake", str(WEKA), "-o", str(tmp_path / "m.jsonl"),
         "--scale-tokens", "0.1", "--max-context", "4096")
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted((r["input_length"], r["output_length"]) for r in rows) == sorted(
        (r.input_tokens, r.output_tokens) for r in fitted.requests())


def _cli(*args: str) -> int:
    """Run the agentload command in this process; its exit status (0 when it returns)."""
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.mark.parametrize(("args", "fragment"), [
    (["csv", str(WEKA)], "unknown export format 'csv'"),
    (["weka", "no/such/trace.jsonl"], "not found"),
    (["mooncake", str(ROOT / "pyproject.toml")], "pyproject.toml"),
    (["weka", str(WEKA), "--scale-tokens", "0"], "--scale-tokens must be positive"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            args: list[str], fragment: str) -> None:
    out = tmp_path / "out"
    assert _cli("traces", "export", args[0], args[1], "-o", str(out), *args[2:]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agentload: error:") and "\n" not in err and fragment in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing left behind


def test_existing_output_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m.jsonl"
    out.write_text("keep me\n")
    assert _cli("traces", "export", "mooncake", str(MOONCAKE), "-o", str(out)) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"agentload: error: {out} exists; pass --force to replace it"
    assert out.read_text() == "keep me\n"
    assert _cli("traces", "export", "mooncake", str(MOONCAKE), "-o", str(out), "--force") == 0
    assert out.read_text().count("\n") == 500
    # A folder that holds other things is never replaced, --force or not.
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert _cli("traces", "export", "weka", str(WEKA), "-o", str(folder), "--force") == 2
    assert "more than .json files" in capsys.readouterr().err
    assert _cli("traces", "export", "weka", str(WEKA), "-o", str(out), "--force") == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_failed_export_leaves_nothing_behind(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_fail(trace: Trace, path: Path, notes: object) -> None:
        (path / "a.json").write_text("{}")
        raise TraceError("disk full, say")

    broken = ExportFormat("weka", "x", "x", directory=True, write=half_then_fail)
    monkeypatch.setitem(EXPORTS, "weka", broken)
    trace = import_trace("weka", WEKA).trace
    out = tmp_path / "w"
    out.mkdir()
    (out / "old.json").write_text("{}")
    with pytest.raises(TraceError, match="disk full"):
        export_trace(trace, "weka", out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["w"]
    assert [p.name for p in out.iterdir()] == ["old.json"]  # the old export is untouched


def test_prefix_blocks_name_prefixes_not_contents() -> None:
    blocks = PrefixBlocks(4)
    a = blocks.ids([Block(1, 3), Block(2, 6)], partial=True)  # 9 tokens: 4 + 4 + 1
    b = blocks.ids([Block(1, 3), Block(2, 5)], partial=False)  # same first 8 tokens
    c = blocks.ids([Block(9, 1), Block(1, 3), Block(2, 4)], partial=False)
    assert len(a) == 3 and b == a[:2]
    assert not set(c) & set(a)  # shifted by a token: no block is the same prefix


AIPERF_CHECK = """
import json, pathlib, sys
import orjson
from aiperf.dataset.loader.models import MooncakeTrace
from aiperf.dataset.loader.weka_trace_models import WekaSubagentEntry, WekaTrace
from aiperf.dataset.loader.weka_trace import _sa_end_seconds
for line in pathlib.Path(sys.argv[2]).read_bytes().splitlines():
    MooncakeTrace.model_validate(orjson.loads(line))
joins = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    trace = WekaTrace.model_validate(orjson.loads(path.read_bytes()))
    parents = [(i, r) for i, r in enumerate(trace.requests)
               if not isinstance(r, WekaSubagentEntry)]
    for i, entry in enumerate(trace.requests):
        if isinstance(entry, WekaSubagentEntry):
            # AIPerf's rule: the first later parent turn at or after the subagent's end.
            later = [k for k, (j, r) in enumerate(parents)
                     if j > i and r.t + 1e-6 >= _sa_end_seconds(entry)]
            joins[trace.id + "/" + entry.agent_id] = later[0] if later else None
print(json.dumps(joins))
"""


@pytest.mark.skipif(not AIPERF_PYTHON.exists(),
                    reason="no AIPerf peer venv at .peers/aiperf (make peers builds it)")
@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_aiperf_loads_the_exported_weka_folder_and_joins_alike(tmp_path: Path,
                                                               scale: float) -> None:
    """AIPerf 0.13.0's strict WEKA model takes every file (and its Mooncake model every
    row), and AIPerf joins each subagent to the main turn agentload's importer does."""
    trace = synthesize(make_config("agentx-coding", sessions=6, seed=5, scale_context=0.05))
    weka = import_trace("weka", WEKA).trace
    both = Trace("both", weka.sessions + trace.sessions)
    fitted, _ = fit_trace(both, FitOptions(scale_tokens=scale, max_context=8192))
    export_trace(fitted, "weka", tmp_path / "w")
    export_trace(fitted, "mooncake", tmp_path / "m.jsonl")
    proc = subprocess.run([str(AIPERF_PYTHON), "-c", AIPERF_CHECK, str(tmp_path / "w"),
                           str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    aiperf_joins = orjson.loads(proc.stdout)
    # agentload's reading of the same files: which main turn waits for each subagent.
    ours = {}
    for session in import_trace("weka", tmp_path / "w").trace.sessions:
        main_turns = [r for r in session.requests if r.agent_kind == "main"]
        lasts = {r.agent_id: r.id for r in session.requests if r.agent_kind != "main"}
        for agent, last in lasts.items():
            ours[f"{session.id}/{agent}"] = next(
                (k for k, r in enumerate(main_turns) if last in r.depends_on), None)
    assert aiperf_joins == ours
    assert any(v is not None for v in ours.values())


def test_nested_subagents_move_under_the_main_chain(tmp_path: Path) -> None:
    inner = {"t": 1.0, "type": "subagent", "agent_id": "inner", "duration_ms": 1000,
             "requests": [{"t": 0.0, "type": "s", "in": 70, "out": 5, "hash_ids": [9]}]}
    outer = {"t": 5.0, "type": "subagent", "agent_id": "outer", "duration_ms": 4000,
             "requests": [{"t": 0.0, "type": "s", "in": 64, "out": 5, "hash_ids": [5],
                           "api_time": 0.5}, inner,
                          {"t": 3.0, "type": "s", "in": 128, "out": 5, "hash_ids": [5, 6]}]}
    doc = {"id": "nest", "block_size": 64, "requests": [
        {"t": 0.0, "type": "s", "in": 64, "out": 3, "hash_ids": [1], "api_time": 1.0},
        outer, {"t": 20.0, "type": "s", "in": 100, "out": 3, "hash_ids": [1]}]}
    (tmp_path / "nest.json").write_text(json.dumps(doc))
    result = export_trace(import_trace("weka", tmp_path / "nest.json").trace, "weka",
                          tmp_path / "w")
    assert any("spawned by a subagent" in n for n in result.notes)
    assert any("re-import differs" in n for n in result.notes)
    written = json.loads((tmp_path / "w" / "nest.json").read_text())
    entries = [e for e in written["requests"] if e["type"] == "subagent"]
    assert [e["agent_id"] for e in entries] == ["outer", "inner"]  # one level, by start
    assert all(r["type"] in ("s", "n") for e in entries for r in e["requests"])


def test_subagent_times_from_the_conversation_start_read_as_absolute(tmp_path: Path) -> None:
    """What export writes, and what current captures hold (AIPerf's reading of "t")."""
    sub = {"t": 5.0, "type": "subagent", "agent_id": "a", "subagent_type": "Explore",
           "status": "completed", "models": ["m"], "duration_ms": 3000, "requests": [
               {"t": 5.0, "type": "s", "model": "m", "in": 64, "out": 2, "api_time": 1.0},
               {"t": 7.0, "type": "s", "model": "m", "in": 64, "out": 2, "api_time": 1.0}]}
    doc = {"id": "abs", "models": ["m"], "block_size": 64, "hash_id_scope": "local",
           "requests": [{"t": 0.0, "type": "s", "model": "m", "in": 64, "out": 2,
                         "api_time": 1.0}, sub,
                        {"t": 9.0, "type": "s", "model": "m", "in": 64, "out": 2}]}
    (tmp_path / "abs.json").write_text(json.dumps(doc))
    by_id = {r.id: r for r in import_trace("weka", tmp_path / "abs.json").trace.requests()}
    assert [by_id[f"abs/sa:a/{k}"].recorded.t for k in (0, 1)] == [5.0, 7.0]  # type: ignore[union-attr]
    assert by_id["abs/sa:a/1"].pause_s == 1.0  # 7 - (5 + 1)
    assert by_id["abs/1"].depends_on == ("abs/0", "abs/sa:a/1")  # ended at 8, joined at 9
