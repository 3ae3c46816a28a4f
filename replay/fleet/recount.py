"""The theoretical prefix-cache hits of a ``--workers`` run, counted over every worker.

Each worker counts a perfect cache's hits (``engine/cache_model.py``) over the requests
it sent itself, so a prefix that two workers' lanes share (a system prompt, a tool
list) counts as a miss once per worker. After the merge the driver counts again over
the union: it plans each journaled play again (``Planner``: the same plan, marker and
start turn as the worker had), then walks every request in time order, a prompt
looked up when it was sent and cached from its first token, exactly as one process
counts, and writes the counts back into the journal's request lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from agentload.replay.engine.cache_model import PrefixCacheModel
from agentload.replay.engine.core import Planner, ReplayOptions
from agentload.traces import Block, Trace


def recount_theoretical(journal: Path, trace: Trace, options: ReplayOptions,
                        block_size: int) -> int | None:
    """Rewrite each request line's ``theoretical_cached_tokens`` from one cache over all
    requests; the number of lines whose count changed. None when it cannot be redone
    (``--outputs actual``: later prompts hold the model's own tokens, which only the
    worker saw)."""
    if options.output_mode == "actual":
        return None
    lines = journal.read_bytes().splitlines(keepends=True)
    requests: list[tuple[int, dict[str, Any]]] = []
    for i, line in enumerate(lines):
        if line.startswith(b'{"type":"request"'):
            try:
                requests.append((i, orjson.loads(line)))
            except orjson.JSONDecodeError:
                continue
    planner = Planner(trace, options)
    sessions = {s.id: s for s in trace.sessions}
    blocks: dict[tuple[int, int], dict[str, tuple[Block, ...]]] = {}
    events: list[tuple[int, int, int]] = []  # (t_ns, 0 send / 1 cache, request)
    prompts: list[tuple[Block, ...] | None] = []
    for k, (_, rec) in enumerate(requests):
        play = (int(rec["lane"]), int(rec.get("play") or 0))
        if play not in blocks:
            session = sessions.get(rec["session_id"])
            blocks[play] = ({} if session is None else
                            {p.request.id: p.request.blocks
                             for p in planner.plan(play[0], play[1], session).requests})
        prompts.append(blocks[play].get(rec["request_id"]))
        events.append((int(rec["sent_ns"]), 0, k))
        if rec.get("first_token_ns") is not None:
            events.append((int(rec["first_token_ns"]), 1, k))
    events.sort()
    model = PrefixCacheModel(block_size)
    counts: dict[int, int] = {}
    keys: dict[int, list[int]] = {}
    for _, kind, k in events:
        prompt = prompts[k]
        if prompt is None:
            continue  # a request the plan does not hold (never expected): left as it was
        if kind == 0:
            counts[k], keys[k] = model.send(prompt, cache_now=False)
        else:
            model.cache(keys[k])
    changed = 0
    for k, (i, rec) in enumerate(requests):
        if k in counts and counts[k] != rec.get("theoretical_cached_tokens"):
            rec["theoretical_cached_tokens"] = counts[k]
            lines[i] = orjson.dumps(rec) + b"\n"
            changed += 1
    if changed:
        tmp = journal.with_name(journal.name + ".recount")
        with open(tmp, "wb") as out:
            out.writelines(lines)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, journal)
    return changed


def recount_note(changed: int | None, by: str = "") -> str:
    """What ``run.json`` says of the theoretical hits of a ``--workers`` run."""
    if changed is None:
        return "per worker: with --outputs actual the prompts hold tokens only each worker saw"
    return f"recounted over every worker's requests in time order ({changed} requests changed{by})"


def merge_and_recount(run_dir: Path) -> str | None:
    """For ``agentload report`` on a ``--workers`` run whose driver ended before merging:
    merge the worker journals, then recount the theoretical hits as the driver would have
    (the trace loaded and fitted again from ``run.json``); what was done, or None when
    there was nothing to merge."""
    import json

    from agentload.replay.engine.fit import FitOptions, fit_trace
    from agentload.replay.journal import JOURNAL_NAME, merge_shards, shard_journals
    from agentload.traces.formats import load_any

    run_dir = Path(run_dir)
    if not shard_journals(run_dir):
        return None
    merge_shards(run_dir)
    run_path = run_dir / "run.json"
    try:
        run = json.loads(run_path.read_text())
        trace_info, fit, raw = run["trace"], run["fit"], dict(run["options"])
    except (OSError, ValueError, KeyError):
        return "merged the worker journals; no run.json to recount the prefix hits from"
    if not Path(str(trace_info.get("path"))).exists():
        return ("merged the worker journals; the theoretical prefix hits stay per worker "
                f"(the trace {trace_info.get('path')!r} is not here)")
    for key in ("start_range", "chat_word_tokens"):
        if isinstance(raw.get(key), list):
            raw[key] = tuple(raw[key])
    options = ReplayOptions(**{k: v for k, v in raw.items()
                               if k in ReplayOptions.__dataclass_fields__})
    loaded = load_any(Path(trace_info["path"]), trace_info.get("format", "native")).trace
    trace, _ = fit_trace(loaded, FitOptions(
        scale_tokens=fit["scale_tokens"], max_context=fit["max_context"],
        pause_cap_s=fit["pause_cap_s"], pause_rule=fit.get("pause_rule", "trace")))
    block = (run.get("target") or {}).get("kv_block_size") or trace.block_size
    changed = recount_theoretical(run_dir / JOURNAL_NAME, trace, options, int(block))
    note = recount_note(changed, "; by agentload report")
    if isinstance(run.get("workers"), dict):
        run["workers"]["theoretical_cache"] = note
        run_path.write_text(json.dumps(run, indent=2, default=str) + "\n")
    return f"merged the worker journals; theoretical prefix hits {note}"
