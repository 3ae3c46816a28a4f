"""``agentload bench import``: importer speed on full-size WEKA and Mooncake files.

The shipped fixtures are small, so the benchmark builds the sizes that matter from
them: a WEKA session of about 2.4 MB (the size of the larger cc-traces sessions: a
long main chain whose context grows turn by turn, with subagent fan-out) and a 12,000
row Mooncake file (the fixture's rows repeated with shifted timestamps and hash ids).
Each import is timed next to a bare ``orjson`` parse of the same bytes, the floor any
importer pays, and the ratio is printed; best of ``repeats`` runs each.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from agentload.traces.formats import import_trace


def make_weka_session(path: Path, target_bytes: int = 2_400_000, seed: int = 1) -> int:
    """Write a WEKA session of about ``target_bytes``; return its request count."""
    rng = random.Random(seed)
    next_hash = 1
    context: list[int] = []

    def grow(blocks: int) -> list[int]:
        nonlocal next_hash
        new = list(range(next_hash, next_hash + blocks))
        next_hash += blocks
        return new

    context = grow(250)  # ~16k tokens of system prompt and tools
    requests: list[dict[str, Any]] = []
    t = 0.0
    size = 0
    while size < target_bytes:
        context = context + grow(rng.randint(2, 40))
        out = rng.randint(50, 2000)
        api = round(out / 60, 2)
        requests.append({"t": round(t, 3), "type": "n", "model": "claude-opus-4-5",
                         "in": 64 * len(context) + rng.randint(0, 63), "out": out,
                         "hash_ids": list(context), "input_types": ["tool_result"],
                         "output_types": ["text"], "stop": "tool_use", "api_time": api,
                         "think_time": round(rng.uniform(1, 30), 2)})
        t += api + requests[-1]["think_time"]
        if len(requests) % 25 == 0:
            sub_ctx = grow(140)
            sub = []
            for k in range(6):
                sub_ctx = sub_ctx + grow(rng.randint(5, 200))
                sub.append({"t": 5.0 * k, "type": "n", "in": 64 * len(sub_ctx), "out": 200,
                            "hash_ids": list(sub_ctx), "api_time": 2.0, "think_time": 3.0})
            requests.append({"t": round(t, 3), "type": "subagent", "agent_id": f"a{t:.0f}",
                             "subagent_type": "Explore", "duration_ms": 40_000,
                             "requests": sub})
            t += 41.0
        size += len(orjson.dumps(requests[-1]))
    doc = {"id": "bench_weka", "models": ["claude-opus-4-5"], "block_size": 64,
           "hash_id_scope": "local", "requests": requests}
    path.write_bytes(orjson.dumps(doc))
    return sum(len(r["requests"]) if r["type"] == "subagent" else 1 for r in requests)


def make_mooncake_rows(src: Path, path: Path, rows: int = 12_000) -> int:
    """Repeat ``src``'s rows (timestamps and hash ids shifted) up to ``rows`` lines."""
    base = [orjson.loads(line) for line in src.read_bytes().splitlines() if line.strip()]
    span = max(r["timestamp"] for r in base) + 1
    top = max(h for r in base for h in r["hash_ids"]) + 1
    with open(path, "wb") as out:
        for i in range(rows):
            r = dict(base[i % len(base)])
            rep = i // len(base)
            r["timestamp"] += rep * span
            r["hash_ids"] = [h + rep * top for h in r["hash_ids"]]
            out.write(orjson.dumps(r) + b"\n")
    return rows


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _parse_lines(path: Path) -> list[Any]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line]


def import_speed(
    mooncake_source: Annotated[Path, typer.Option(
        "--mooncake-source", help="Mooncake rows to repeat (default: the test fixture).")
    ] = Path("tests/data/mooncake/synthetic_trace_head500.jsonl"),
    rows: Annotated[int, typer.Option("--rows", min=1, help="Mooncake rows.")] = 12_000,
    weka_bytes: Annotated[int, typer.Option("--weka-bytes", min=10_000,
                                            help="Size of the WEKA session.")] = 2_400_000,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Best of N.")] = 3,
) -> None:
    """Time importing a ~2.4 MB WEKA session and a 12k-row Mooncake file, next to a plain
    JSON parse of the same bytes."""
    if not mooncake_source.is_file():
        raise typer.BadParameter(f"{mooncake_source} not found (run from the repository "
                                 "root or pass --mooncake-source)")
    with tempfile.TemporaryDirectory(prefix="agentload-bench-") as tmp:
        weka = Path(tmp) / "bench_weka.json"
        n_weka = make_weka_session(weka, weka_bytes)
        moon = Path(tmp) / "bench_mooncake.jsonl"
        make_mooncake_rows(mooncake_source, moon, rows)
        typer.echo(f"{'input':<34}{'size':>10}{'requests':>10}{'parse s':>10}"
                   f"{'import s':>10}{'ratio':>8}")
        for label, fmt, path, parse, n in (
            ("WEKA session", "weka", weka, lambda: orjson.loads(weka.read_bytes()), n_weka),
            ("Mooncake rows", "mooncake", moon, lambda: _parse_lines(moon), rows),
        ):
            parse_s = _best(parse, repeats)
            import_s = _best(lambda f=fmt, p=path: import_trace(f, p), repeats)  # type: ignore[misc]
            size = path.stat().st_size / 1e6
            typer.echo(f"{label:<34}{size:>8.2f}MB{n:>10,}{parse_s:>10.3f}{import_s:>10.3f}"
                       f"{import_s / parse_s:>7.1f}x")
