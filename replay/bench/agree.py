"""``agentload bench agree``: do agentload's TTFT and ITL agree with ``vllm bench serve``'s?

The same requests (N single-turn requests of exactly ``input_len`` prompt tokens and
``output_len`` output tokens with ``ignore_eos``, fresh prompts so no prefix hits, at the
same closed-loop concurrency) are played by agentload and by ``vllm bench serve`` (and
AIPerf where it is installed) against one vLLM server, alternating, ``runs`` times each.

The requests are identical, not only alike: ``vllm bench serve`` runs with its dataset
replaced by agentload's own token-id prompts (same construction, another salt), so every
prompt has exactly ``input_len`` tokens and no prefix hits. Its random dataset does not
give that: its prompts are text, re-tokenized (one came back 129 tokens), and its
initial test request repeats request 0, which then hits the prefix cache (the server's
``prefix_cache_hits_total`` counted 192-384 hit tokens per run; agentload's runs 0).
That test request is skipped (``--ready-check-timeout-sec 0``).
Per tool and run it computes, with the same definitions for every tool:

- TTFT = first token chunk - request sent;
- TPOT = (last chunk - first chunk) / (OSL - 1), per request (agentload's ``ITL_i``);
- ITL (per chunk) = gaps between consecutive token chunks, pooled over requests;

then P50 and P90 (linear interpolation), the median of those over the runs, and
agentload / vllm ratios. A pair of runs in which either client read its events in bunches
(``spoiled_by``) is run again. Without ``--target`` it starts the embedded vLLM CPU server.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl

from agentload.replay.bench.client_bench import aiperf_status, vllm_bench_available
from agentload.replay.bench.hostload import host_share, host_ticks
from agentload.replay.engine.core import ReplayOptions
from agentload.replay.engine.prompts import TokenPrompts
from agentload.replay.errors import ReplayError
from agentload.replay.journal import CHUNKS_NAME
from agentload.replay.serve.prometheus import parse_metrics
from agentload.traces import Block, Request, Session, Trace

METRICS = ("ttft", "tpot", "itl")
Transport = Literal["stamped", "aiohttp"]
QUANTILES = (50, 90)
# A per-chunk gap this short is no decode step: the client read several events at once
# and stamped them together. Past this share of a run's gaps, the run measured its own
# client, not the server (the 2-core CI machine's OS once held agentload's loop back
# 90 ms: 16 events per read, TPOT 0), and the pair is run again.
BUNCHED_GAP_S = 1e-4
SPOILED_SHARE = 0.10
# The embedded server's niceness under `--peer aiperf`: its API server and engine-core
# processes float onto the clients' core (only the model worker is bound), and each
# wake-up there preempted the client for up to 0.1 s (docs/results/aiperf-agree.md,
# 2026-12-07). Not used against vllm bench serve: under its back-to-back load one A/B
# on the same host read worse at nice 10 (docs/results/vllm-bench-agree.md).
SERVER_NICE = 10


def agree_trace(requests: int, input_len: int, output_len: int, salt: int = 0) -> Trace:
    """``requests`` one-request sessions with disjoint prompts of exactly ``input_len``."""
    sessions = tuple(
        Session(f"agree{i}", (Request(f"agree{i}/0", f"agree{i}",
                                      (Block(1_000_000 + salt * 100_000 + i, input_len),),
                                      output_len),))
        for i in range(requests))
    return Trace("agree", sessions, block_size=max(1, input_len))


def _pcts(values: np.ndarray) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        f"p{q}_ms": (float(np.percentile(values, q)) * 1e3 if values.size else None)
        for q in QUANTILES}
    # The mean too: it is what the server's histogram sums can be set against.
    out["mean_ms"] = float(values.mean()) * 1e3 if values.size else None
    return out


def figures(ttft_s: list[float], per_request_gaps_s: list[np.ndarray],
            osl: list[int]) -> dict[str, dict[str, float | None]]:
    """TTFT, TPOT and per-chunk ITL percentiles (ms) from per-request samples."""
    tpot = [float(g.sum()) / (n - 1) for g, n in zip(per_request_gaps_s, osl, strict=True)
            if n >= 2 and g.size]
    gaps = (np.concatenate([g for g in per_request_gaps_s if g.size])
            if per_request_gaps_s else np.zeros(0))
    return {"ttft": _pcts(np.asarray(ttft_s)), "tpot": _pcts(np.asarray(tpot)),
            "itl": _pcts(gaps)}


def bunched_share(per_request_gaps_s: list[np.ndarray]) -> float | None:
    """The share of per-chunk gaps under ``BUNCHED_GAP_S`` (events read together)."""
    gaps = [g for g in per_request_gaps_s if g.size]
    if not gaps:
        return None
    pooled = np.concatenate(gaps)
    return float((pooled < BUNCHED_GAP_S).mean())


def spoiled_by(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why a pair of runs measured a client rather than the server, or ``None``."""
    for name, run in (("agentload", ours), ("vllm bench serve", theirs)):
        share = run.get("bunched_share")
        if share is not None and share > SPOILED_SHARE:
            return (f"{name} read {share:.0%} of its token events together with another "
                    f"(gaps under {BUNCHED_GAP_S * 1e6:.0f} us; over {SPOILED_SHARE:.0%} "
                    "means its client was held back)")
    return None


