"""Streaming Kineto ingest (:mod:`agentload.profiler.jsonstream`): same frames, bounded memory.

The streaming loader must give exactly what a whole-document parse gives:
:func:`_reference_load` is the loader as it was before streaming (one ``orjson.loads`` of
the whole document, one pass over the events), kept here as the yardstick for the real
H200 traces. The splitter is checked against ``orjson.loads`` on documents built to trip
a byte scanner (braces, quotes and escapes inside strings, deep nesting, every chunk
size from 1 byte), and on every truncation and many corruptions of one document.
"""

from __future__ import annotations

import gzip
import io
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from agentload.profiler.errors import ProfileError
from agentload.profiler.jsonstream import JSONStreamError, StreamResult, stream_array
from agentload.profiler.kineto import load_kineto, read_json_document
from agentload.profiler.model import (
    DEVICES_SCHEMA,
    LAUNCHES_SCHEMA,
    OPS_SCHEMA,
    PROCESSES_SCHEMA,
    RANGES_SCHEMA,
    STRINGS_SCHEMA,
    THREADS_SCHEMA,
    conform,
)
from tests.support import ROOT

DATA = Path(__file__).parents[1] / "data" / "profiler"
REAL = [*sorted(DATA.glob("*.json.gz")), DATA / "graph_replay_torch2.11_h200.json"]
FRAMES = ("ops", "launches", "ranges", "strings", "processes", "threads", "devices")


def _reference_load(path: Path) -> dict[str, pl.DataFrame]:
    """The pre-streaming loader: whole document, Python lists, frames at the end."""
    doc = orjson.loads(gzip.decompress(raw) if (raw := path.read_bytes())[:2] == b"\x1f\x8b"
                       else raw)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    gpu = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
    ops: dict[str, list[Any]] = {k: [] for k in ("kind", "start", "end", "device", "stream",
                                                 "correlation", "name", "graph_node")}
    launches: dict[str, list[Any]] = {k: [] for k in ("pid", "tid", "start", "end",
                                                      "correlation", "name")}
    ranges: dict[str, list[Any]] = {k: [] for k in ("pid", "tid", "start", "end", "name")}
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}

    def ns(us: Any) -> int:
        return round(float(us) * 1000)

    for ev in events:
        cat, ph, args = ev.get("cat"), ev.get("ph"), ev.get("args") or {}
        if ph == "X" and cat in gpu:
            s = ns(ev["ts"])
            for k, v in (("kind", gpu[cat]), ("start", s), ("end", s + ns(ev.get("dur", 0))),
                         ("device", args.get("device", ev.get("pid"))),
                         ("stream", args.get("stream", ev.get("tid"))),
                         ("correlation", args.get("correlation")),
                         ("name", str(ev.get("name", ""))),
                         ("graph_node", args.get("graph node id"))):
                ops[k].append(v)
        elif ph == "X" and cat in ("cuda_runtime", "cuda_driver", "user_annotation"):
            s = ns(ev["ts"])
            row = {"pid": int(ev["pid"]), "tid": int(ev["tid"]), "start": s,
                   "end": s + ns(ev.get("dur", 0)), "correlation": args.get("correlation"),
                   "name": str(ev.get("name", ""))}
            table = ranges if cat == "user_annotation" else launches
            for k in table:
                table[k].append(row[k])
        elif ph == "M" and ev.get("name") == "process_name":
            procs[int(ev["pid"])] = str(args.get("name", ""))
        elif ph == "M" and ev.get("name") == "thread_name":
            threads[(int(ev["pid"]), int(ev["tid"]))] = str(args.get("name", ""))
    names = sorted(set(ops["name"]) | set(launches["name"]))
    ids = {n: i for i, n in enumerate(names)}
    i64 = pl.Int64

    def proc(pid: pl.Expr) -> pl.Expr:
        return pid.cast(pl.UInt64) * (1 << 24)

    def tid(pid: pl.Expr, t: pl.Expr) -> pl.Expr:
        return proc(pid) + (t.cast(i64) % (1 << 24)).cast(pl.UInt64)

    name_id = pl.col("name").replace_strict(ids, return_dtype=i64, default=None)
    lf = conform(pl.DataFrame(launches, schema={"pid": i64, "tid": i64, "start": i64,
                                                "end": i64, "correlation": i64,
                                                "name": pl.String}).with_columns(
        proc=proc(pl.col("pid")), tid=tid(pl.col("pid"), pl.col("tid")), name_id=name_id),
        LAUNCHES_SCHEMA)
    owner = lf.select("correlation", "proc").unique("correlation", keep="first")
    default = lf["proc"].mode().sort()[0] if lf.height else 0
    of = pl.DataFrame(ops, schema={"kind": pl.String, "start": i64, "end": i64, "device": i64,
                                   "stream": i64, "correlation": i64, "name": pl.String,
                                   "graph_node": i64})
    of = conform(of.join(owner, on="correlation", how="left").with_columns(
        proc=pl.col("proc").fill_null(pl.lit(default, pl.UInt64)), name_id=name_id), OPS_SCHEMA)
    rf = conform(pl.DataFrame(ranges, schema={"pid": i64, "tid": i64, "start": i64, "end": i64,
                                              "name": pl.String}).with_row_index("range_id")
                 .with_columns(proc=proc(pl.col("pid")), tid=tid(pl.col("pid"), pl.col("tid")),
                               style=pl.lit("pushpop")), RANGES_SCHEMA)
    props = doc.get("deviceProperties") if isinstance(doc, dict) else None
    return {
        "ops": of, "launches": lf, "ranges": rf,
        "strings": pl.DataFrame({"id": range(len(names)), "value": names},
                                schema=STRINGS_SCHEMA),
        "processes": pl.DataFrame({"proc": [p * (1 << 24) for p in procs], "pid": list(procs),
                                   "name": list(procs.values())}, schema=PROCESSES_SCHEMA),
        "threads": pl.DataFrame({"tid": [p * (1 << 24) + t % (1 << 24) for p, t in threads],
                                 "name": list(threads.values())}, schema=THREADS_SCHEMA),
        "devices": pl.DataFrame([{"device": d.get("id"), "name": d.get("name")}
                                 for d in props or [] if isinstance(d, dict)],
                                schema=DEVICES_SCHEMA),
    }


