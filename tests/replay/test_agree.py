"""The agreement check: one set of definitions for every tool, and a real run of both."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import agentload.replay.bench.agree as agree_module
from agentload.replay.bench.agree import (
    agree_lines,
    agree_trace,
    agreement,
    bunched_share,
    clients_off,
    counters_delta,
    figures,
    host_share,
    host_ticks,
    median_of,
    server_means_ms,
    server_view,
    spoiled_by,
    worker_cpus,
)
from agentload.replay.errors import ReplayError


def test_figures_use_the_same_definitions_for_every_tool() -> None:
    gaps = [np.array([0.01, 0.01, 0.04]), np.array([0.02, 0.02, 0.02])]
    f = figures([0.1, 0.3], gaps, [4, 4])
    assert f["ttft"]["p50_ms"] == pytest.approx(200.0)
    # TPOT per request: 60 ms / 3 = 20 ms for both requests.
    assert f["tpot"]["p50_ms"] == pytest.approx(20.0)
    # Per-chunk gaps pooled: 10, 10, 20, 20, 20, 40 ms.
    assert f["itl"]["p50_ms"] == pytest.approx(20.0)
    assert f["itl"]["p90_ms"] == pytest.approx(30.0)
    assert f["itl"]["mean_ms"] == pytest.approx(20.0)
    assert f["ttft"]["mean_ms"] == pytest.approx(200.0)
    runs = [f, figures([0.5], [np.array([0.03])], [2]), figures([0.2], [np.array([0.01])], [2])]
    assert median_of(runs)["ttft"]["p50_ms"] == pytest.approx(200.0)


def test_agree_trace_has_exact_disjoint_prompts() -> None:
    t = agree_trace(5, 64, 16, salt=2)
    assert t.num_requests == 5
    blocks = [r.blocks[0] for r in t.requests()]
    assert len({b.id for b in blocks}) == 5 and all(b.tokens == 64 for b in blocks)


@pytest.mark.vllm
def test_agree_against_the_embedded_server(embedded_server_with_log: tuple[str, Path]
                                           ) -> None:
    # The clients kept off the worker's core, as `bench agree` keeps them: unpinned, a
    # client the kernel put there read whole answers in one read (TPOT 0).
    url, log = embedded_server_with_log
    r = agreement(url, requests=8, concurrency=2, input_len=32, output_len=16, runs=1,
                  server_log=log)
    assert r["config"]["client_cpus"], "clients not pinned off the worker's cores"
    assert r["agentload_runs"][0]["completed"] == 8
    assert r["vllm_bench_runs"][0]["completed"] == 8
    # What the runs saw, for a failure on a loaded machine to explain itself.
    seen = {"set_aside": r["set_aside"], "client": r["agentload_runs"][0]["client"],
            "bunched": [x["bunched_share"] for x in (*r["agentload_runs"],
                                                      *r["vllm_bench_runs"])]}
    lines = agree_lines(r)
    if r["spoiled_kept"]:
        # The machine held a client back in all three attempts (CI once saw it, with
        # the host busy throughout): the tool must say so, not pass a TPOT of 0 off as
        # a measurement.
        assert len(r["set_aside"]) == 2 and r["agentload_runs"][0]["kept_though"], seen
        assert any("still read events together after 2 retries" in line
                   for line in lines), lines
    else:
        for m in ("ttft", "tpot"):
            for q in ("p50_ms", "p90_ms"):
                assert r["agentload"][m][q] > 0, (m, q, seen)
                assert r["vllm_bench"][m][q] > 0, (m, q, seen)
                assert r["ratio"][m][q] is not None
        # Same server, same requests: the two tools' TPOT medians are of one magnitude.
        assert 0.5 < r["ratio"]["tpot"]["p50_ms"] < 2.0, seen
    assert r["agentload"]["ttft"]["p50_ms"] > 0 and r["vllm_bench"]["ttft"]["p50_ms"] > 0
    # Per-chunk gaps can be 0 at the median: a busy server writes several events at once.
    assert r["agentload"]["itl"]["p90_ms"] >= 0 and r["vllm_bench"]["itl"]["p90_ms"] >= 0
    assert any("TTFT P50" in line for line in lines)
    # Identical requests: the server counted the same prompt tokens and no prefix hits.
    for run in (r["agentload_runs"][0], r["vllm_bench_runs"][0]):
        assert run["server"]["prompt_tokens_total"] == 8 * 32
        assert run["server"]["prefix_cache_hits_total"] == 0
        assert run["server"]["request_success_total"] == 8
        assert run["server_ms"]["time_to_first_token"] > 0
    assert any("server's own clock" in line for line in lines)


def test_bunched_share_and_what_spoils_a_pair() -> None:
    steps = [np.array([0.003, 0.003, 0.004]), np.array([0.003])]
    assert bunched_share(steps) == 0.0
    # A late read drains three events: two gaps of 0 among six.
    late = [np.array([0.003, 0.0, 0.0]), np.array([0.003, 0.003, 0.004])]
    assert bunched_share(late) == pytest.approx(2 / 6)
    assert bunched_share([np.zeros(0)]) is None
    clean, bad = {"bunched_share": 0.0}, {"bunched_share": 2 / 6}
    assert spoiled_by(clean, clean) is None
    assert spoiled_by(clean, {"bunched_share": None}) is None
    why = spoiled_by(bad, clean)
    assert why is not None and why.startswith("agentload read 33%")
    why = spoiled_by(clean, bad)
    assert why is not None and why.startswith("vllm bench serve read 33%")


CACHE_SALTS: list[int | None] = []
TRANSPORTS: list[str] = []


def _stub_tools(monkeypatch: pytest.MonkeyPatch, bunched: list[float]) -> list[int]:
    """``agreement``'s servers and tools replaced: agentload's attempt k reads
    ``bunched[k]`` of its events together; the salts each attempt was given (and,
    after them in ``CACHE_SALTS``, the cache salts)."""
    salts: list[int] = []
    cache_salts = CACHE_SALTS
    cache_salts.clear()
    TRANSPORTS.clear()

    def ours(base: str, run_dir: Path, requests: int, concurrency: int, input_len: int,
             output_len: int, salt: int, cache_salt: int | None = None,
             transport: str = "stamped") -> dict[str, object]:
        if run_dir.name == "warmup":
            return {}
        TRANSPORTS.append(transport)
        salts.append(salt)
        cache_salts.append(cache_salt)
        share = bunched[len(salts) // 2]
        tpot = 0.0 if share > 0.5 else 3.0
        f = {m: {"p50_ms": tpot if m != "ttft" else 10.0,
                 "p90_ms": tpot if m != "ttft" else 12.0, "mean_ms": 10.0}
             for m in ("ttft", "tpot", "itl")}
        return {**f, "bunched_share": share, "completed": requests,
                "client": {"saturation_reasons": []}}

    def theirs(*args: object, salt: int, cache_salt: int | None = None,
               **kw: object) -> dict[str, object]:
        salts.append(salt)
        cache_salts.append(cache_salt)
        f = {m: {"p50_ms": 3.0 if m != "ttft" else 11.0,
                 "p90_ms": 3.0 if m != "ttft" else 13.0, "mean_ms": 10.0}
             for m in ("ttft", "tpot", "itl")}
        return {**f, "bunched_share": 0.0, "completed": 8, "ran": True}

    @contextlib.contextmanager
    def target(url: str, workdir: Path, say: object) -> Iterator[str]:
        yield url

    import agentload.replay.serve.probe as probe_module
    import agentload.replay.serve.tiny_model as tiny
    monkeypatch.setattr(agree_module, "agentload_run", ours)
    monkeypatch.setattr(agree_module, "vllm_run", theirs)
    monkeypatch.setattr(agree_module, "_target", target)
    monkeypatch.setattr(agree_module, "server_counters", lambda base: {})
    monkeypatch.setattr(probe_module, "probe_target", lambda *a: ("tiny", None))
    monkeypatch.setattr(probe_module, "detect_token_id_range", lambda *a: (10, 100))
    monkeypatch.setattr(tiny, "ensure_tiny_model", lambda: Path("tok"))
    return salts


def test_a_spoiled_pair_is_set_aside_and_run_again(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    salts = _stub_tools(monkeypatch, [0.9, 0.0, 0.0])
    said: list[str] = []
    r = agreement("http://x", runs=2, workdir=tmp_path, pin_clients=False,
                  say=said.append)
    assert [x["run"] for x in r["set_aside"]] == [1]
    assert r["set_aside"][0]["why"].startswith("agentload read 90%")
    # The kept runs are the clean ones: TPOT 3 ms, not the spoiled run's 0.
    assert r["agentload"]["tpot"]["p50_ms"] == 3.0 and r["spoiled_kept"] == 0
    assert r["ratio"]["tpot"]["p50_ms"] == pytest.approx(1.0)
    # Three attempts, each tool's prompts its own; 0 was the warm-up's.
    assert salts == [1, 2, 3, 4, 5, 6]
    assert any("set aside and run again" in line for line in said)
    assert any("run 1 was set aside" in line for line in agree_lines(r))


def test_retries_run_out_and_the_spoiled_run_is_kept_and_named(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _stub_tools(monkeypatch, [0.9, 0.9, 0.9])
    r = agreement("http://x", runs=1, retries=1, workdir=tmp_path, pin_clients=False)
    assert len(r["set_aside"]) == 1 and r["spoiled_kept"] == 1
    assert r["agentload"]["tpot"]["p50_ms"] == 0.0
    assert any("still read events together after 1 retries" in line
               for line in agree_lines(r))
    with pytest.raises(ReplayError, match="--retries >= 0"):
        agreement("http://x", retries=-1)


def test_server_counters_minus_the_probes_and_the_servers_means() -> None:
    before = {"prompt_tokens_total": 100.0, "time_to_first_token_seconds_sum": 1.0,
              "time_to_first_token_seconds_count": 10.0}
    after = {"prompt_tokens_total": 4202.0, "time_to_first_token_seconds_sum": 8.06,
             "time_to_first_token_seconds_count": 48.0, "new_only": 3.0}
    probes = {"prompt_tokens_total": 6.0, "time_to_first_token_seconds_sum": 0.06,
              "time_to_first_token_seconds_count": 6.0}
    d = counters_delta(before, after, probes)
    assert d == {"prompt_tokens_total": 4096.0,
                 "time_to_first_token_seconds_sum": pytest.approx(7.0),
                 "time_to_first_token_seconds_count": 32.0}
    means = server_means_ms(d)
    assert means["time_to_first_token"] == pytest.approx(7.0 / 32 * 1e3)
    assert means["inter_token_latency"] is None


def test_host_share_and_the_server_view() -> None:
    cores = os.cpu_count() or 1
    # 1000 ticks in all: 600 busy, 50 stolen.
    share = host_share(host_ticks("cpu  100 0 100 700 0 0 0 0 0 0"),
                       host_ticks("cpu  500 0 300 1050 0 0 0 50 0 0"))
    assert share["steal_share"] == pytest.approx(0.05)
    assert share["busy_cores"] == pytest.approx(0.6 * cores)
    assert host_share(None, None)["busy_cores"] is None
    assert host_ticks("cpu 1 2") is None
    runs = [{"ttft": {"mean_ms": 230.0}, "itl": {"mean_ms": 8.8},
             "server_ms": {"time_to_first_token": 224.0, "inter_token_latency": 8.0},
             "host": share},
            {"ttft": {"mean_ms": 250.0}, "itl": {"mean_ms": 9.0},
             "server_ms": {"time_to_first_token": 240.0, "inter_token_latency": 9.0},
             "host": share}]
    view = server_view(runs)
    assert [r["ttft_minus_server_ms"] for r in view["runs"]] == [6.0, 10.0]
    assert view["median"]["ttft_minus_server_ms"] == 8.0
    assert view["median"]["itl_over_server"] == pytest.approx((1.1 + 1.0) / 2)
    assert view["median"]["server_ttft_mean_ms"] == 232.0


def test_worker_cpus_and_pinning_the_clients_off_them(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, "
                   "core ids=[0, 2]\n(EngineCore pid=1) INFO reserved_cpus=[1]\n")
    assert worker_cpus(log) == {0, 2}
    assert worker_cpus(tmp_path / "missing.log") == set()
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    before = os.sched_getaffinity(0)
    busy = {max(before)}
    with clients_off(busy, lambda _: None) as left:
        if len(before) == 1:
            assert left is None and os.sched_getaffinity(0) == before
        else:
            assert left == before - busy and os.sched_getaffinity(0) == before - busy
    assert os.sched_getaffinity(0) == before
    with clients_off(set(), lambda _: None) as left:
        assert left is None


def test_same_prompts_share_salts_in_a_pair_and_refuse_a_caching_server(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    salts = _stub_tools(monkeypatch, [0.0, 0.0])
    r = agreement("http://x", runs=2, workdir=tmp_path, pin_clients=False,
                  same_prompts=True)
    # Each pair: one salt and one cache salt for both tools; the pairs differ.
    assert salts == [1, 1, 3, 3]
    assert CACHE_SALTS[0] == CACHE_SALTS[1] and CACHE_SALTS[2] == CACHE_SALTS[3]
    assert CACHE_SALTS[0] is not None and CACHE_SALTS[0] != CACHE_SALTS[2]
    assert r["config"]["same_prompts"] and "the same prompts" in agree_lines(r)[0]
    assert TRANSPORTS == ["stamped", "stamped"] and "aiohttp" not in agree_lines(r)[0]
    _stub_tools(monkeypatch, [0.0])
    r = agreement("http://x", runs=1, workdir=tmp_path, pin_clients=False,
                  transport="aiohttp")
    assert TRANSPORTS == ["aiohttp"] and r["config"]["transport"] == "aiohttp"
    assert "agentload on aiohttp" in agree_lines(r)[0]
    # Without it, every run has prompts of its own and a cache salt of its own.
    salts = _stub_tools(monkeypatch, [0.0])
    agreement("http://x", runs=1, workdir=tmp_path, pin_clients=False)
    assert salts == [1, 2] and CACHE_SALTS == [None, None]
    # A server that caches prefixes serves the second run from the first one's cache.
    _stub_tools(monkeypatch, [0.0])
    hits = iter([0.0] * 5)  # the start, the probes, the agentload run, before vllm
    monkeypatch.setattr(agree_module, "server_counters",
                        lambda base: {"prefix_cache_hits_total": next(hits, 5000.0)})
    with pytest.raises(ReplayError, match="without prefix caching"):
        agreement("http://x", runs=1, workdir=tmp_path, pin_clients=False,
                  same_prompts=True)


def test_together_runs_both_tools_at_once_at_half_the_concurrency(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _stub_tools(monkeypatch, [0.0] * 3)  # the stub indexes by salts so far: either order
    windows: dict[str, list[tuple[float, float]]] = {"agentload": [], "vllm": []}
    concurrencies: dict[str, list[int]] = {"agentload": [], "vllm": []}
    ours, theirs = agree_module.agentload_run, agree_module.vllm_run

    def timed(name: str, fn: Any, conc_at: int) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            time.sleep(0.2)  # long enough for the other tool to start meanwhile
            out = fn(*args, **kw)
            if not (isinstance(args[1], Path) and args[1].name == "warmup"):
                windows[name].append((t0, time.monotonic()))
                concurrencies[name].append(args[conc_at])
            return out
        return run

    monkeypatch.setattr(agree_module, "agentload_run", timed("agentload", ours, 3))
    monkeypatch.setattr(agree_module, "vllm_run", timed("vllm", theirs, 5))
    said: list[str] = []
    r = agreement("http://x", runs=2, concurrency=5, workdir=tmp_path, pin_clients=False,
                  together=True, say=said.append)
    for (a0, a1), (v0, v1) in zip(windows["agentload"], windows["vllm"], strict=True):
        assert a0 < v1 and v0 < a1  # the two runs of a pair overlap in time
    assert concurrencies == {"agentload": [3, 3], "vllm": [3, 3]}  # ceil(5 / 2) each
    assert r["config"]["together"] and r["config"]["concurrency_each"] == 3
    # one window for the pair: the host's load is the same figure in both rows
    assert [x["host"] for x in r["agentload_runs"]] == [x["host"] for x in r["vllm_bench_runs"]]
    assert "both tools at once (3 each)" in agree_lines(r)[0]
    assert any("running at the same time" in line for line in agree_lines(r))
    assert any("together" in line for line in said)
    with pytest.raises(ReplayError, match="exclude each other"):
        agreement("http://x", together=True, same_prompts=True, workdir=tmp_path)


def test_the_warm_up_is_a_whole_run_unless_told(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    # A fresh GPU server's first measured run was 17-68 % slower to first token after an
    # 8-request warm-up: the default warm-up is now as many requests as one run.
    _stub_tools(monkeypatch, [0.0] * 3)
    warmups: list[tuple[int, int]] = []
    ours = agree_module.agentload_run

    def spy(base: str, run_dir: Path, requests: int, concurrency: int, *a: Any,
            **kw: Any) -> Any:
        if run_dir.name == "warmup":
            warmups.append((requests, concurrency))
        return ours(base, run_dir, requests, concurrency, *a, **kw)

    monkeypatch.setattr(agree_module, "agentload_run", spy)
    r = agreement("http://x", runs=1, requests=40, concurrency=4, workdir=tmp_path,
                  pin_clients=False)
    assert warmups == [(40, 4)] and r["config"]["warmup_requests"] == 40
    assert "after 40 unmeasured warm-up requests" in agree_lines(r)[0]
    agreement("http://x", runs=1, requests=40, warmup_requests=0, workdir=tmp_path,
              pin_clients=False)
    assert warmups == [(40, 4)]  # none the second time
    with pytest.raises(ReplayError, match="warmup-requests"):
        agreement("http://x", warmup_requests=-1, workdir=tmp_path)


@pytest.mark.parametrize("transport", ["stamped", "aiohttp"])
def test_agentload_runs_on_either_transport(tmp_path: Path, transport: str) -> None:
    """``--transport aiohttp`` stamps where vllm bench serve does; the run is the same."""
    from agentload.replay.bench.client_bench import ClientBenchConfig, emulator

    with emulator(ClientBenchConfig(ttft_ms=20.0, itl_ms=5.0), tmp_path / "emu.log") as url:
        out = agree_module.agentload_run(url, tmp_path / "run", requests=8, concurrency=2,
                                         input_len=16, output_len=6, salt=1,
                                         transport=transport)  # type: ignore[arg-type]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["options"]["transport"] == transport
    assert out["completed"] == 8 and out["output_lens"] == [6] * 8
    # The emulator's 20 ms to first token and 5 ms steps, seen through either client.
    assert 20.0 <= out["ttft"]["p50_ms"] < 200.0
    assert 4.0 <= out["itl"]["p50_ms"] < 50.0


def test_an_unknown_transport_is_one_line_and_exit_2() -> None:
    from tests.support import run_cli

    done = run_cli("bench", "agree", "--transport", "h2", "--target", "http://127.0.0.1:9")
    assert done.returncode == 2 and "expected stamped or aiohttp" in done.stderr


def test_counters_in_reads_the_real_gpu_servers_metrics_text() -> None:
    """The counters agreement compares with, from a real vLLM 0.26 ``/metrics`` (H100)."""
    from agentload.replay.bench.agree import counters_in
    from tests.support import DATA

    text = (DATA / "gpu" / "run_moe_ngram_eager" / "server_metrics_end.txt").read_text()
    got = counters_in(text)
    assert got["prompt_tokens_total"] > 0 and got["generation_tokens_total"] > 0
    assert got["time_to_first_token_seconds_count"] > 0
    # Summed over label sets, exactly as a hand count of the text gives.
    hand = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:time_to_first_token_seconds_sum"))
    assert got["time_to_first_token_seconds_sum"] == pytest.approx(hand)
    means = server_means_ms(got)
    assert means["time_to_first_token"] is not None and means["time_to_first_token"] > 0