def agentload_run(url: str, run_dir: Path, requests: int, concurrency: int, input_len: int,
                  output_len: int, salt: int, cache_salt: int | None = None,
                  transport: Transport = "stamped") -> dict[str, Any]:
    from agentload.replay.run import new_cache_salt, run_replay

    trace = agree_trace(requests, input_len, output_len, salt)
    result = run_replay(trace, run_dir, target_url=url,
                        options=ReplayOptions(users=concurrency, time_scale=0.0,
                                              cache_salt=(new_cache_salt() if cache_salt
                                                          is None else cache_salt),
                                              transport=transport),
                        progress="none", report=False, say=lambda _: None)
    frame = pl.read_parquet(run_dir / "requests.parquet").filter(pl.col("ok"))
    chunks = pl.read_parquet(run_dir / CHUNKS_NAME).sort("request_id", "index")
    by_request = {k[0]: g["t_ns"].to_numpy() for k, g in chunks.group_by("request_id")}
    ttft = ((frame["first_token_ns"] - frame["sent_ns"]) / 1e9).to_list()
    gaps = [np.diff(by_request.get(r, np.zeros(0, np.int64))) / 1e9
            for r in frame["request_id"].to_list()]
    osl = [int(x) for x in frame["osl"].fill_null(0).to_list()]
    out: dict[str, Any] = figures(ttft, gaps, osl)
    out["bunched_share"] = bunched_share(gaps)
    out["completed"] = frame.height
    out["input_lens"] = [int(x) for x in frame["isl"].fill_null(0).to_list()]
    out["output_lens"] = osl
    out["client"] = {k: result.summary.get("client", {}).get(k) for k in (
        "stamp_error_p99_s", "events_per_read", "loop_lag_p99_s", "saturation_reasons")}
    return out


# ``vllm bench serve`` with its dataset replaced by the prompts in $AGENTLOAD_AGREE_PROMPTS
# (token-id lists): its request function sends a list prompt as token ids, unchanged.
# ``vllm bench serve`` on agentload's prompts: vllm_bench_shim.py, run by its path.
VLLM_BENCH_SHIM = Path(__file__).with_name("vllm_bench_shim.py")


def tokenizer_for(served_model: str) -> Path:
    """The tokenizer ``vllm bench serve`` needs for a server agentload can build the model
    of: a dummy-weight preset's directory, else the embedded tiny model's."""
    from agentload.replay.serve.dummy_models import PRESETS, ensure_dummy_model, served_name
    from agentload.replay.serve.tiny_model import ensure_tiny_model

    for preset in PRESETS.values():
        if served_model == served_name(preset):
            return ensure_dummy_model(preset)
    return ensure_tiny_model()


def agree_prompts(requests: int, input_len: int, output_len: int, salt: int,
                  token_id_range: tuple[int, int], cache_salt: int) -> list[list[int]]:
    """The token ids agentload sends for ``agree_trace(..., salt)`` under ``cache_salt``."""
    prompts = TokenPrompts(cache_salt, *token_id_range)
    return [prompts.prompt(r.blocks)
            for r in agree_trace(requests, input_len, output_len, salt).requests()]


def vllm_bench_argv(url: str, model: str, tokenizer: Path, requests: int, concurrency: int,
                    output_len: int, result_dir: Path, name: str) -> list[str]:
    """The ``vllm bench serve`` command line of one agreement run."""
    return [sys.executable, "-P", str(VLLM_BENCH_SHIM), "--backend", "vllm",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--num-warmups", "0",
            # Its initial test request would repeat request 0 (a prefix hit when measured).
            "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", name, "--disable-tqdm"]