def write_synthetic_trace(path: Path, n_events: int) -> None:
    """A Kineto-shaped trace (torch's pretty-printed layout), ~290 bytes an event.

    Half ``cpu_op`` events with nested ``Input Dims``, a fifth ``cudaLaunchKernel``, a
    fifth kernels (names with braces, commas and escaped quotes, as demangled lambdas
    have), a tenth ``user_annotation`` ranges; metadata keys before and after.
    """
    pid = 4242
    ts = 5444268698641.741
    corr = 0
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {"id": 0, "name": '
                '"NVIDIA H200", "numSms": 132}\n  ],\n  "distributedInfo": {"backend": '
                '"nccl", "rank": 0, "world_size": 1},\n  "traceEvents": [\n')
        parts: list[str] = []
        for i in range(n_events):
            k = i % 10
            ts += 1.125
            if k < 5:
                parts.append(
                    f'  {{\n    "ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": {pid}, '
                    f'"tid": {pid},\n    "ts": {ts:.3f}, "dur": 4.250,\n    "args": {{\n      '
                    f'"External id": {i},"Record function id": 0, "Input Dims": [[8, 256], '
                    f'[256, 256]], "Input type": ["float", "float"], "Ev Idx": {i}\n    }}\n  }}')
            elif k < 7:
                corr += 1
                parts.append(
                    f'  {{\n    "ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", '
                    f'"pid": {pid}, "tid": {pid},\n    "ts": {ts:.3f}, "dur": 3.500,\n    '
                    f'"args": {{\n      "External id": {i}, "cbid": 211, "correlation": {corr}'
                    f'\n    }}\n  }}')
            elif k < 9:
                parts.append(
                    f'  {{\n    "ph": "X", "cat": "kernel", "name": "void gemm<{{128, 64}}, '
                    f'\\"q\\">(float*)::{{lambda(float)#1}}, {{x}} [{i % 50}]", "pid": 0, '
                    f'"tid": 7,\n    "ts": {ts:.3f}, "dur": 2.848,\n    "args": {{\n      '
                    f'"queued": 0, "device": 0, "context": 1,\n      "stream": 7, "correlation":'
                    f' {corr}, "grid": [132, 1, 1], "block": [256, 1, 1]\n    }}\n  }}')
            else:
                parts.append(
                    f'  {{\n    "ph": "X", "cat": "user_annotation", "name": "{{\'Module\': '
                    f'\'model.layers.{i % 4}\', \'Inputs\': [[1, 8, 256]]}}", "pid": {pid}, '
                    f'"tid": {pid},\n    "ts": {ts:.3f}, "dur": 30.000,\n    "args": {{\n      '
                    f'"External id": {i},"Record function id": 0, "Ev Idx": {i}\n    }}\n  }}')
            if len(parts) >= 10_000:
                f.write(",\n".join(parts) + ",\n")
                parts = []
        parts.append(f'  {{\n    "name": "process_name", "ph": "M", "ts": 0, "pid": {pid}, '
                     f'"tid": 0,\n    "args": {{\n      "name": "python3"\n    }}\n  }}')
        parts.append(f'  {{\n    "name": "thread_name", "ph": "M", "ts": 0, "pid": {pid}, '
                     f'"tid": {pid},\n    "args": {{\n      "name": "thread {pid} (python3)"\n'
                     f'    }}\n  }}')
        f.write(",\n".join(parts) + '\n  ],\n  "traceName": "/tmp/trace.json"\n}\n')


