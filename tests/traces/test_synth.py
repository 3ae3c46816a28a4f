"""The synthesizer: distributions, presets (demo, agentx-coding, fixed), TOML and the CLI."""

from __future__ import annotations

import itertools
import random
import statistics
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentload.traces import SynthConfig, Trace, TraceError, demo_trace_path, read_trace
from agentload.traces.cli import trace_stats
from agentload.traces.files import load_native
from agentload.traces.model import Request, theoretical_prefix_hits
from agentload.traces.native import write_trace
from agentload.traces.synth import (
    PRESETS,
    Constant,
    FixedConfig,
    LogNormal,
    Uniform,
    agentx_coding,
    make_config,
    parse_dist,
    synthesize,
)
from agentload.traces.synth_cli import Preset
from tests.support import run_cli

EXAMPLE_TOML = Path(__file__).resolve().parents[2] / "traces" / "data" / "agentx_coding.toml"


def _agentx(**flags: object) -> Trace:
    config = make_config("agentx-coding", **flags)  # type: ignore[arg-type]
    return synthesize(config)


@pytest.fixture(scope="module")
def agentx_200() -> Trace:
    return _agentx(sessions=200, seed=1)


def _main(requests: tuple[Request, ...] | list[Request]) -> list[Request]:
    return [r for r in requests if r.agent_kind == "main"]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("agentload: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --- the demo preset and the bundled file ---------------------------------------------


def test_bundled_demo_trace_is_the_default_synthesis(tmp_path: Path) -> None:
    assert read_trace(demo_trace_path()) == synthesize(SynthConfig())
    write_trace(synthesize(SynthConfig()), tmp_path / "demo.jsonl")
    assert (tmp_path / "demo.jsonl").read_bytes() == demo_trace_path().read_bytes()
    assert make_config() == make_config("demo") == SynthConfig()


def test_demo_trace_shape() -> None:
    stats = trace_stats(demo_trace_path())
    assert stats["sessions"] == 8
    assert stats["requests"] == 49
    assert stats["subagent_requests"] == 2
    # Prompts grow by whole 64-token blocks and stay well inside the tiny model's context.
    assert stats["max_input_tokens"] <= 8192
    trace = read_trace(demo_trace_path())
    for session in trace.sessions:
        main = _main(session.requests)
        for prev, cur in itertools.pairwise(main):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks  # exact reuse of the context
            assert 1.0 <= cur.pause_s <= 4.0
        assert all(b.tokens == 64 for r in session.requests for b in r.blocks)


def test_synthesis_is_deterministic_and_seeded() -> None:
    assert synthesize(SynthConfig(seed=3)) == synthesize(SynthConfig(seed=3))
    assert synthesize(SynthConfig(seed=3)) != synthesize(SynthConfig(seed=4))
    assert _agentx(seed=5, sessions=6) == _agentx(seed=5, sessions=6)
    assert _agentx(seed=5, sessions=6) != _agentx(seed=6, sessions=6)


def test_cli_demo_preset_rewrites_the_bundled_file(tmp_path: Path) -> None:
    proc = run_cli("traces", "synth", "--preset", "demo", "-o", str(tmp_path / "d.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "d.jsonl").read_bytes() == demo_trace_path().read_bytes()
    assert proc.stdout.strip() == (f"wrote {tmp_path / 'd.jsonl'}: demo-agentx, 8 sessions, "
                                   "49 requests (2 subagent), 82,048 input tokens, "
                                   "3,443 output tokens")


# --- distributions ---------------------------------------------------------------------


def test_uniform_counts_use_randint_and_seconds_use_uniform() -> None:
    a, b = random.Random(11), random.Random(11)
    assert [Uniform(3, 8).sample_int(a) for _ in range(50)] == [b.randint(3, 8)
                                                                 for _ in range(50)]
    assert [Uniform(1.0, 4.0).sample(a) for _ in range(5)] == [b.uniform(1.0, 4.0)
                                                               for _ in range(5)]
    # A constant takes nothing from the generator, so adding one keeps later draws.
    assert Constant(5).sample_int(a) == 5
    assert a.random() == b.random()


def test_lognormal_median_and_clamps() -> None:
    rng = random.Random(3)
    free = [LogNormal(300, 0.9).sample(rng) for _ in range(20_000)]
    assert 285 < statistics.median(free) < 315
    clamped = [LogNormal(300, 0.9, 16, 4000).sample_int(rng) for _ in range(20_000)]
    assert min(clamped) >= 16 and max(clamped) <= 4000
    assert all(isinstance(x, int) for x in clamped)
    assert max(clamped) == 4000  # sigma 0.9 reaches past 4000 about 1 in 2000 draws
    assert LogNormal(7, 0).sample(rng) == pytest.approx(7)


@pytest.mark.parametrize(("value", "expected"), [
    (5, Constant(5)),
    (2.5, Constant(2.5)),
    ([1, 6], Uniform(1, 6)),
    ({"dist": "uniform", "min": 1, "max": 6}, Uniform(1, 6)),
    ({"dist": "constant", "value": 3}, Constant(3)),
    ({"dist": "lognormal", "median": 300, "sigma": 0.9, "min": 16, "max": 4000},
     LogNormal(300, 0.9, 16, 4000)),
    ({"dist": "lognormal", "median": 3, "sigma": 0.5}, LogNormal(3, 0.5)),
])
def test_parse_dist(value: object, expected: object) -> None:
    assert parse_dist(value) == expected


@pytest.mark.parametrize(("value", "message"), [
    ({"dist": "lognormal", "median": 0, "sigma": 1}, "lognormal needs median > 0"),
    ({"dist": "lognormal", "median": 5, "sigma": -1}, "lognormal needs sigma >= 0"),
    ({"dist": "lognormal", "median": 5, "sigma": 1, "min": 9, "max": 2},
     "lognormal needs min <= max"),
    ({"dist": "lognormal", "median": 5}, "'sigma' is missing"),
    ({"dist": "lognormal", "median": 5, "sigma": 1, "mean": 3}, "unexpected 'mean'"),
    ({"dist": "lognormal", "median": "5", "sigma": 1}, "median must be a number"),
    ({"dist": "normal", "mean": 5}, "dist = one of"),
    ([6, 1], "uniform needs low <= high"),
    ([1, 2, 3], "a range is [low, high]"),
    ("many", "must be a number, [low, high] or a {dist = ...} table, got a string"),
    (True, "got a boolean"),
])
def test_parse_dist_errors(value: object, message: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_dist(value)
    assert message in str(info.value)


# --- agentx-coding ---------------------------------------------------------------------


def test_agentx_lengths_and_outputs_match_the_measured_traces(agentx_200: Trace) -> None:
    requests = list(agentx_200.requests())
    main = _main(requests)
    # Measured: main OSL median 284; main turns per session 3/4/7/20.
    assert 255 <= statistics.median(r.output_tokens for r in main) <= 315
    assert max(r.output_tokens for r in main) > 3000  # the long tail
    turns = [len(_main(s.requests)) for s in agentx_200.sessions]
    assert 5 <= statistics.median(turns) <= 8 and min(turns) >= 2
    # Every session starts from the same 15,360-token prefix (240 blocks).
    prefix = agentx_200.sessions[0].requests[0].blocks[:240]
    assert sum(b.tokens for b in prefix) == 15_360
    assert all(s.requests[0].blocks[:240] == prefix for s in agentx_200.sessions)
    s0, s1 = (s.requests[0].blocks[240] for s in agentx_200.sessions[:2])
    assert s0 != s1  # what follows the prefix is each session's own
    first = [s.requests[0].input_tokens for s in agentx_200.sessions]
    assert 20_000 <= statistics.median(first) <= 35_000  # prefix + median 9.6k, long tail
    assert max(first) > 100_000
    assert max(r.input_tokens + r.output_tokens for r in requests) <= 200_000


def test_agentx_contexts_grow_by_reuse(agentx_200: Trace) -> None:
    growth = []
    for session in agentx_200.sessions:
        for prev, cur in itertools.pairwise(_main(session.requests)):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks
            # At least the previous answer and one tool-result block come back.
            assert cur.input_tokens >= prev.input_tokens + prev.output_tokens + 64
            growth.append(cur.input_tokens - prev.input_tokens)
            assert 1.0 <= cur.pause_s <= 600.0
        assert _main(session.requests)[0].pause_s == 0
    # Measured growth per main turn: median 504 tokens, P90 4,024.
    assert 448 <= statistics.median(growth) <= 832
    assert 2_500 <= sorted(growth)[int(0.9 * len(growth))] <= 6_000
    pauses = [r.pause_s for r in _main(list(agentx_200.requests())) if r.pause_s]
    assert 12 <= statistics.median(pauses) <= 20  # measured median 16 s


def test_agentx_subagents_fan_out_and_join(agentx_200: Trace) -> None:
    requests = list(agentx_200.requests())
    share = sum(r.agent_kind == "subagent" for r in requests) / len(requests)
    assert 0.15 <= share <= 0.35  # measured 12 of 46 requests
    fanouts = []
    explore_prefix = next(r for r in requests if r.agent_kind == "subagent").blocks[:139]
    for session in agentx_200.sessions:
        by_id = {r.id: r for r in session.requests}
        agents: dict[str, list[Request]] = {}
        for r in session.requests:
            if r.agent_kind == "subagent":
                agents.setdefault(r.agent_id, []).append(r)
        if not agents:
            continue
        fanouts.append(len(agents))
        parents = {chain[0].depends_on for chain in agents.values()}
        assert len(parents) == 1  # all spawned after one main request
        (parent,) = next(iter(parents))
        assert by_id[parent].agent_kind == "main"
        joins = [r for r in session.requests if r.agent_kind == "main"
                 and any(chain[-1].id in r.depends_on for chain in agents.values())]
        for chain in agents.values():
            assert 5 <= len(chain) <= 7
            # The Explore prefix (139 blocks) is shared; then a 36-42 block task message.
            assert chain[0].blocks[:139] == explore_prefix
            assert 36 <= len(chain[0].blocks) - 139 <= 42
            for prev, cur in itertools.pairwise(chain):
                assert cur.depends_on == (prev.id,)
                assert cur.blocks[: len(prev.blocks)] == prev.blocks
                assert 1.0 <= cur.pause_s <= 60.0
            # The first read: ~50k tokens beyond the first answer.
            jump = chain[1].input_tokens - chain[0].input_tokens
            assert 50_000 <= jump <= 51_200
            assert 2185 <= chain[-1].output_tokens <= 2693
        if joins:  # the parent's next turn waits for every subagent, reports included
            (join,) = joins
            assert set(join.depends_on) == {parent, *(c[-1].id for c in agents.values())}
            reports = sum(-(-c[-1].output_tokens // 64) * 64 for c in agents.values())
            assert join.input_tokens - by_id[parent].input_tokens >= reports
    assert set(fanouts) == {1, 2}
    assert 0.15 <= len(fanouts) / len(agentx_200.sessions) <= 0.35  # measured 1 in 4


def test_agentx_prefix_cache_hit_rate_is_high(agentx_200: Trace) -> None:
    requests = list(agentx_200.requests())
    rate = sum(theoretical_prefix_hits(requests)) / sum(r.input_tokens for r in requests)
    # The four WEKA sessions alone give 0.65-0.90; many sessions share the prefix.
    assert 0.85 < rate < 0.95


def test_agentx_preset_holds_the_figures_it_was_fitted_to() -> None:
    """The preset lives in its TOML only; these are the WEKA figures it must keep."""
    cfg = agentx_coding()
    assert (cfg.name, cfg.sessions, cfg.system_blocks, cfg.max_context) == (
        "agentx-coding", 32, 240, 200_000)
    assert cfg.first_message_blocks == LogNormal(150, 2.4, 1, 1600)
    assert cfg.output_tokens == LogNormal(284, 0.88, 16, 4096)
    assert cfg.pause_s == LogNormal(16.0, 1.6, 1.0, 600.0)
    assert (cfg.subagent_probability, cfg.subagent_fanout) == (0.25, Uniform(1, 2))
    assert cfg.subagent_first_tool_result_blocks == Uniform(782, 789)
    # Another block size re-expresses the same token lengths.
    assert agentx_coding(block_size=128).system_blocks == 120


def test_example_toml_spells_out_the_preset() -> None:
    assert make_config("demo", EXAMPLE_TOML) == agentx_coding()
    assert make_config(None, EXAMPLE_TOML) == agentx_coding()


def test_block_size_keeps_token_lengths() -> None:
    small = make_config("agentx-coding", block_size=16)
    assert isinstance(small, SynthConfig)
    assert small.system_blocks == 960 and small.block_size == 16
    assert small.subagent_first_tool_result_blocks == Uniform(3128, 3156)
    trace = synthesize(small)
    assert sum(b.tokens for b in trace.sessions[0].requests[0].blocks[:960]) == 15_360


# --- fixed -----------------------------------------------------------------------------


@pytest.mark.parametrize(("isl", "sizes"), [(1, [1]), (100, [64, 36]), (128, [64, 64]),
                                            (1000, [64] * 15 + [40])])
def test_fixed_preset_has_exact_lengths_and_no_reuse(isl: int, sizes: list[int]) -> None:
    config = make_config("fixed", isl=isl, osl=1000, requests=7)
    trace = synthesize(config)
    assert trace.name == f"fixed-isl{isl}-osl1000"
    requests = list(trace.requests())
    assert len(trace.sessions) == len(requests) == 7
    for r in requests:
        assert [b.tokens for b in r.blocks] == sizes
        assert r.input_tokens == isl and r.output_tokens == 1000
        assert r.depends_on == () and r.pause_s == 0 and r.agent_kind == "main"
    ids = [b.id for r in requests for b in r.blocks]
    assert len(ids) == len(set(ids))
    assert theoretical_prefix_hits(requests) == [0] * 7


def test_fixed_defaults_are_the_vendor_headline() -> None:
    assert make_config("fixed") == FixedConfig(isl=1, osl=1000, requests=10)


# --- fitting a small model -------------------------------------------------------------


def test_scale_and_max_context_fit_a_small_model() -> None:
    trace = _agentx(sessions=100, seed=2, scale_context=0.1, max_context=8192)
    assert trace.name == "agentx-coding-scale0.1-max8192"
    assert trace.meta["max_context"] == "8192" and trace.meta["scale_context"] == "0.1"
    requests = list(trace.requests())
    assert max(r.input_tokens + r.output_tokens for r in requests) <= 8192
    assert max(r.input_tokens for r in requests) > 7000  # sessions run up to the window
    assert sum(r.agent_kind == "subagent" for r in requests) > 20  # subagents still fit
    assert trace.sessions[0].requests[0].blocks[23].tokens == 64
    assert all(s.requests[0].blocks[:24] == trace.sessions[0].requests[0].blocks[:24]
               for s in trace.sessions)  # the prefix, scaled to 24 blocks, still shared
    assert statistics.median(len(_main(s.requests)) for s in trace.sessions) >= 3


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), window=st.integers(4096, 32768),
       scale=st.sampled_from([0.05, 0.1, 0.2]))
def test_no_request_exceeds_the_window(seed: int, window: int, scale: float) -> None:
    trace = _agentx(sessions=6, seed=seed, scale_context=scale, max_context=window)
    for session in trace.sessions:
        assert all(r.input_tokens + r.output_tokens <= window for r in session.requests)
        for prev, cur in itertools.pairwise(_main(session.requests)):
            assert cur.blocks[: len(prev.blocks)] == prev.blocks


def test_a_window_smaller_than_the_prefix_is_an_error() -> None:
    with pytest.raises(TraceError, match=r"no room in session 's00'.*prefix alone is 15360 "):
        _agentx(sessions=2, max_context=15_000)
    # A window just above the prefix still works: first messages and answers are cut.
    trace = _agentx(sessions=4, max_context=15_360 + 128)
    for session in trace.sessions:
        (first,) = _main(session.requests)
        assert first.input_tokens == 15_424 and first.output_tokens <= 64


def test_aux_requests_hang_off_main_turns() -> None:
    config = make_config("demo", sessions=3)
    assert isinstance(config, SynthConfig)
    from dataclasses import replace

    trace = synthesize(replace(config, aux_probability=1.0))
    for session in trace.sessions:
        aux = [r for r in session.requests if r.agent_kind == "aux"]
        assert len(aux) == len(_main(session.requests))
        assert all(len(r.depends_on) == 1 for r in aux)
        waited_on = {d for r in session.requests for d in r.depends_on}
        assert not waited_on & {r.id for r in aux}


# --- TOML overrides and their errors ---------------------------------------------------


def test_toml_overrides_and_precedence(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "cfg.toml", """
preset = "agentx-coding"
sessions = 3
output_tokens = {dist = "lognormal", median = 300, sigma = 0.9, min = 16, max = 4000}
pause_s = [0.5, 2.5]
subagent_probability = 1
turns = 5
""")
    config = make_config(None, cfg)
    assert isinstance(config, SynthConfig)
    assert config.sessions == 3 and config.turns == Constant(5)
    assert config.output_tokens == LogNormal(300, 0.9, 16, 4000)
    assert config.system_blocks == 240  # the preset's value where the file says nothing
    assert make_config(None, cfg, sessions=9).sessions == 9  # type: ignore[union-attr]
    assert make_config("demo", cfg).system_blocks == 8  # type: ignore[union-attr]
    trace = synthesize(config)
    assert len(trace.sessions) == 3
    for session in trace.sessions:
        assert len(_main(session.requests)) == 5
        assert any(r.agent_kind == "subagent" for r in session.requests)
        assert all(0.5 <= r.pause_s <= 2.5 for r in _main(session.requests)[1:])


def test_toml_for_fixed(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "f.toml", 'preset = "fixed"\nisl = 3\nosl = 7\nrequests = 2\n')
    assert make_config(None, cfg) == FixedConfig(isl=3, osl=7, requests=2)
    assert make_config(None, cfg, osl=9) == FixedConfig(isl=3, osl=9, requests=2)


@pytest.mark.parametrize(("text", "message"), [
    ("output_tokns = 5", "key 'output_tokns': unknown setting (did you mean 'output_tokens'?)"),
    ("isl = 5", "key 'isl': not a setting of preset 'demo'"),
    ('preset = "fixed"\nturns = 5', "key 'turns': not a setting of preset 'fixed'"),
    ('sessions = "8"', "key 'sessions': must be a whole number, got a string '8'"),
    ("sessions = true", "key 'sessions': must be a whole number, got a boolean"),
    ("sessions = 0", "key 'sessions': must be >= 1, got 0"),
    ("system_blocks = 8.5", "key 'system_blocks': must be a whole number, got 8.5"),
    ("output_tokens = {dist = \"lognormal\", median = 0, sigma = 0.9}",
     "key 'output_tokens': lognormal needs median > 0"),
    ("output_tokens = {dist = \"lognormal\", median = 300}",
     "key 'output_tokens': lognormal needs median and sigma; 'sigma' is missing"),
    ("turns = [4.5, 7]", "key 'turns': counts need whole numbers, got uniform 4.5..7"),
    ("turns = [0, 7]", "key 'turns': must be >= 1, got uniform 0..7"),
    ("tool_result_blocks = [6, 1]", "key 'tool_result_blocks': uniform needs low <= high"),
    ("pause_s = [-1, 2]", "key 'pause_s': seconds must be >= 0"),
    ("pause_s = \"fast\"", "key 'pause_s': must be a number, [low, high]"),
    ("subagent_probability = 1.5", "key 'subagent_probability': must be in [0, 1], got 1.5"),
    ("subagent_result_in_parent = 1", "key 'subagent_result_in_parent': must be true or false"),
    ("scale_context = 0", "key 'scale_context': must be in (0, 1], got 0"),
    ("max_context = 0", "key 'max_context': must be >= 1, got 0"),
    ("name = 3", "key 'name': must be a string"),
    ('preset = "big"', "key 'preset': must be one of demo, agentx-coding, fixed"),
    ("sessions = ", "not valid TOML"),
])
def test_toml_errors_name_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    cfg = _write(tmp_path / "cfg.toml", text + "\n")
    with pytest.raises(TraceError) as info:
        make_config(None, cfg)
    assert str(info.value).startswith(f"{cfg}: ")
    assert message in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.toml: config file not found"):
        make_config(None, tmp_path / "nope.toml")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preset_name": "demo", "isl": 5}, "--isl does not apply to preset 'demo'"),
    ({"preset_name": "fixed", "sessions": 5}, "--sessions does not apply to preset 'fixed'"),
    ({"preset_name": "fixed", "scale_context": 0.5}, "--scale-context does not apply"),
    ({"preset_name": "demo", "scale_context": 1.5}, "--scale-context: must be in (0, 1]"),
    ({"preset_name": "fixed", "isl": 0}, "--isl: must be >= 1, got 0"),
    ({"preset_name": "demo", "block_size": 0}, "--block-size must be >= 1"),
    ({"preset_name": "huge"}, "unknown preset 'huge'"),
])
def test_flag_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TraceError) as info:
        make_config(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_python_config_errors_name_the_field() -> None:
    with pytest.raises(TraceError, match="key 'turns': must be >= 1"):
        SynthConfig(turns=Uniform(0, 3))
    with pytest.raises(TraceError, match="key 'osl': must be >= 1"):
        FixedConfig(osl=0)


# --- the command -----------------------------------------------------------------------


def test_cli_presets_match_the_library() -> None:
    assert tuple(p.value for p in Preset) == PRESETS


def test_cli_writes_agentx_parquet_and_says_what(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    proc = run_cli("traces", "synth", "--preset", "agentx-coding", "--sessions", "12",
                   "--seed", "3", "--scale-context", "0.1", "--max-context", "8192", "-o",
                   str(out))
    assert proc.returncode == 0, proc.stderr
    trace = load_native(out)
    assert trace == _agentx(sessions=12, seed=3, scale_context=0.1, max_context=8192)
    requests = list(trace.requests())
    (line,) = proc.stdout.splitlines()
    assert line == (f"wrote {out}: agentx-coding-scale0.1-max8192, 12 sessions, "
                    f"{len(requests)} requests "
                    f"({sum(r.agent_kind == 'subagent' for r in requests)} subagent), "
                    f"{sum(r.input_tokens for r in requests):,} input tokens, "
                    f"{sum(r.output_tokens for r in requests):,} output tokens")


def test_cli_fixed_and_config(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "f.toml", 'preset = "fixed"\nrequests = 3\n')
    proc = run_cli("traces", "synth", "--config", str(cfg), "--isl", "1", "--osl", "1000",
                   "-o", str(tmp_path / "f.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert "fixed-isl1-osl1000, 3 sessions, 3 requests" in proc.stdout
    trace = read_trace(tmp_path / "f.jsonl")
    assert [r.input_tokens for r in trace.requests()] == [1, 1, 1]


@pytest.mark.parametrize(("args", "fragments"), [
    (["--isl", "1"], ["--isl does not apply to preset 'demo'"]),
    (["--preset", "fixed", "--sessions", "3"], ["--sessions does not apply"]),
    (["--scale-context", "0"], ["--scale-context: must be in (0, 1]"]),
    (["--preset", "agentx-coding", "--max-context", "4096"], ["leaves no room", "15360"]),
    (["--config", "CFG"], ["cfg.toml: key 'output_tokens': lognormal needs median > 0"]),
    (["--config", "MISSING"], ["missing.toml: config file not found"]),
])
def test_cli_errors_are_one_line(tmp_path: Path, args: list[str],
                                 fragments: list[str]) -> None:
    cfg = _write(tmp_path / "cfg.toml",
                 'output_tokens = {dist = "lognormal", median = 0, sigma = 0.9}\n')
    args = [str(cfg) if a == "CFG" else str(tmp_path / "missing.toml") if a == "MISSING"
            else a for a in args]
    proc = run_cli("traces", "synth", *args, "-o", str(tmp_path / "x.jsonl"))
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_help_explains_presets_and_defaults() -> None:
    proc = run_cli("traces", "synth", "--help", env={"COLUMNS": "120"})
    assert proc.returncode == 0
    for fragment in ("demo:", "agentx-coding:", "fixed:", "ISL 1, OSL 1000", "default 7",
                     "agentx-coding 32", "[low,", "--scale-context 0.1"):
        assert fragment in proc.stdout, fragment
