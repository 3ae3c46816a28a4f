"""``agentload bench client``: is the client ever the bottleneck, and how true are its stamps?

It starts the loopback emulator (test equipment, its own process), then against the same
emulator and schedule, in one run: agentload's client (lanes sharded over worker
processes, the stamped transport), ``vllm bench serve`` (``vllm.benchmarks.serve`` in a
subprocess) and AIPerf where it is installed. For agentload it reports delivered vs
offered token events/s, client CPU per event, the error of its stamps against the
emulator's emission stamps (the recorded stamp, the kernel receive stamp and the Python
stamp; p50/p99), events per read, event-loop lag, GC pauses and schedule lag, and the
emulator's own CPU (a saturated emulator makes the run invalid). Delivered events/s is
token events received / (last event - first send), for every tool alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from agentload.replay.bench.emulator import EMULATOR_MODEL
from agentload.replay.bench.hostload import busy_cores, host_busy
from agentload.replay.bench.workers import (
    ShardResult,
    ShardSpec,
    run_shards,
    run_shards_ray,
    split,
)
from agentload.replay.errors import ReplayError
from agentload.replay.serve.server import free_port

VLLM_BENCH = ("import argparse, sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "p = argparse.ArgumentParser()\n"
              "add_cli_args(p)\n"
              "main(p.parse_args(sys.argv[1:]))\n")


@dataclass(frozen=True, slots=True)
class ClientBenchConfig:
    """One client benchmark: the load (closed loop) and the emulator's schedule."""

    streams: int = 1000
    requests: int | None = None  # default: 4 per stream
    max_tokens: int = 200
    prompt_tokens: int = 16
    workers: int = 2
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    jitter_ms: float = 0.0
    tokens_per_event: int = 1
    vllm_bench: bool = True
    aiperf: bool = True
    gc_mode: str = "off"
    # The emulator as this many processes sharing its port (SO_REUSEPORT), pinned to
    # emulator_cpus round-robin; agentload's workers pinned to worker_cpus.
    emulator_procs: int = 1
    emulator_cpus: tuple[int, ...] = ()
    worker_cpus: tuple[int, ...] = ()
    # Workers as Ray actors over this cluster's nodes instead of local processes.
    ray_address: str | None = None

    @property
    def total_requests(self) -> int:
        return self.requests if self.requests is not None else 4 * self.streams

    def request_s(self) -> float:
        """How long one request lasts on the emulator's schedule (s)."""
        events = -(-self.max_tokens // self.tokens_per_event)
        # The first event comes at the first step at least TTFT after arrival.
        return (self.ttft_ms + self.itl_ms * (events - 0.5)) / 1e3

    def offered_events_per_s(self) -> float:
        """Token events/s the emulator offers when every stream is always busy."""
        events = -(-self.max_tokens // self.tokens_per_event)
        return self.streams * events / self.request_s()


def _q(values: np.ndarray, p: float) -> float | None:
    # Linear interpolation between order statistics (numpy's default, stated).
    return float(np.percentile(values, p)) if values.size else None


def _ms(values: np.ndarray) -> dict[str, float | None]:
    v = values / 1e6
    return {"p50_ms": _q(v, 50), "p99_ms": _q(v, 99),
            "max_ms": float(v.max()) if v.size else None}


# Each emulator URL's control URLs: one per process when several share its port.
_CONTROLS: dict[str, list[str]] = {}


@contextlib.contextmanager
def emulator(cfg: ClientBenchConfig, log: Path, cpu: int | None = None) -> Iterator[str]:
    """Start the emulator (``cfg.emulator_procs`` processes on one port); yield its base
    URL; stop it."""
    port = free_port()
    procs_n = max(1, cfg.emulator_procs)
    cpus = list(cfg.emulator_cpus) or ([cpu] if cpu is not None else [])
    procs: list[subprocess.Popen[bytes]] = []
    controls: list[str] = []
    url = f"http://127.0.0.1:{port}"
    try:
        for i in range(procs_n):
            argv = [sys.executable, "-P", "-m", "agentload.replay.bench.emulator", "--port",
                    str(port), "--ttft-ms", str(cfg.ttft_ms), "--itl-ms", str(cfg.itl_ms),
                    "--jitter-ms", str(cfg.jitter_ms), "--tokens-per-event",
                    str(cfg.tokens_per_event), "--nice", "-10", "--seed", str(i)]
            if procs_n > 1:
                control = free_port()
                argv += ["--reuse-port", "--control-port", str(control)]
                controls.append(f"http://127.0.0.1:{control}")
            if cpus:
                argv += ["--cpu", str(cpus[i % len(cpus)])]
            path = log if procs_n == 1 else log.with_name(f"{log.stem}-{i}{log.suffix}")
            with path.open("w") as fh:
                procs.append(subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        for i, check in enumerate(controls or [url]):
            while True:
                if procs[i].poll() is not None:
                    own = log if procs_n == 1 else log.with_name(f"{log.stem}-{i}{log.suffix}")
                    raise ReplayError(f"emulator process {i} exited at start: "
                                      f"{own.read_text()[-500:].strip()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(check + "/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ReplayError("the emulator did not answer /health within 30 s")
                time.sleep(0.1)
        _CONTROLS[url] = controls or [url]
        yield url
    finally:
        _CONTROLS.pop(url, None)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def emulator_stats(url: str, reset: bool = False) -> dict[str, Any]:
    """The emulator's own figures (merged over its processes when there are several)."""
    parts = []
    for control in _CONTROLS.get(url, [url]):
        parts.append(httpx.get(control + "/_emulator/stats", timeout=10).json())
        if reset:
            httpx.get(control + "/_emulator/reset", timeout=10)
    return parts[0] if len(parts) == 1 else merge_emulator_stats(parts)


def merge_emulator_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several emulator processes as one: counts summed, lags and CPU the worst one's (a
    saturated process makes the whole emulator saturated). Each process's peak of
    running streams is kept; their sum is an upper bound of the whole emulator's peak
    (the processes' peaks need not coincide), reported as such."""
    out = dict(parts[0])
    for key in ("requests", "events", "tokens", "steps"):
        out[key] = sum(int(p.get(key) or 0) for p in parts)
    peaks = [int(p.get("max_running_streams") or 0) for p in parts]
    out.pop("max_running_streams", None)
    out["max_running_streams_per_process"] = peaks
    out["max_running_streams_at_most"] = sum(peaks)
    for key in ("step_lag_p50_ms", "step_lag_p99_ms", "step_lag_max_ms", "step_write_p50_ms",
                "step_write_p99_ms", "cpu_mean", "cpu_max"):
        values = [p[key] for p in parts if p.get(key) is not None]
        out[key] = max(values) if values else None
    saturated = [p for p in parts if p.get("saturated")]
    out["saturated"] = bool(saturated)
    out["verdict"] = saturated[0]["verdict"] if saturated else "ok"
    out["pid"] = [p.get("pid") for p in parts]
    out["processes"] = len(parts)
    return out


def window_rate(times_ns: np.ndarray, first_ns: int, last_ns: int) -> float:
    """Events/s inside the middle half of [first, last]: the steady part of a run."""
    a = first_ns + (last_ns - first_ns) // 4
    b = last_ns - (last_ns - first_ns) // 4
    inside = int(((times_ns >= a) & (times_ns < b)).sum())
    return inside / max((b - a) / 1e9, 1e-9)


def timed_mask(gaps_ns: np.ndarray, first: np.ndarray, min_gap_ns: int) -> np.ndarray:
    """Which token events were observed on their own (one boolean per event).

    The emulator writes one event per stream per engine step, so consecutive events of a
    stream are at least about one ITL apart when they are written. A client that fell
    behind reads several at once (and stamps them within µs of each other): those
    events were received but not timed. ``gaps_ns`` is each event's recorded gap from
    the previous event of its request and ``first`` marks each request's first event
    (always timed). The same rule is applied to every tool's recorded stamps.
    """
    return first | (gaps_ns >= min_gap_ns)


def min_gap_ns(cfg: ClientBenchConfig) -> int:
    """The shortest gap that counts as a separately timed event: a quarter of the ITL
    (jitter moves steps by at most 0.7 ITL; coalesced events are µs apart)."""
    return int(cfg.itl_ms * 1e6 / 4)


def merge(results: list[ShardResult], min_gap: int = 0) -> dict[str, Any]:
    """The shards' raw samples concatenated, and the figures computed from them exactly."""
    def cat(name: str) -> np.ndarray:
        return np.concatenate([np.frombuffer(getattr(r, name), dtype=np.int64)
                               for r in results]) if results else np.zeros(0, np.int64)

    event, user, emit = cat("event_ns"), cat("user_ns"), cat("emit_ns")
    events = int(event.size)
    first = min(r.first_send_ns for r in results)
    last = max(r.last_event_ns for r in results)
    duration = max((last - first) / 1e9, 1e-9)
    cpu = sum(r.cpu_s for r in results)
    reads = sum(r.reads for r in results)
    multi = sum(r.multi_event_reads for r in results)
    kernel = all(r.kernel_stamps for r in results)
    has_emit = emit.size == events and events > 0 and bool((emit > 0).all())
    err: dict[str, Any] = {}
    steady_err: dict[str, Any] = {}
    a, b = first + (last - first) // 4, last - (last - first) // 4
    mid = (event >= a) & (event < b)
    if has_emit:
        for into, sel in ((err, slice(None)), (steady_err, mid)):
            into["recorded_minus_emit"] = _ms((event - emit)[sel])
            into["python_minus_emit"] = _ms((user - emit)[sel])
            if kernel:
                into["kernel_minus_emit"] = _ms((event - emit)[sel])
                into["python_minus_kernel"] = _ms((user - event)[sel])
    # Per-request gaps of the recorded stamps: which events were timed on their own.
    sizes = cat("request_events")
    timed_rate = None
    if sizes.size and int(sizes.sum()) == events:
        starts = np.zeros(events, dtype=bool)
        starts[np.concatenate(([0], np.cumsum(sizes)[:-1]))] = True
        gaps = np.diff(event, prepend=event[:1])
        timed = timed_mask(gaps, starts, min_gap)
        timed_rate = window_rate(event[timed], first, last)
    ok = sum(r.ok for r in results)
    failed = sum(r.failed for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    return {
        "workers": len(results),
        "loop": results[0].loop if results else None,
        "kernel_stamps": kernel,
        "requests_ok": ok,
        "requests_failed": failed,
        "errors": errors,
        "events": events,
        "duration_s": duration,
        "events_per_s": window_rate(event, first, last),
        "events_per_s_overall": events / duration,
        "timed_events_per_s": timed_rate,
        "cpu_s": cpu,
        "cpu_cores": cpu / duration,
        "cpu_per_event_us": (cpu / events * 1e6) if events else None,
        "timestamp_error": steady_err,
        "timestamp_error_whole_run": err,
        "p99_timestamp_error_ms": (steady_err.get("recorded_minus_emit") or {}).get("p99_ms"),
        "p99_timestamp_error_whole_run_ms": (err.get("recorded_minus_emit") or {}).get("p99_ms"),
        "events_per_read": (events / reads) if reads else None,
        "multi_event_read_share": (multi / reads) if reads else None,
        "max_events_per_read": max((r.max_events_per_read for r in results), default=0),
        "loop_lag": _ms(cat("loop_lag_ns")),
        "schedule_lag": _ms(cat("schedule_lag_ns")),
        "ttft": _ms(cat("ttft_ns")),
        "gc_collections": sum(r.gc_collections for r in results),
        "gc_max_pause_ms": max((r.gc_max_pause_ns for r in results), default=0) / 1e6,
    }


def run_agentload(url: str, cfg: ClientBenchConfig) -> dict[str, Any]:
    before, t0 = host_busy(), time.perf_counter()
    out = _run_agentload(url, cfg)
    host = busy_cores(before, host_busy())
    out["host_busy_cores"] = host
    out["host_load_avg"] = os.getloadavg()
    from agentload.replay.client.diagnostics import saturation_reasons
    wall = time.perf_counter() - t0
    out["saturation_reasons"] = saturation_reasons({
        "cpu_cores": None,  # several workers: judged per event below, not per core
        "multi_event_read_share": out["multi_event_read_share"],
        "loop_lag_p99_s": (out["loop_lag"]["p99_ms"] or 0) / 1e3,
        "stamp_error_p99_s": ((out["timestamp_error"].get("python_minus_kernel") or {})
                              .get("p99_ms") or 0) / 1e3})
    out["wall_s"] = wall
    return out


def _run_agentload(url: str, cfg: ClientBenchConfig) -> dict[str, Any]:
    lanes = split(cfg.streams, cfg.workers)
    requests = split(cfg.total_requests, cfg.workers)
    cpus = cfg.worker_cpus
    specs = [ShardSpec(i, cfg.workers, url, lanes[i], requests[i], max_tokens=cfg.max_tokens,
                       prompt_tokens=cfg.prompt_tokens, stagger_s=cfg.request_s(),
                       gc_mode="on" if cfg.gc_mode == "on" else "off",
                       cpu=cpus[i % len(cpus)] if cpus else None)
             for i in range(cfg.workers) if lanes[i]]
    if cfg.ray_address is not None:
        return merge(run_shards_ray(specs, EMULATOR_MODEL, cfg.ray_address), min_gap_ns(cfg))
    return merge(run_shards(specs, EMULATOR_MODEL), min_gap_ns(cfg))


def vllm_bench_available() -> str | None:
    """Why ``vllm bench serve`` cannot run here, or ``None`` when it can.

    Only the top-level package is looked up: ``find_spec`` of a submodule imports its
    parents, and ``import vllm`` brings torch and triton into this process (seconds,
    hundreds of MB, and triton's leak report printed at exit). ``vllm bench serve``
    runs in a child process of its own.
    """
    import importlib.util
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        return f"vllm is not importable: {exc}"
    roots = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not any((Path(r) / "benchmarks" / "serve.py").is_file() for r in roots):
        return "vllm is not installed (vllm.benchmarks.serve not found)"
    return None


def run_vllm_bench(url: str, cfg: ClientBenchConfig, workdir: Path, tokenizer: Path,
                   model: str = EMULATOR_MODEL, num_prompts: int | None = None,
                   input_len: int | None = None, output_len: int | None = None,
                   concurrency: int | None = None, request_rate: float | None = None,
                   timeout_s: float = 1800.0, min_gap: int = 0) -> dict[str, Any]:
    """``vllm bench serve`` (random prompts, ignore_eos) against ``url``; its figures."""
    why = vllm_bench_available()
    if why is not None:
        return {"ran": False, "reason": why}
    name = f"vllm-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-P", "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(input_len or cfg.prompt_tokens),
            "--random-output-len", str(output_len or cfg.max_tokens),
            "--random-range-ratio", "0", "--ignore-eos",
            # Greedy, like agentload's requests, so both tools ask for identical work.
            "--temperature", "0",
            "--num-prompts", str(num_prompts or cfg.total_requests),
            "--max-concurrency", str(concurrency or cfg.streams),
            # Arrivals at the steady turnover rate (streams / request time), like
            # agentload's staggered lanes; the concurrency cap keeps it closed loop.
            "--request-rate", str(request_rate) if request_rate else "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(workdir),
            "--result-filename", name, "--disable-tqdm", "--num-warmups", "0",
            "--seed", str(time.monotonic_ns() % 100000)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    log = workdir / (name + ".log")
    # Its CPU during the measured part only (not vllm's import or the dataset): the
    # process's own clock when it prints the start and the end of the benchmark.
    cpu_marks: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    with log.open("w") as fh:
        # On the cores agentload's workers had, when they were pinned: the same room.
        cpus = set(cfg.worker_cpus)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, text=True, bufsize=1,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus
                                else None)
        assert proc.stdout is not None
        for line in proc.stdout:
            fh.write(line)
            if "Starting main benchmark run" in line:
                cpu_marks["start"] = _proc_cpu_s(proc.pid)
            elif "Serving Benchmark Result" in line:
                cpu_marks["end"] = _proc_cpu_s(proc.pid)
            if time.monotonic() > deadline:
                proc.kill()
                break
        proc.wait()
    path = workdir / name
    if proc.returncode != 0 or not path.is_file():
        return {"ran": False, "reason": f"vllm bench serve exited {proc.returncode}: "
                                        f"{log.read_text()[-800:]}"}
    data = json.loads(path.read_text())
    ttfts = [t for t in data.get("ttfts", []) if t]
    events = sum(len(itl) + 1 for itl, t in zip(data.get("itls", []), data.get("ttfts", []),
                                                strict=False) if t)
    duration = float(data["duration"])
    # Each event's time, rebuilt from start + TTFT + cumulative ITLs (perf_counter s).
    times = [np.cumsum([st + t, *itl]) for st, t, itl in zip(
        data.get("start_times", []), data.get("ttfts", []), data.get("itls", []),
        strict=False) if t]
    steady = timed_rate = None
    if times:
        ns = (np.concatenate(times) * 1e9).astype(np.int64)
        first = int(min(data["start_times"]) * 1e9)
        steady = window_rate(ns, first, int(ns.max()))
        # The same "timed on its own" rule as agentload's, on vllm bench's own gaps.
        gaps = np.concatenate([[0.0, *itl] for itl, t in zip(
            data.get("itls", []), data.get("ttfts", []), strict=False) if t]) * 1e9
        starts = np.concatenate([[True] + [False] * len(itl) for itl, t in zip(
            data.get("itls", []), data.get("ttfts", []), strict=False) if t])
        timed = timed_mask(gaps.astype(np.int64), starts, min_gap)
        timed_rate = window_rate(ns[timed], first, int(ns.max()))
    cpu = (cpu_marks["end"] - cpu_marks["start"]
           if {"start", "end"} <= cpu_marks.keys() else None)
    return {"ran": True, "completed": data.get("completed"), "failed": data.get("failed"),
            "duration_s": duration, "events": events,
            "cpu_s": cpu, "cpu_per_event_us": (cpu / events * 1e6) if cpu and events else None,
            "events_per_s": steady,
            "events_per_s_overall": events / duration if duration else None,
            "timed_events_per_s": timed_rate,
            "output_throughput_tok_s": data.get("output_throughput"),
            "ttft_p50_ms": data.get("median_ttft_ms"), "ttft_p90_ms": data.get("p90_ttft_ms"),
            "itl_p50_ms": data.get("median_itl_ms"), "itl_p90_ms": data.get("p90_itl_ms"),
            "tpot_p50_ms": data.get("median_tpot_ms"), "tpot_p90_ms": data.get("p90_tpot_ms"),
            "ttfts_s": ttfts, "itls_s": data.get("itls", []),
            "output_lens": data.get("output_lens", [])}


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def aiperf_status() -> str | None:
    """Why AIPerf cannot run here, or ``None`` when its CLI is installed."""
    if shutil.which("aiperf") or Path(sys.executable).with_name("aiperf").is_file():
        return None
    return ("aiperf runs from its own virtualenv (it pins textual, orjson and pandas against "
            "this project's): `make peers` builds .peers/aiperf, and `agentload bench agree "
            "--peer aiperf --trace DIR` runs it side by side with agentload")


def _emulator_up(stack: contextlib.ExitStack, cfg: ClientBenchConfig, workdir: Path | None,
                 prefix: str, note: Any) -> tuple[str, Path]:
    """The emulator started for a benchmark (in ``workdir``, else a temporary folder that
    ``stack`` removes), its books reset; its URL and the folder."""
    if workdir is None:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    url = stack.enter_context(emulator(cfg, workdir / "emulator.log"))
    note(f"emulator (test equipment, {cfg.emulator_procs} process(es)) at {url}; offered "
         f"{cfg.offered_events_per_s():,.0f} token events/s at {cfg.streams} streams")
    emulator_stats(url, reset=True)
    return url, workdir


def client_benchmark(cfg: ClientBenchConfig, workdir: Path | None = None,
                     say: Any = None) -> dict[str, Any]:
    """The whole benchmark: emulator up, every client in turn against it, figures."""
    def note(line: str) -> None:
        if say is not None:
            say(line)

    if cfg.workers < 1 or cfg.streams < 1:
        raise ReplayError("--workers and --streams must be at least 1")
    with contextlib.ExitStack() as stack:
        url, workdir = _emulator_up(stack, cfg, workdir, "agentload-client-bench-", note)
        note(f"agentload: {cfg.workers} worker process(es), {cfg.total_requests} requests ...")
        agent = run_agentload(url, cfg)
        agent["emulator"] = emulator_stats(url, reset=True)
        vllm: dict[str, Any] = {"ran": False, "reason": "not asked (--no-vllm-bench)"}
        if cfg.vllm_bench:
            from agentload.replay.serve.tiny_model import ensure_tiny_model
            note("vllm bench serve against the same emulator ...")
            before = host_busy()
            vllm = run_vllm_bench(url, cfg, workdir, ensure_tiny_model(),
                                  request_rate=cfg.streams / cfg.request_s(),
                                  min_gap=min_gap_ns(cfg))
            vllm["host_busy_cores"] = busy_cores(before, host_busy())
            vllm["host_load_avg"] = os.getloadavg()
            if vllm.get("ran"):
                vllm["emulator"] = emulator_stats(url, reset=True)
            for key in ("ttfts_s", "itls_s", "output_lens"):
                vllm.pop(key, None)
        why_not = aiperf_status() if cfg.aiperf else "not asked (--no-aiperf)"
        aiperf: dict[str, Any] = {"ran": False, "reason": why_not or "not wired"}
    ratio = ratio_overall = ratio_timed = None
    if vllm.get("ran") and vllm.get("timed_events_per_s") and agent.get("timed_events_per_s"):
        ratio_timed = agent["timed_events_per_s"] / vllm["timed_events_per_s"]
    if vllm.get("ran") and vllm.get("events_per_s"):
        ratio = agent["events_per_s"] / vllm["events_per_s"]
        ratio_overall = agent["events_per_s_overall"] / vllm["events_per_s_overall"]
    invalid = [f"{who}: emulator {s['verdict']}" for who, s in
               (("agentload", agent["emulator"]), ("vllm bench", vllm.get("emulator") or {}))
               if s.get("saturated")]
    # agentload's own error budget: a client that fell behind says so (diagnostics.py).
    invalid += [f"agentload: {reason}" for reason in agent["saturation_reasons"]]
    return {
        "config": {"streams": cfg.streams, "requests": cfg.total_requests,
                   "max_tokens": cfg.max_tokens, "workers": cfg.workers,
                   "ttft_ms": cfg.ttft_ms, "itl_ms": cfg.itl_ms,
                   "tokens_per_event": cfg.tokens_per_event, "gc": cfg.gc_mode,
                   "cpus": os.cpu_count()},
        "offered_events_per_s": cfg.offered_events_per_s(),
        "agentload": agent,
        "vllm_bench": vllm,
        "aiperf": aiperf,
        "agentload_events_per_s": agent["events_per_s"],
        "vllm_bench_events_per_s": vllm.get("events_per_s"),
        "ratio_vs_vllm_bench": ratio,
        "ratio_vs_vllm_bench_overall": ratio_overall,
        # Events each tool timed on its own (recorded gap >= ITL/4 from the previous one
        # of its request): a client that falls behind still receives every event, but
        # reads several at once and stamps them together.
        "agentload_timed_events_per_s": agent.get("timed_events_per_s"),
        "vllm_bench_timed_events_per_s": vllm.get("timed_events_per_s"),
        "ratio_timed_vs_vllm_bench": ratio_timed,
        # CPU per event is the cost that tenant noise on a shared machine does not move.
        "cpu_per_event_ratio_vllm_over_agentload": (
            vllm["cpu_per_event_us"] / agent["cpu_per_event_us"]
            if vllm.get("cpu_per_event_us") and agent.get("cpu_per_event_us") else None),
        # The error of the stamps agentload records (the kernel's receive stamp of the
        # read an event ended in) against the emulator's emission stamp, steady half.
        "p99_timestamp_error_ms": agent["p99_timestamp_error_ms"],
        # How late the Python stamp (when the loop served the socket) is after the
        # kernel's: what a user-space-stamping client would report as its error.
        "p99_python_minus_kernel_ms": ((agent["timestamp_error"].get("python_minus_kernel")
                                        or {}).get("p99_ms")),
        "aiperf_events_per_s": aiperf.get("events_per_s"),
        "ratio_vs_aiperf": None,
        "valid": not invalid,
        "invalid_reasons": invalid,
    }


def scaling_benchmark(cfg: ClientBenchConfig, worker_counts: list[int],
                      workdir: Path | None = None, say: Any = None) -> dict[str, Any]:
    """agentload alone at each worker count against one emulator, in one run: delivered
    token events/s, and its ratio to the count times the first count's per worker, capped
    at the offered rate (the scaling efficiency), with each run's stamp error and the
    emulator's verdict."""
    def note(line: str) -> None:
        if say is not None:
            say(line)

    if not worker_counts or min(worker_counts) < 1:
        raise ReplayError("--workers must list counts of at least 1, e.g. 1,2,4,8")
    rows = []
    with contextlib.ExitStack() as stack:
        url, _ = _emulator_up(stack, cfg, workdir, "agentload-client-scaling-", note)
        for workers in worker_counts:
            note(f"agentload: {workers} worker process(es) ...")
            agent = run_agentload(url, replace(cfg, workers=workers, ray_address=None))
            emu = emulator_stats(url, reset=True)
            row = {"workers": workers, "events_per_s": agent["events_per_s"],
                   "p99_timestamp_error_ms": agent["p99_timestamp_error_ms"],
                   "multi_event_read_share": agent["multi_event_read_share"],
                   "saturation_reasons": agent["saturation_reasons"],
                   "emulator_cpu_max": emu.get("cpu_max"),
                   "emulator_saturated": bool(emu.get("saturated"))}
            if cfg.ray_address is not None:
                # The same count as Ray actors, right after, against the same emulator.
                note(f"agentload: {workers} Ray actor(s) ...")
                on_ray = run_agentload(url, replace(cfg, workers=workers))
                ray_emu = emulator_stats(url, reset=True)
                row |= {"ray_events_per_s": on_ray["events_per_s"],
                        "ray_over_local": on_ray["events_per_s"] / agent["events_per_s"]
                        if agent["events_per_s"] else None,
                        "ray_p99_timestamp_error_ms": on_ray["p99_timestamp_error_ms"],
                        "ray_emulator_saturated": bool(ray_emu.get("saturated"))}
            rows.append(row)
    base = rows[0]
    per_worker = base["events_per_s"] / base["workers"] if base["events_per_s"] else None
    for row in rows:
        # Against what N workers could deliver: N x the first count's per worker, but never
        # more than the emulator offers (the scaling holds "up to the ceiling").
        ideal = (min(row["workers"] * per_worker, cfg.offered_events_per_s())
                 if per_worker else None)
        row["efficiency"] = row["events_per_s"] / ideal if ideal else None
    return {"config": {"streams": cfg.streams, "requests": cfg.total_requests,
                       "max_tokens": cfg.max_tokens, "ttft_ms": cfg.ttft_ms,
                       "itl_ms": cfg.itl_ms, "emulator_procs": cfg.emulator_procs,
                       "emulator_cpus": list(cfg.emulator_cpus),
                       "worker_cpus": list(cfg.worker_cpus), "cpus": os.cpu_count(),
                       "ray_address": cfg.ray_address},
            "offered_events_per_s": cfg.offered_events_per_s(), "rows": rows}


def scaling_lines(r: dict[str, Any]) -> list[str]:
    """The scaling table as the console prints it."""
    c = r["config"]
    lines = [f"agentload client scaling: {c['streams']} streams, {c['max_tokens']} tokens, "
             f"emulator TTFT {c['ttft_ms']:g} ms ITL {c['itl_ms']:g} ms, "
             f"{c['emulator_procs']} emulator process(es) on CPUs {c['emulator_cpus'] or 'any'}, "
             f"workers on CPUs {c['worker_cpus'] or 'any'}; offered "
             f"{r['offered_events_per_s']:,.0f} events/s; ideal = min(N x the first "
             "count's events/s per worker, offered)",
             f"  {'workers':>7}  {'events/s':>10}  {'vs ideal':>8}  {'stamp p99':>9}  "
             f"{'emulator CPU':>12}"]
    for row in r["rows"]:
        eff = f"{row['efficiency']:.2f}" if row["efficiency"] is not None else "n/a"
        p99 = (f"{row['p99_timestamp_error_ms']:.3f} ms"
               if row["p99_timestamp_error_ms"] is not None else "n/a")
        cpu = f"{row['emulator_cpu_max']:.0%}" if row["emulator_cpu_max"] is not None else "n/a"
        flag = " (emulator saturated)" if row["emulator_saturated"] else ""
        ray = ""
        if row.get("ray_events_per_s") is not None:
            ray = (f"  Ray {row['ray_events_per_s']:,.0f} events/s "
                   f"({row['ray_over_local']:.2f} x local)")
        lines.append(f"  {row['workers']:>7}  {row['events_per_s']:>10,.0f}  {eff:>8}  "
                     f"{p99:>9}  {cpu:>12}{flag}{ray}")
    return lines


def _untimed(tool: dict[str, Any]) -> float | None:
    """The share of a tool's steady events that it did not time on their own."""
    raw, timed = tool.get("events_per_s"), tool.get("timed_events_per_s")
    return 1 - timed / raw if raw and timed is not None else None


def report_lines(r: dict[str, Any]) -> list[str]:
    """The console table of ``client_benchmark``'s result."""
    a, v = r["agentload"], r["vllm_bench"]

    def f(x: Any, spec: str = ",.0f") -> str:
        return "n/a" if x is None else format(x, spec)

    c = r["config"]
    lines = [f"client benchmark: {c['streams']} streams, {c['requests']} requests x "
             f"{c['max_tokens']} tokens, emulator TTFT {c['ttft_ms']:g} ms, ITL "
             f"{c['itl_ms']:g} ms, {c['tokens_per_event']} token(s)/event; "
             f"{c['cpus']} CPUs (shared)",
             f"  offered token events/s          {f(r['offered_events_per_s'])}",
             "  token events/s delivered: steady (middle half of the run) / whole run",
             f"  agentload                       {f(a['events_per_s'])} / "
             f"{f(a['events_per_s_overall'])}  ({a['workers']} workers, {a['loop']}, "
             f"{a['requests_ok']} ok, {a['requests_failed']} failed)",
             f"  vllm bench serve                {f(v.get('events_per_s'))} / "
             f"{f(v.get('events_per_s_overall'))}"
             + ("" if v.get("ran") else f"  (not run: {v.get('reason', '')[:160]})"),
             f"  ratio agentload / vllm bench    {f(r['ratio_vs_vllm_bench'], '.2f')} / "
             f"{f(r['ratio_vs_vllm_bench_overall'], '.2f')}",
             "  token events/s timed on their own (steady; recorded gap >= ITL/4, the same "
             "rule for both)",
             "  (a client behind reads several events at once: it receives them but stamps them"
             " together)",
             f"  agentload / vllm bench          {f(a.get('timed_events_per_s'))} / "
             f"{f(v.get('timed_events_per_s'))}  (ratio "
             f"{f(r.get('ratio_timed_vs_vllm_bench'), '.2f')})",
             f"  not timed (read with others)    agentload "
             f"{f(_untimed(a), '.1%')}, vllm bench {f(_untimed(v), '.1%')}",
             "  AIPerf                          "
             + (f"{f(r['aiperf_events_per_s'])}" if r["aiperf"].get("ran")
                else f"not run: {r['aiperf'].get('reason', '')[:200]}"),
             f"  CPU per token event             agentload {f(a['cpu_per_event_us'], '.1f')} us "
             f"({f(a['cpu_cores'], '.2f')} cores), vllm bench "
             f"{f(v.get('cpu_per_event_us'), '.1f')} us"]
    lines.append("  stamp error vs emission (steady half; whole-run p99 in brackets)")
    for name, e in a["timestamp_error"].items():
        whole = a["timestamp_error_whole_run"][name]
        lines.append(f"  {name.replace('_', ' '):<32}p50 {f(e['p50_ms'], '.3f')} ms, "
                     f"p99 {f(e['p99_ms'], '.3f')} ms, max {f(e['max_ms'], '.3f')} ms "
                     f"[{f(whole['p99_ms'], '.3f')}]")
    lines += [
        f"  events per read                 {f(a['events_per_read'], '.3f')} "
        f"(reads with > 1: {f(a['multi_event_read_share'], '.1%')}, max "
        f"{a['max_events_per_read']})",
        f"  event-loop lag                  p50 {f(a['loop_lag']['p50_ms'], '.3f')} ms, "
        f"p99 {f(a['loop_lag']['p99_ms'], '.3f')} ms",
        f"  schedule lag                    p99 {f(a['schedule_lag']['p99_ms'], '.3f')} ms",
        f"  GC                              {a['gc_collections']} collections, max pause "
        f"{a['gc_max_pause_ms']:.2f} ms",
        f"  host busy cores (all tenants)   agentload run {f(a.get('host_busy_cores'), '.2f')}"
        f", vllm run {f(v.get('host_busy_cores'), '.2f')}; load average "
        f"{', '.join(f'{x:.1f}' for x in a.get('host_load_avg') or ())}",
        f"  emulator CPU                    agentload run max "
        f"{f(a['emulator'].get('cpu_max'), '.0%')}, vllm run max "
        f"{f((v.get('emulator') or {}).get('cpu_max'), '.0%')}; step lag p99 "
        f"{f(a['emulator'].get('step_lag_p99_ms'), '.3f')} ms",
        "  verdict                         " + ("valid" if r["valid"] else
                                                "INVALID: " + "; ".join(r["invalid_reasons"])),
    ]
    return lines