def vllm_run(url: str, workdir: Path, model: str, tokenizer: Path, requests: int,
             concurrency: int, input_len: int, output_len: int,
             token_id_range: tuple[int, int], salt: int, cache_salt: int | None = None,
             timeout_s: float = 1800.0) -> dict[str, Any]:
    from agentload.replay.run import new_cache_salt

    why = vllm_bench_available()
    if why is not None:
        return {"ran": False, "reason": why}
    workdir = workdir.resolve()  # vllm bench runs in it, away from the checkout's folders
    name = f"vllm-agree-{time.monotonic_ns()}.json"
    spec_path = workdir / (name + ".prompts.json")
    prompts = agree_prompts(requests, input_len, output_len, salt, token_id_range,
                            new_cache_salt() if cache_salt is None else cache_salt)
    spec_path.write_text(json.dumps({"prompts": prompts, "output_len": output_len}))
    stat_path = workdir / (name + ".stat")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
           "AGENTLOAD_AGREE_PROMPTS": str(spec_path), "AGENTLOAD_AGREE_STAT": str(stat_path)}
    log = workdir / (name + ".log")
    with log.open("w") as fh:
        proc = subprocess.run(vllm_bench_argv(url, model, tokenizer, requests, concurrency,
                                              output_len, workdir, name),
                              stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                              timeout=timeout_s, check=False)
    path = workdir / name
    if proc.returncode != 0 or not path.is_file():
        return {"ran": False, "reason": f"vllm bench serve exited {proc.returncode}: "
                                        f"{log.read_text()[-800:]}"}
    data = json.loads(path.read_text())
    ttfts = data.get("ttfts", [])
    ttft = [t for t in ttfts if t]
    gaps = [np.asarray(itl, dtype=float) for itl, t in zip(data.get("itls", []), ttfts,
                                                            strict=False) if t]
    # Its chunk count, as agentload's OSL when every chunk is one token.
    osl = [len(g) + 1 for g in gaps]
    out: dict[str, Any] = figures(ttft, gaps, osl)
    out["bunched_share"] = bunched_share(gaps)
    out["completed"] = len(ttft)
    out["ran"] = True
    out["input_lens"] = data.get("input_lens", [])
    out["output_lens"] = data.get("output_lens", [])
    lines = stat_path.read_text().splitlines() if stat_path.is_file() else []
    out["host"] = host_share(*(host_ticks(x) for x in lines[:2])) if len(lines) >= 2 else (
        host_share(None, None))
    return out


SERVER_COUNTERS = ("prompt_tokens_total", "prefix_cache_hits_total",
                   "generation_tokens_total", "request_success_total")
# The server's own per-request timings (histogram sums and counts): its mean TTFT, queue,
# prefill and inter-token times say whether a gap between the tools is the server's or
# the clients'.
SERVER_HISTOGRAMS = ("time_to_first_token_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "inter_token_latency_seconds",
                     "e2e_request_latency_seconds")
_WANTED = (*SERVER_COUNTERS, *(h + s for h in SERVER_HISTOGRAMS for s in ("_sum", "_count")))


def server_counters(base: str) -> dict[str, float]:
    """vLLM's prompt, prefix-hit and generated token counters (summed over labels)."""
    import httpx

    try:
        return counters_in(httpx.get(f"{base}/metrics", timeout=10.0, trust_env=False).text)
    except httpx.HTTPError:
        return {}


def counters_in(text: str) -> dict[str, float]:
    """``server_counters`` of a ``/metrics`` text already scraped (names without
    ``vllm:``), read by the one Prometheus parser."""
    found = parse_metrics(text, tuple(f"vllm:{name}" for name in _WANTED))
    return {name.removeprefix("vllm:"): value for name, value in found.items()}


def counters_delta(before: dict[str, float], after: dict[str, float],
                   less: dict[str, float] | None = None) -> dict[str, float]:
    """``after - before`` (minus ``less``, a known share such as agentload's probes)."""
    less = less or {}
    return {k: after[k] - before[k] - less.get(k, 0.0) for k in after if k in before}


