"""The loopback emulator: an exact, vLLM-like schedule, emission stamps and honest books."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from agentload.replay.bench.client_bench import ClientBenchConfig, emulator, emulator_stats
from agentload.replay.bench.emulator import EMULATOR_MODEL, EMULATOR_NAME
from agentload.replay.client.netstamp import StampedTransport
from agentload.replay.client.sse import stream_completion


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> object:
    cfg = ClientBenchConfig(ttft_ms=30.0, itl_ms=10.0)
    with emulator(cfg, tmp_path_factory.mktemp("emu") / "emu.log") as url:
        yield url


async def _streams(url: str, n: int, tokens: int) -> list[object]:
    async with httpx.AsyncClient(transport=StampedTransport(), timeout=30) as client:
        body = {"model": EMULATOR_MODEL, "prompt": [16, 17, 18], "max_tokens": tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        return await asyncio.gather(*(stream_completion(client, url + "/v1/completions", body,
                                                        collect_emit_ns=True)
                                      for _ in range(n)))


def test_schedule_is_one_event_per_stream_per_step(emu: str) -> None:
    emulator_stats(emu, reset=True)
    results = asyncio.run(_streams(emu, 20, 30))
    assert all(r.ok and r.chunks == 30 and r.completion_tokens == 30  # type: ignore[attr-defined]
               and r.prompt_tokens == 3 for r in results)  # type: ignore[attr-defined]
    emits = [np.asarray(r.chunk_emit_ns) for r in results]  # type: ignore[attr-defined]
    gaps = np.concatenate([np.diff(e) for e in emits]) / 1e6
    # Steps every 10 ms: the median gap is the step, and no gap strays far from it.
    assert abs(float(np.median(gaps)) - 10.0) < 1.5
    assert float(np.percentile(gaps, 90)) < 25.0
    # Streams join on the first step after their TTFT: their first events are at most
    # one step further apart than their arrivals were (a loaded machine spreads the
    # client's sends; the emulator must not add to that). From then on every stream's
    # k-th event comes the same number of steps after its first, at the one step all
    # streams are written in.
    arrive = np.array([r.emulator_arrive_ns for r in results])  # type: ignore[attr-defined]
    kth = np.stack([e[:30] for e in emits])
    assert (kth[:, 0] - arrive).min() / 1e6 >= 30.0  # never before its TTFT
    stats = emulator_stats(emu)
    slack_ms = max(5.0, stats["step_lag_p99_ms"] or 0.0)
    join_ms = float(kth[:, 0].max() - kth[:, 0].min()) / 1e6
    assert join_ms < float(arrive.max() - arrive.min()) / 1e6 + 10.0 + slack_ms
    rel = kth - kth[:, :1]
    spread_ms = (rel.max(axis=0) - rel.min(axis=0)) / 1e6
    assert float(np.median(spread_ms)) < 5.0
    assert stats["events"] == 600 and stats["tokens"] == 600 and stats["requests"] == 20
    assert stats["name"] == EMULATOR_NAME and "test equipment" in stats["name"]
    assert stats["step_lag_p50_ms"] is not None and stats["step_lag_p50_ms"] < 5.0
    assert not stats["saturated"]


def test_first_token_waits_for_ttft_on_a_step(emu: str) -> None:
    async def one() -> tuple[int, int]:
        body = {"prompt": [1], "max_tokens": 2, "stream": True}
        async with (httpx.AsyncClient(transport=StampedTransport(), timeout=30) as client,
                    client.stream("POST", emu + "/v1/completions", json=body) as resp):
            async for raw in resp.aiter_raw():
                obj = orjson.loads(raw.split(b"\n\n")[0][6:])
                return obj["t_arrive_ns"], obj["t_emit_ns"]
        raise AssertionError("no event")

    arrive, emit = asyncio.run(one())
    ttft_ms = (emit - arrive) / 1e6
    assert 30.0 <= ttft_ms < 30.0 + 10.0 + 5.0  # TTFT, then the next step boundary


def test_tokens_per_event_chat_and_plain(tmp_path: Path) -> None:
    cfg = ClientBenchConfig(ttft_ms=5.0, itl_ms=5.0, tokens_per_event=4)
    with emulator(cfg, tmp_path / "emu.log") as url:
        async def run() -> None:
            async with httpx.AsyncClient(transport=StampedTransport(), timeout=30) as c:
                res = await stream_completion(c, url + "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "a b c d"}], "max_tokens": 10,
                    "stream": True, "stream_options": {"include_usage": True}})
                assert res.ok and res.chunks == 3 and res.completion_tokens == 10
                assert res.prompt_tokens == 4
                plain = (await c.post(url + "/v1/completions",
                                      json={"prompt": "x y", "max_tokens": 3})).json()
                assert plain["usage"]["completion_tokens"] == 3
                models = (await c.get(url + "/v1/models")).json()
                assert models["data"][0]["id"] == EMULATOR_MODEL
                assert (await c.get(url + "/health")).status_code == 200
                tok = (await c.post(url + "/tokenize", json={"prompt": "a b c"})).json()
                assert tok["count"] == 3
                assert (await c.get(url + "/nope")).status_code == 404
        asyncio.run(run())


def test_emulator_counts_its_cpu(emu: str) -> None:
    emulator_stats(emu, reset=True)
    t = time.monotonic()
    asyncio.run(_streams(emu, 10, 150))  # ~1.5 s of steps: at least one CPU sample
    assert time.monotonic() - t > 1.0
    stats = emulator_stats(emu)
    # A share of cores: the emulator did work, and no more than the host has (not a
    # bound on how busy it was, which depends on the host's load).
    assert stats["cpu_samples"] >= 1 and 0.0 < stats["cpu_max"] <= (os.cpu_count() or 1)


def test_middle_events_match_the_first_ones_byte_for_byte(emu: str) -> None:
    """Middle events come from a prebuilt prefix; apart from t_emit_ns they are alike."""
    import orjson as _orjson

    with httpx.stream("POST", emu + "/v1/completions", json={
            "prompt": [1, 2], "max_tokens": 6, "stream": True}, timeout=10) as resp:
        body = b"".join(resp.iter_bytes())
    datas = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    objs = [_orjson.loads(d) for d in datas]
    assert len(objs) == 6
    for o in objs:
        o.pop("t_emit_ns")
        o.pop("t_arrive_ns", None)
    assert objs[1] == objs[2] == objs[3] == objs[4]
    assert objs[5]["choices"][0]["finish_reason"] == "length"
    assert all(int(_orjson.loads(d)["t_emit_ns"]) > 0 for d in datas)


def test_emulator_processes_share_one_port_and_their_books_add_up(tmp_path: Path) -> None:
    """--emulator-procs: the kernel spreads connections over processes on one port; the
    stats merge counts (sums) and keeps the worst process's CPU and lag."""
    cfg = ClientBenchConfig(ttft_ms=20.0, itl_ms=5.0, emulator_procs=2)
    with emulator(cfg, tmp_path / "emu.log") as url:
        emulator_stats(url, reset=True)
        results = asyncio.run(_streams(url, 40, 10))
        assert all(r.ok and r.chunks == 10 for r in results)  # type: ignore[attr-defined]
        stats = emulator_stats(url)
    assert stats["processes"] == 2 and len(set(stats["pid"])) == 2
    assert stats["requests"] == 40 and stats["events"] == 400
    assert stats["verdict"] == "ok"


def test_scaling_table_measures_each_worker_count_against_one_emulator() -> None:
    from agentload.replay.bench.client_bench import scaling_benchmark, scaling_lines

    cfg = ClientBenchConfig(streams=20, requests=40, max_tokens=20, ttft_ms=10.0,
                            itl_ms=5.0, vllm_bench=False)
    result = scaling_benchmark(cfg, [1, 2])
    rows = result["rows"]
    assert [r["workers"] for r in rows] == [1, 2]
    # Every event arrived in both runs (20 tokens x 40 requests at the offered rate).
    assert all(r["events_per_s"] > 0.5 * result["offered_events_per_s"] for r in rows)
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert 0.5 < rows[1]["efficiency"] <= 1.2  # capped at the offered rate, not 2x
    assert "vs ideal" in "\n".join(scaling_lines(result))
