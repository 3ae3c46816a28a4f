"""Synthetic run directories: a journal as a replay of N users would have written it.

For the dashboard's benchmark (a 1,000-user run played back without a server), its
tests and trying it out. Each lane plays sessions of main turns, one after another:
a pause (think / tool time), then prefill (TTFT) and decode (OSL tokens at an ITL
that grows with the number of requests decoding, as on a loaded server); some turns
fan out to subagents the next main turn waits for; a few requests fail. The journal
holds exactly the lines the engine writes (run, events, requests in finish order,
server metrics every second), so ``agentload dashboard`` and ``agentload report``
read it like a real one.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from agentload.replay.client.diagnostics import saturation_reasons
from agentload.replay.journal import JOURNAL_NAME, RequestRecord

ERROR_KINDS = ("stall", "http_5xx", "cut")


@dataclass(frozen=True, slots=True)
class SyntheticRun:
    """What :func:`write_synthetic_run` wrote."""

    run_dir: Path
    users: int
    duration_s: float
    requests: int
    failed: int
    lines: int


def _ns(s: float) -> int:
    return int(s * 1e9)


def write_synthetic_run(run_dir: Path, users: int = 1000, duration_s: float = 600.0,
                        seed: int = 0, turns: int = 12, pause_s: tuple[float, float] = (
                            2.0, 20.0), error_rate: float = 0.003,
                        subagent_rate: float = 0.15, label: str = "synthetic-arm",
                        gpus: int = 8, client_saturated_at_s: float | None = None,
                        ) -> SyntheticRun:
    """Write ``run.json`` and ``journal.jsonl`` of a ``users``-lane run to ``run_dir``.

    The client's self-diagnostics come once a second, healthy, until
    ``client_saturated_at_s`` (when given): from then on its event loop lags by more
    than the valid budget and the run turns invalid.
    """
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[int, bytes]] = []  # (time the engine would write it, line)

    def emit(t_ns: int, obj: dict[str, Any]) -> None:
        lines.append((t_ns, orjson.dumps(obj)))

    # Load shape: ITL rises with concurrency (a crude batch-size model).
    base_itl = 0.012
    per_user_itl = 0.028 / max(1, users)
    requests = failed = 0
    sessions = 0
    for lane in range(users):
        t = rng.uniform(0.0, 3.0)
        play = 0
        while t < duration_s:
            session = f"s{sessions:05d}"
            sessions += 1
            n_turns = rng.randint(max(2, turns // 2), turns + turns // 2)
            start_turn = rng.randint(0, n_turns // 2) if play == 0 else 0
            emit(_ns(t), {"type": "event", "kind": "play", "t_ns": _ns(t), "lane": lane,
                          "play": play, "session_id": session, "start_turn": start_turn,
                          "main_turns": n_turns, "requests": n_turns - start_turn,
                          "warmup_requests": 0, "marker_block": None})
            if play:
                emit(_ns(t), {"type": "event", "kind": "recycle", "t_ns": _ns(t),
                              "lane": lane, "play": play, "session": session})
            ready: float | None = None
            isl = rng.randint(2000, 8000)
            for k in range(start_turn, n_turns):
                if t >= duration_s:
                    break
                intended = t + rng.uniform(*pause_s) * (0.2 if k == start_turn else 1.0)
                subs = rng.randint(2, 4) if rng.random() < subagent_rate else 0
                ends = []
                for j in range(1 + subs):
                    kind = "main" if j == 0 else "subagent"
                    sent = intended + rng.uniform(0.0, 0.004)
                    ttft = rng.lognormvariate(-1.6, 0.5) * (1 + isl / 20000)
                    osl = rng.randint(40, 600)
                    load = 0.5 + 0.5 * (sent / duration_s)
                    itl = (base_itl + per_user_itl * users * load) * rng.uniform(0.8, 1.3)
                    first = sent + ttft
                    last = first + itl * (osl - 1)
                    ok = rng.random() >= error_rate
                    kind_err = None if ok else rng.choice(ERROR_KINDS)
                    if not ok:
                        last = first + itl * rng.randint(1, max(1, osl // 2))
                    rec = RequestRecord(
                        request_id=f"{session}-t{k}" + (f"-sub{j}" if j else ""),
                        session_id=session, lane=lane, agent_kind=kind, turn=k,
                        phase="measure", intended_ns=_ns(intended), sent_ns=_ns(sent),
                        first_token_ns=_ns(first), last_token_ns=_ns(last),
                        done_ns=_ns(last + 0.0005), isl_requested=isl, osl_requested=osl,
                        isl=isl if ok else None, osl=osl if ok else None,
                        osl_source="server", cached_tokens=int(isl * 0.8) if ok else None,
                        theoretical_cached_tokens=int(isl * 0.8), chunks=osl,
                        ok=ok, status=200, error=None if ok else f"{kind_err} (synthetic)",
                        ready_ns=None if ready is None else _ns(ready), play=play,
                        error_kind=kind_err)
                    emit(rec.done_ns, {"type": "request", **asdict(rec)})
                    requests += 1
                    failed += not ok
                    ends.append(last + 0.0005)
                t = max(ends)
                ready = t
                isl += rng.randint(200, 1500)
            play += 1
    # The server's metrics every second, consistent with the requests above.
    cum_hits = cum_queries = prompt = gen = 0.0
    for sec in range(int(duration_s) + 1):
        t_ns = _ns(sec + 0.5)
        load = 0.5 + 0.5 * sec / duration_s
        q = users * 400.0 * load
        cum_queries += q
        cum_hits += q * rng.uniform(0.7, 0.9)
        prompt += q
        gen += users * 20.0 * load
        emit(t_ns, {"type": "server_metrics", "t_ns": t_ns,
                    "vllm:prefix_cache_queries_total": cum_queries,
                    "vllm:prefix_cache_hits_total": cum_hits,
                    "vllm:prompt_tokens_total": prompt, "vllm:generation_tokens_total": gen,
                    "vllm:num_requests_running": users * 0.6 * load,
                    "vllm:num_requests_waiting": max(0.0, rng.gauss(users * 0.02 * load, 2)),
                    "vllm:kv_cache_usage_perc": min(1.0, 0.3 + 0.6 * load)})
    # The client's self-diagnostics every second, as the engine journals them.
    lag_p99 = 0.004
    for sec in range(1, int(duration_s) + 1):
        t_ns = _ns(float(sec))
        if client_saturated_at_s is not None and sec >= client_saturated_at_s:
            lag_p99 = max(lag_p99, 0.12 + 0.002 * (sec - client_saturated_at_s))
        figures: dict[str, Any] = {
            "kernel_stamps": True, "stamp_error_p99_s": 0.00018 + lag_p99 / 40,
            "events_per_read": 1.02, "multi_event_read_share": 0.004,
            "loop_lag_p99_s": lag_p99, "cpu_cores": 0.31}
        figures["saturation_reasons"] = saturation_reasons(figures)
        emit(t_ns, {"type": "event", "kind": "client", "t_ns": t_ns, "final": False,
                    **figures})
    end_ns = max(t for t, _ in lines) + 1
    emit(0, {"type": "event", "kind": "replay_start", "t_ns": 0, "users": users,
             "recycle": True})
    emit(end_ns, {"type": "event", "kind": "replay_end", "t_ns": end_ns,
                  "stop_reason": "duration reached"})
    run = {
        "agentload_version": "synthetic",
        "trace": {"name": f"synthetic-{users}u", "path": "<synthetic>", "format": "native",
                  "sessions": sessions, "requests": requests, "block_size": 64},
        "target": {"base_url": "http://synthetic", "model": "synthetic", "gpus": gpus,
                   "device": "gpu", "label": label},
        "options": {"users": users, "duration_s": duration_s, "max_requests": requests,
                    "recycle": True},
    }
    lines.sort(key=lambda x: x[0])
    with open(run_dir / JOURNAL_NAME, "wb") as fh:
        fh.write(orjson.dumps({"type": "run", **run}) + b"\n")
        for _, line in lines:
            fh.write(line + b"\n")
    (run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return SyntheticRun(run_dir, users, duration_s, requests, failed, len(lines) + 1)


class ScriptedSource:
    """A :class:`~agentload.replay.live.SnapshotSource` for tests: a synthetic run
    played back on a clock that moves only when told (``advance``), so every snapshot
    is reproducible. ``live=True`` makes it behave like a running replay (``q`` asks,
    ``request_stop`` is recorded and ends the run at the next snapshot)."""

    def __init__(self, run_dir: Path, live: bool = False, start_s: float = 60.0,
                 speed: float = 1.0) -> None:
        from agentload.replay.live import JournalPlayback

        self.now = 0.0
        self.live = live
        self.playback = JournalPlayback(run_dir, speed=speed, clock=lambda: self.now,
                                        start_s=start_s)
        self.stop_requests = 0
        self.held: list[bool] = []
        self.pulls = 0
        self.empty = False
        """Answer None (no snapshot yet), as a replay that has not started."""

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def snapshot(self) -> Any:
        self.pulls += 1
        if self.empty:
            return None
        snap = self.playback.snapshot()
        if self.live and snap is not None:
            from dataclasses import replace

            snap = replace(snap, header=replace(snap.header, mode="live"))
        return snap

    def request_stop(self) -> None:
        self.stop_requests += 1

    def finish(self) -> None:
        """End the (pretend) live run: the next snapshots say finished."""
        board = self.playback.board
        board.finish(int(self.playback.clock_ns()), "stopped from the dashboard")

    def hold(self, paused: bool) -> None:
        self.held.append(paused)
        self.playback.hold(paused)

    def close(self) -> None:
        self.playback.close()