def server_means_ms(delta: dict[str, float]) -> dict[str, float | None]:
    """The server's mean of each histogram over a run (ms), from a counters delta."""
    out: dict[str, float | None] = {}
    for h in SERVER_HISTOGRAMS:
        n = delta.get(h + "_count")
        out[h.removesuffix("_seconds")] = (delta[h + "_sum"] / n * 1e3
                                           if n and h + "_sum" in delta else None)
    return out





def median_of(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for m in METRICS:
        out[m] = {}
        for q in QUANTILES:
            vals = [r[m][f"p{q}_ms"] for r in runs if r.get(m) and r[m][f"p{q}_ms"] is not None]
            out[m][f"p{q}_ms"] = statistics.median(vals) if vals else None
    return out


def worker_cpus(server_log: Path) -> set[int]:
    """The cores vLLM's CPU backend bound its model worker to (its log's ``core ids``)."""
    try:
        text = server_log.read_text(errors="replace")
    except OSError:
        return set()
    found = re.findall(r"core ids=\[([\d, ]*)\]", text)
    return {int(x) for x in found[-1].split(",") if x.strip()} if found else set()


@contextlib.contextmanager
def clients_off(cpus: set[int], say: Callable[[str], None]) -> Iterator[set[int] | None]:
    """Keep this process and the tools it starts (they inherit it) off ``cpus``.

    The embedded server's worker spins on its bound cores; a client the kernel puts
    there takes its time slices from the model step itself, a random slowdown of the
    server that lands on whichever tool is running. Both tools get the same cores.
    """
    if not hasattr(os, "sched_setaffinity") or not cpus:
        yield None
        return
    before = os.sched_getaffinity(0)
    left = before - cpus
    if not left:
        yield None
        return
    os.sched_setaffinity(0, left)
    say(f"clients pinned to CPU {sorted(left)} (the server's worker runs on {sorted(cpus)})")
    try:
        yield left
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _target(url: str | None, workdir: Path, say: Callable[[str], None],
            nice: int = 0) -> Iterator[str]:
    """``url``, or the embedded server started (at ``nice``) for the block."""
    if url is not None:
        yield url.rstrip("/")
        return
    from agentload.replay.serve.server import embedded_server_spec, serving
    spec = embedded_server_spec()
    say("starting the embedded vLLM CPU server"
        + (f" (at nice {nice}: on the clients' core the clients come first)" if nice else "")
        + " ...")
    with serving(spec, workdir / "server.log", progress=lambda _: None, nice=nice):
        yield spec.base_url


def agreement(url: str | None = None, requests: int = 32, concurrency: int = 4,
              input_len: int = 128, output_len: int = 64, runs: int = 3,
              say: Callable[[str], None] = lambda _: None,
              workdir: Path | None = None, pin_clients: bool = True,
              server_log: Path | None = None, retries: int = 2,
              tokenizer: Path | None = None, same_prompts: bool = False,
              transport: Transport = "stamped", together: bool = False,
              warmup_requests: int | None = None) -> dict[str, Any]:
    """Run every tool ``runs`` times against one server; medians and ratios.

    ``same_prompts``: both runs of a pair send the very same token ids, so the server
    does the same work for both (its speed on a dummy-weight MoE depends on the prompts,
    which route the tokens); the server must not cache prefixes, else the second run of
    the pair is served from the first one's cache (an error says so).

    ``transport``: agentload's HTTP client. ``stamped`` (replay's default) takes each
    token's time from the kernel's receive stamp; ``aiohttp`` stamps in Python once the
    chunk is parsed, where ``vllm bench serve`` (aiohttp too) stamps: the difference
    between the two is the client's own delay to first token.

    ``together``: both tools of a pair run at the same time, each at half the
    concurrency (rounded up) and with prompts of its own, so whatever the server does
    during the window (its speed drifting between runs, a dummy-weight MoE's routing)
    it does to both alike; the server's counters then cover the pair, not one tool.

    ``warmup_requests`` (default: ``requests``, a whole run's worth; 0: none) go first,
    unmeasured, at the full concurrency: a freshly started GPU server was 17-68 % slower
    to first token in the first measured run after an 8-request warm-up.

    A pair in which either tool read over ``SPOILED_SHARE`` of its token events
    together (``spoiled_by``) is set aside and run again, up to ``retries`` times in
    all; what was set aside, and why, is in the result's ``set_aside``.

    On the embedded server both tools run on the cores its model worker is not bound
    to (``pin_clients``; see ``clients_off``): the one started here, or the local one
    at ``url`` whose ``server_log`` is given. Unpinned on the 2-core CI machine, one
    run in two read whole 48-token answers in one read and measured a TPOT of 0.
    """
    from agentload.replay.run import new_cache_salt
    from agentload.replay.serve.probe import detect_token_id_range, probe_target

    if min(requests, concurrency, runs, input_len) < 1 or output_len < 2 or retries < 0:
        raise ReplayError("--requests, --concurrency, --runs, --input-len must be >= 1, "
                          "--output-len >= 2 and --retries >= 0")
    warm = requests if warmup_requests is None else warmup_requests
    if warm < 0:
        raise ReplayError("--warmup-requests must be >= 0")
    if together and same_prompts:
        raise ReplayError("--together and --same-prompts exclude each other: run together, "
                          "the two tools' identical prompts would meet in the server's batch")
    each = -(-concurrency // 2) if together else concurrency  # per tool
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="agentload-agree-")))
        base = stack.enter_context(_target(url, workdir, say))
        log = workdir / "server.log" if url is None else server_log
        pinned = (stack.enter_context(clients_off(worker_cpus(log), say))
                  if log is not None and pin_clients else None)
        # agentload's replay makes these same 1-token probes before its window opens:
        # their share of the server's counters is taken off agentload's runs.
        before = server_counters(base)
        model, _ = probe_target(base, None, None)
        token_id_range = detect_token_id_range(base, model, None)
        probes = counters_delta(before, server_counters(base))
        tokenizer = tokenizer or tokenizer_for(model)
        ours: list[dict[str, Any]] = []
        theirs: list[dict[str, Any]] = []
        # A fresh server is slow on its first requests (allocation, warm-up): an
        # unmeasured pass first, so neither tool measures the cold start.
        if warm:
            say(f"warm-up pass of {warm} requests (not measured) ...")
            agentload_run(base, workdir / "warmup", warm, concurrency, input_len,
                          output_len, salt=0)
        set_aside: list[dict[str, Any]] = []
        attempt = 0
        while len(ours) < runs:
            i = len(ours)
            # Every attempt has prompts of its own (salts 1, 2, 3, ...; 0 warmed up).
            attempt += 1
            # Same prompts: one salt and one cache salt for both runs of the pair.
            shared = new_cache_salt() if same_prompts else None
            their_salt = 2 * attempt - 1 if same_prompts else 2 * attempt
            if together:
                say(f"run {i + 1}/{runs}: agentload and vllm bench serve together ...")
                before, ticks = server_counters(base), host_ticks()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(vllm_run, base, workdir, model, tokenizer,
                                          requests, each, input_len, output_len,
                                          token_id_range, salt=their_salt)
                    mine = agentload_run(base, workdir / f"agentload{attempt}", requests,
                                         each, input_len, output_len, salt=2 * attempt - 1,
                                         transport=transport)
                    other = pending.result()
                # one window: the server's counters and the host's load are the pair's,
                # the same for both (vllm's own host figure spans only its process)
                mine["server"] = other["server"] = counters_delta(
                    before, server_counters(base), probes)
                mine["host"] = other["host"] = host_share(ticks, host_ticks())
            else:
                say(f"run {i + 1}/{runs}: agentload ...")
                before, ticks = server_counters(base), host_ticks()
                mine = agentload_run(base, workdir / f"agentload{attempt}", requests,
                                     concurrency, input_len, output_len,
                                     salt=2 * attempt - 1, cache_salt=shared,
                                     transport=transport)
                mine["server"] = counters_delta(before, server_counters(base), probes)
                mine["host"] = host_share(ticks, host_ticks())
                say(f"run {i + 1}/{runs}: vllm bench serve ...")
                before = server_counters(base)
                other = vllm_run(base, workdir, model, tokenizer, requests, concurrency,
                                 input_len, output_len, token_id_range, salt=their_salt,
                                 cache_salt=shared)
                other["server"] = counters_delta(before, server_counters(base))
            if not other.get("ran"):
                raise ReplayError(f"vllm bench serve did not run: {other.get('reason')}")
            hits = other["server"].get("prefix_cache_hits_total") or 0
            if same_prompts and hits > requests:  # a few shared leading blocks are not
                raise ReplayError(
                    f"--same-prompts: the server served {hits:,.0f} of vllm bench serve's "
                    "prompt tokens from its prefix cache (agentload had just sent the same "
                    "prompts): start it without prefix caching (vllm serve "
                    "--no-enable-prefix-caching, or an arm with enable_prefix_caching = "
                    "false)")
            for run in (mine, other):
                run["server_ms"] = server_means_ms(run["server"])
            why = spoiled_by(mine, other)
            if why is not None and len(set_aside) < retries:
                set_aside.append({"run": i + 1, "why": why})
                say(f"run {i + 1}/{runs} set aside and run again: {why}")
                continue
            if why is not None:
                mine["kept_though"] = other["kept_though"] = why
            ours.append(mine)
            theirs.append(other)
    a, v = median_of(ours), median_of(theirs)
    ratios: dict[str, dict[str, float | None]] = {
        m: {k: _ratio(a[m][k], v[m][k]) for k in a[m]} for m in METRICS}
    # Paired: each agentload run against the vllm run right after it, then the median, so
    # drift on a shared machine between runs cancels.
    paired: dict[str, dict[str, float | None]] = {}
    for m in METRICS:
        paired[m] = {}
        for k in a[m]:
            rs = [x for x in (_ratio(o[m][k], t[m][k]) for o, t in zip(ours, theirs,
                                                                        strict=True))
                  if x is not None]
            paired[m][k] = statistics.median(rs) if rs else None
    view = {"agentload": server_view(ours), "vllm_bench": server_view(theirs)}
    worst = max((abs(r - 1) for m in ("ttft", "tpot") for r in ratios[m].values()
                 if r is not None), default=None)
    medians_within = all(_within(ratios[m]["p50_ms"], 0.03) for m in METRICS)
    paired_within = all(_within(paired[m]["p50_ms"], 0.03) for m in METRICS)
    return {"config": {"requests": requests, "concurrency": concurrency,
                       "input_len": input_len, "output_len": output_len, "runs": runs,
                       "retries": retries, "same_prompts": same_prompts,
                       "together": together, "concurrency_each": each,
                       "warmup_requests": warm,
                       "transport": transport,
                       "model": model,
                       "client_cpus": sorted(pinned) if pinned is not None else None},
            "agentload": a, "vllm_bench": v, "ratio": ratios, "paired_ratio": paired,
            "server_view": view,
            "client_valid_runs": sum(not o["client"].get("saturation_reasons")
                                     for o in ours),
            "agentload_runs": ours, "vllm_bench_runs": theirs,
            "set_aside": set_aside,
            "spoiled_kept": sum("kept_though" in o for o in ours),
            "aiperf": {"ran": False, "reason": aiperf_status() or "not wired"},
            "medians_within_3pct": medians_within, "paired_within_3pct": paired_within,
            "worst_deviation": worst}