def assert_same_profile(path: Path) -> None:
    got = load_kineto(path)
    ref = _reference_load(path)
    for name in FRAMES:
        assert_frame_equal(getattr(got, name), ref[name], check_exact=True), name
    via_doc = load_kineto(path, read_json_document(path))
    for name in FRAMES:
        assert_frame_equal(getattr(got, name), getattr(via_doc, name)), name


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_real_traces_match_the_whole_document_parse(path: Path) -> None:
    assert_same_profile(path)


def test_real_trace_in_small_chunks_and_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentload.profiler import jsonstream

    path = DATA / "decoder4_kineto.json.gz"
    monkeypatch.setattr(jsonstream.stream_array, "__kwdefaults__",
                        {"chunk": 997, "batch_bytes": 5_000})
    assert_same_profile(path)


def test_synthetic_trace_matches(tmp_path: Path) -> None:
    path = tmp_path / "synthetic.json"
    write_synthetic_trace(path, 3_000)
    assert_same_profile(path)
    gz = tmp_path / "synthetic.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
    assert_same_profile(gz)
    p = load_kineto(gz)
    assert (p.ops.height, p.launches.height, p.ranges.height) == (600, 600, 300)
    assert p.devices["name"].to_list() == ["NVIDIA H200"]


def _stream(doc: bytes, chunk: int, batch_bytes: int = 64,
            keep: frozenset[str] = frozenset({"deviceProperties"})) -> tuple[
                list[Any], StreamResult]:
    res = StreamResult()
    items = [ev for batch in stream_array(io.BytesIO(doc), "traceEvents", keep, res,
                                          chunk=chunk, batch_bytes=batch_bytes)
             for ev in batch]
    return items, res


TRICKY_EVENTS: list[Any] = [
    {"name": 'a "}, {" b', "args": {"s": "\\", "t": "\\\"", "u": "}]\",[{"}},
    {"name": "{lambda(float)#1}, {x}", "deep": [[[[[[{"a": [[[{"b": "}"}]]]}]]]]]]},
    {"name": "ünïcödé \u2028 \U0001f600", "args": {}},
    {"e": [], "f": {}, "g": [{}], "h": "", "i": -1.5e-3, "j": True, "k": None},
    7, "x", None, [1, [2, {"z": "]"}]],
    {"name": "end\\"},
]


@pytest.mark.parametrize("indent", [False, True])
def test_splitter_equals_orjson_on_tricky_documents(indent: bool) -> None:
    opt = orjson.OPT_INDENT_2 if indent else 0
    docs = [
        {"schemaVersion": 1, "traceEvents": TRICKY_EVENTS * 3,
         "deviceProperties": [{"id": 0, "name": "H200"}], "z": {"traceEvents": 1}},
        {"deviceProperties": [{"id": 1}], "traceEvents": [], "after": "}]"},
        {"traceEvents": [{"a": 1}]},
    ]
    for doc in docs:
        raw = orjson.dumps(doc, option=opt)
        for chunk in [*range(1, 40), 64, 1000, 1 << 20]:
            items, res = _stream(raw, chunk)
            assert items == doc["traceEvents"], (chunk, raw)
            assert res.found and not res.bare
            assert res.extras == {"deviceProperties": doc["deviceProperties"]} \
                if "deviceProperties" in doc else res.extras == {}
    bare = orjson.dumps(TRICKY_EVENTS, option=opt)
    for chunk in (1, 2, 3, 7, 1 << 20):
        items, res = _stream(bare, chunk)
        assert items == TRICKY_EVENTS and res.bare


def _weak_cut(buf: bytes, pos: int) -> int:
    """A guess that is often wrong (any ``}`` then a comma): exercises the recovery."""
    i = len(buf)
    while (i := buf.rfind(b",", pos, i)) >= 0:
        if buf[pos:i].rstrip().endswith(b"}"):
            return len(buf[pos:i].rstrip()) + pos
    return -1


