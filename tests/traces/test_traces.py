"""The trace model and its native JSONL and Parquet files (the synthesizer: test_synth)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentload.traces import (
    Block,
    Message,
    RecordedTiming,
    Request,
    Session,
    Trace,
    TraceError,
    read_trace,
    write_trace,
)
from agentload.traces.model import prefix_hit_tokens, theoretical_prefix_hits
from tests.support import run_cli

seconds_st = st.floats(0, 1e6, allow_nan=False)
blocks_st = st.lists(st.builds(Block, id=st.integers(0, 10**9), tokens=st.integers(1, 512)),
                     min_size=1, max_size=8).map(tuple)


@st.composite
def sessions_st(draw: st.DrawFn, sid: str) -> Session:
    n = draw(st.integers(1, 6))
    reqs = []
    for i in range(n):
        deps = tuple(sorted(draw(st.sets(st.sampled_from([r.id for r in reqs]), max_size=2))
                            )) if reqs else ()
        reqs.append(Request(
            id=f"{sid}/{i}", session_id=sid, blocks=draw(blocks_st),
            output_tokens=draw(st.integers(1, 4096)), depends_on=deps,
            pause_s=draw(st.floats(0, 100, allow_nan=False)),
            agent_id=draw(st.sampled_from(["main", "sa1"])),
            agent_kind=draw(st.sampled_from(["main", "subagent", "aux"])),
            model=draw(st.none() | st.text(min_size=1, max_size=8)),
            recorded=draw(st.none() | st.builds(
                RecordedTiming, t=st.none() | seconds_st, api_time=st.none() | seconds_st,
                ttft=st.none() | seconds_st)),
            arrival_s=draw(st.none() | seconds_st),
            messages=draw(st.none() | st.lists(st.builds(
                Message, role=st.sampled_from(["system", "user", "assistant", "tool"]),
                content=st.text(max_size=40)), max_size=3).map(tuple)),
        ))
    return Session(id=sid, requests=tuple(reqs))


@st.composite
def traces_st(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 4))
    return Trace(name=draw(st.text(min_size=1, max_size=10)),
                 sessions=tuple(draw(sessions_st(f"s{i}")) for i in range(n)),
                 block_size=draw(st.sampled_from([16, 64, 512])))


@settings(max_examples=60, deadline=None)
@given(trace=traces_st())
def test_native_jsonl_round_trip_is_lossless(trace: Trace, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace


def test_prefix_hits_count_only_a_leading_run_and_give_back_the_last_block() -> None:
    a, b, c = Block(1, 64), Block(2, 64), Block(3, 32)
    assert prefix_hit_tokens((a, b, c), {1, 3}) == 64  # block 3 is seen but not a prefix
    assert prefix_hit_tokens((a, b), {1, 2}) == 64  # fully cached: the last block recomputes
    assert prefix_hit_tokens((a,), set()) == 0
    reqs = [Request("r0", "s", (a, b), 4), Request("r1", "s", (a, b, c), 4, ("r0",))]
    assert theoretical_prefix_hits(reqs) == [0, 128]


def _write_lines(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


HEADER = '{"agentload_trace": 1, "name": "t", "block_size": 64}'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"session": "s0", "requests": [{"id": "a", "blocks": [[1, 64]], "out": 0}]}',
         ":2: session 's0' request 'a' field out: asks for 0 output tokens"),
        ('{"session": "s0", "requests": [{"id": "a", "blocks": [[1, 64]], "out": 5, '
         '"deps": ["zz"]}]}', "depends on 'zz'"),
        ('{"session": "s0", "requests": [{"id": "a", "blocks": [[1]], "out": 5}]}',
         "field blocks[0]: must be [block id, token count]"),
        ('{"session": "s0", "requests": [{"id": "a", "blocks": [[1, 64]], "out": 5, '
         '"pause_s": -1}]}', "field pause_s: pause must be finite and >= 0 s"),
        ('{"session": "s0", "requests": [{"id": "a", "blocks": [[1, 64]], "out": 5, '
         '"kind": "boss"}]}', 'field kind: must be one of'),
        ('{"session": "s0"', ":2: not JSON"),
    ],
)
def test_bad_lines_name_line_session_request_and_field(tmp_path: Path, line: str,
                                                         message: str) -> None:
    path = _write_lines(tmp_path / "bad.jsonl", HEADER, line)
    with pytest.raises(TraceError, match=r"bad\.jsonl") as info:
        read_trace(path)
    assert message in str(info.value)


def test_missing_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="trace file not found"):
        read_trace(tmp_path / "nope.jsonl")
    foreign = _write_lines(tmp_path / "weka.json", '{"id": "trace_1", "requests": []}')
    with pytest.raises(TraceError, match="not an agentload trace"):
        read_trace(foreign)


@settings(max_examples=40, deadline=None)
@given(trace=traces_st())
def test_native_parquet_round_trip_is_lossless(trace: Trace, tmp_path_factory) -> None:
    from agentload.traces.files import load_native, save_trace

    path = tmp_path_factory.mktemp("rt") / "t.parquet"
    save_trace(trace, path)
    assert load_native(path) == trace


def test_trace_meta_survives_both_native_forms(tmp_path: Path) -> None:
    from agentload.traces.files import load_native, save_trace

    trace = Trace("m", (Session("s", (Request("s/0", "s", (Block(1, 4),), 2),)),),
                  meta={"scale_context": "0.1", "max_context": "8192"})
    for name in ("m.jsonl", "m.parquet"):
        save_trace(trace, tmp_path / name)
        assert load_native(tmp_path / name).meta == trace.meta


def test_import_help_flows_source_wrapped_text_into_paragraphs() -> None:
    from agentload.traces.cli import flowed

    assert flowed("one\ntwo  three\n\nfour\nfive") == "one two three\n\nfour five"
    result = run_cli("traces", "import", "weka", "--help")
    # Rich wraps the help itself: no line of the mapping breaks after one word.
    body = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    assert not [line for line in body if line in ("Main", "kind", "first", "counts from")]