def server_view(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool against the server's own clock, run by run: its mean TTFT minus the
    server's (the client's send and receive path), its mean per-chunk ITL over the
    server's, the server's mean TTFT (how far the server itself moved between runs),
    and the host's busy cores and stolen share."""
    def per_run(r: dict[str, Any]) -> dict[str, float | None]:
        sm = r.get("server_ms") or {}
        ttft, itl = r["ttft"].get("mean_ms"), r["itl"].get("mean_ms")
        st, si = sm.get("time_to_first_token"), sm.get("inter_token_latency")
        host = r.get("host") or {}
        return {"ttft_minus_server_ms": ttft - st if ttft is not None and st else None,
                "itl_over_server": itl / si if itl is not None and si else None,
                "server_ttft_mean_ms": st, "server_itl_mean_ms": si,
                "host_busy_cores": host.get("busy_cores"),
                "host_steal_share": host.get("steal_share")}

    rows = [per_run(r) for r in runs]
    med: dict[str, float | None] = {}
    for k in rows[0] if rows else ():
        vals = [v for x in rows if (v := x[k]) is not None]
        med[k] = statistics.median(vals) if vals else None
    return {"runs": rows, "median": med}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _within(ratio: float | None, tolerance: float) -> bool:
    return ratio is not None and abs(ratio - 1) <= tolerance


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def _num(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def agree_lines(r: dict[str, Any]) -> list[str]:
    c = r["config"]
    lines = [f"agreement on {c['model']}: {c['requests']} requests, ISL {c['input_len']}, OSL "
             f"{c['output_len']}, concurrency {c['concurrency']}, median of {c['runs']} runs"
             + (", the same prompts for both tools in each pair" if c.get("same_prompts")
                else "")
             + (", agentload on aiohttp (stamped in Python, as vllm bench serve)"
                if c.get("transport") == "aiohttp" else "")
             + (f", both tools at once ({c.get('concurrency_each')} each)"
                if c.get("together") else "")
             + (f", after {c['warmup_requests']} unmeasured warm-up requests"
                if c.get("warmup_requests") else ""),
             f"  {'metric':<10}{'agentload':>12}{'vllm bench':>12}{'ratio':>8}{'paired':>8}"]
    if c.get("client_cpus"):
        lines.insert(1, f"  both clients on CPU {c['client_cpus']}, off the server "
                        "worker's cores")
    for m in METRICS:
        for q in QUANTILES:
            k = f"p{q}_ms"
            a, v, ratio = r["agentload"][m][k], r["vllm_bench"][m][k], r["ratio"][m][k]
            pr = r["paired_ratio"][m][k]
            lines.append(f"  {m.upper() + ' P' + str(q):<10}"
                         f"{(f'{a:.2f} ms' if a is not None else 'n/a'):>12}"
                         f"{(f'{v:.2f} ms' if v is not None else 'n/a'):>12}"
                         f"{(f'{ratio:.3f}' if ratio is not None else 'n/a'):>8}"
                         f"{(f'{pr:.3f}' if pr is not None else 'n/a'):>8}")
    lines.append("  TTFT = first token chunk - sent; TPOT = (last - first chunk) / (OSL - 1) "
                 "per request (agentload's ITL); ITL = per-chunk gaps")
    lines.append("  medians of runs (TTFT, TPOT, ITL P50) within 3 %: "
                 + ("yes" if r["medians_within_3pct"] else "NO")
                 + f"; agentload runs whose client diagnostics were clean: "
                 f"{r['client_valid_runs']}/{c['runs']}")
    if "paired_within_3pct" in r:
        when = ("running at the same time" if c.get("together") else "right after it")
        lines.append(f"  paired (each agentload run against the vllm bench run {when}, so "
                     "the server's drift between runs cancels) within 3 %: "
                     + ("yes" if r["paired_within_3pct"] else "NO"))
    for x in r.get("set_aside", ()):
        lines.append(f"  run {x['run']} was set aside and run again: {x['why']}")
    if r.get("spoiled_kept"):
        lines.append(f"  {r['spoiled_kept']} kept run(s) still read events together after "
                     f"{c.get('retries', 0)} retries: their TPOT and ITL measure the clients")
    view = r.get("server_view") or {}
    if view:
        lines.append("  against the server's own clock (vllm:time_to_first_token and "
                     "inter_token_latency means), per run:")
        for tool, name in (("agentload", "agentload"), ("vllm_bench", "vllm bench")):
            rows = view[tool]["runs"]
            lines.append(f"    {name:<11}TTFT - server "
                         + " / ".join(_ms(x["ttft_minus_server_ms"]) for x in rows)
                         + "; ITL / server "
                         + " / ".join(_num(x["itl_over_server"], 3) for x in rows)
                         + "; server TTFT " + " / ".join(_ms(x["server_ttft_mean_ms"])
                                                          for x in rows)
                         + "; host busy " + " / ".join(_num(x["host_busy_cores"], 2)
                                                       for x in rows)
                         + " cores, steal " + " / ".join(
                             "n/a" if x["host_steal_share"] is None
                             else f"{x['host_steal_share']:.1%}" for x in rows))
        srv = [x["server_ttft_mean_ms"] for t in ("agentload", "vllm_bench")
               for x in view[t]["runs"] if x["server_ttft_mean_ms"]]
        if srv:
            lines.append(f"  the server's own mean TTFT moved {min(srv):.1f}-{max(srv):.1f} "
                         f"ms between runs ({max(srv) / min(srv) - 1:.0%}): the part of any "
                         "TTFT gap that no client can remove")
        itl = [x["server_itl_mean_ms"] for t in ("agentload", "vllm_bench")
               for x in view[t]["runs"] if x["server_itl_mean_ms"]]
        if itl:
            lines.append(f"  and its mean ITL {min(itl):.2f}-{max(itl):.2f} ms "
                         f"({max(itl) / min(itl) - 1:.0%})")
    lines.append(f"  AIPerf: not run: {r['aiperf']['reason'][:240]}")
    return lines