def test_wrong_guesses_fall_back_to_the_scanner(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    from agentload.profiler import jsonstream

    monkeypatch.setattr(jsonstream, "_cut", _weak_cut)
    raw = orjson.dumps({"traceEvents": TRICKY_EVENTS * 5}, option=orjson.OPT_INDENT_2)
    for chunk in (16, 50, 333, 1 << 20):
        assert _stream(raw, chunk, batch_bytes=1 << 20)[0] == TRICKY_EVENTS * 5
    path = tmp_path / "synthetic.json"
    write_synthetic_trace(path, 2_000)
    assert_same_profile(path)


def test_missing_or_non_list_trace_events() -> None:
    for raw in (b'{"a": 1}', b"{}", b' {"traceEvents": {"x": [1]}} ', b'{"traceEvents": null}'):
        items, res = _stream(raw, 3)
        assert items == [] and not res.found


def _errors(raw: bytes, chunk: int) -> bool:
    try:
        _stream(raw, chunk, batch_bytes=40)
    except JSONStreamError:
        return True
    return False


def test_every_truncation_is_an_error() -> None:
    raw = orjson.dumps({"deviceProperties": [{"id": 0}], "traceEvents": TRICKY_EVENTS,
                        "tail": [1, {"a": "b"}]}, option=orjson.OPT_INDENT_2)
    for cut in range(len(raw)):
        if raw[:cut].strip():
            assert _errors(raw[:cut], 5), raw[:cut]
            assert _errors(raw[:cut], 1 << 20), raw[:cut]


def test_corruptions_are_errors_exactly_when_orjson_says_so() -> None:
    rng = random.Random(7)
    raw = orjson.dumps({"traceEvents": TRICKY_EVENTS, "deviceProperties": []},
                       option=orjson.OPT_INDENT_2)
    alphabet = b'{}[]",:\\ 0a\n'
    for _ in range(1500):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 2)):
            b[rng.randrange(len(b))] = rng.choice(alphabet)
        doc = bytes(b)
        try:
            want: Any = orjson.loads(doc)
        except orjson.JSONDecodeError:
            want = None
        for chunk in (4, 1 << 20):
            if want is None:
                assert _errors(doc, chunk), doc
                continue
            items, res = _stream(doc, chunk)  # valid JSON: no error
            if isinstance(want, dict) and isinstance(want.get("traceEvents"), list):
                assert res.found and items == want["traceEvents"], doc
            elif isinstance(want, list):
                assert res.bare and items == want, doc
            else:
                assert not res.found and items == [], doc


def _write(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


def test_damaged_files_are_one_profile_error(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    write_synthetic_trace(good, 400)
    raw = good.read_bytes()
    gz = gzip.compress(raw)
    cases = {
        "truncated.json": (raw[: len(raw) // 2], "truncated or corrupt"),
        "mid_array.json": (raw[: raw.rindex(b"],")], "truncated or corrupt"),
        "truncated.json.gz": (gz[: len(gz) // 2], "truncated or corrupt"),
        "corrupt.json.gz": (gz[:40] + bytes(64) + gz[104:], "truncated or corrupt"),
        "garbage_after.json": (raw + b"x", "truncated or corrupt"),
        "no_events.json": (b'{"traceName": "x"}', "no traceEvents list"),
        "scalar.json": (b'"trace"', "not a Chrome trace"),
        "bad_event.json": (b'{"traceEvents": [{"ph": "X", "cat": "kernel"}]}',
                           "malformed trace event"),
        "bare_bad_event.json": (b"[1, 2]", "malformed trace event"),
    }
    for name, (data, text) in cases.items():
        with pytest.raises(ProfileError) as exc:
            load_kineto(_write(tmp_path, name, data))
        msg = str(exc.value)
        assert text in msg and "\n" not in msg, (name, msg)


def test_bare_list_document(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "kernel", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 7,
               "name": "k", "args": {"correlation": 1}}] * 5
    p = _write(tmp_path, "bare.json", orjson.dumps(events))
    assert_same_profile(p)
    assert load_kineto(p).ops.height == 5


MEMORY_CHILD = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from agentload.profiler.kineto import load_kineto
    import polars  # imported before the baseline, as a loaded program has it
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    p = load_kineto(Path(sys.argv[1]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(p.ops.height, (peak - base) * 1024)
""")


def test_peak_memory_growth_is_well_under_the_file_size(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    # ~114 MB. Measured on the 2-vCPU dev box: the whole-document loader grew its peak RSS
    # by 845 MiB (7.4x the file), this one by 71 MiB (0.65x: one 4 MB batch as Python
    # objects, the polars frames, allocator slack). The bound leaves room for allocator
    # noise and still fails by a wide margin for any whole-document parse.
    write_synthetic_trace(path, 400_000)
    size = path.stat().st_size
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)
    rows, growth = map(int, done.stdout.split())
    assert rows == 80_000
    assert growth < size, (growth, size)
