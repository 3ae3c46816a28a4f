"""``agentload profile ...`` as a user runs it: output shapes, reports, diffs, bad inputs."""

from __future__ import annotations

import asyncio
import gzip
import json
import sqlite3
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from agentload.cli import app
from agentload.profiler import nvtx
from agentload.profiler.synthetic import SyntheticExport
from tests.support import run_cli

DATA = Path(__file__).parents[1] / "data" / "profiler"
TRACE = DATA / "decoder4_kineto.json.gz"
US = 1_000


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_layers_json_shape_is_fixed() -> None:
    code, out = invoke("profile", "layers", str(TRACE), "--json", "--level", "layer")
    assert code == 0, out
    doc = json.loads(out)
    assert list(doc) == ["layers"]
    keys = {"name", "pid", "instances", "kernels", "kernel_ns", "busy_ns", "span_ns"}
    assert all(set(row) == keys for row in doc["layers"])
    layer1 = next(r for r in doc["layers"] if r["name"] == "model.layers.1")
    assert layer1["instances"] == 3 and layer1["kernels"] == 33


def test_layers_text_parquet_and_html(tmp_path: Path) -> None:
    code, out = invoke("profile", "layers", str(TRACE))
    assert code == 0 and "model.layers.2.self_attn" in out and "per layer type" in out
    pq = tmp_path / "layers.parquet"
    page = tmp_path / "r.html"
    code, out = invoke("profile", "layers", str(TRACE), "--parquet", str(pq), "--html", str(page))
    assert code == 0 and pq.exists() and (tmp_path / "layers.instances.parquet").exists()
    html = page.read_text()
    assert html.count("<script") >= 1 and "plotly" in html
    # vLLM dict text from the trace is escaped, never raw markup
    assert "{'Module'" not in html or "&#x27;" in html


def test_report_escapes_trace_strings(tmp_path: Path) -> None:
    x = SyntheticExport()
    x.process(1, "p")
    t = x.thread(1, 2)
    evil = "<script>alert(1)</script>"
    x.push(t, 0, 100 * US, evil)
    x.launch_kernel(t, 10 * US, 20 * US, "void <img src=x onerror=alert(2)>()", api_ns=US)
    db = x.write(tmp_path / "evil.sqlite")
    out = tmp_path / "evil.html"
    code, text = invoke("profile", "report", str(db), "-o", str(out))
    assert code == 0, text
    page = out.read_text()
    assert evil not in page and "&lt;script&gt;alert(1)" in page
    assert "<img src=x" not in page


def test_steps_command() -> None:
    code, out = invoke("profile", "steps", str(TRACE), "--json")
    assert code == 0
    steps = json.loads(out)["steps"]
    assert [s["step"] for s in steps].count("decode_step") == 3
    assert sum("graph replay" in s["step"] for s in steps) == 2
    assert {s["layers"] for s in steps if s["step"] == "decode_step"} == {4}


def _arm(path: Path, per_layer: list[str], gpu_ns: int) -> Path:
    x = SyntheticExport()
    x.process(5, "p")
    t = x.thread(5, 6)
    clock = 0
    for step in range(2):
        for layer in range(2):
            base = (step * 10_000 + layer * 1_000) * US
            x.push(t, base, base + 900 * US, f"model.layers.{layer}")
            for name in per_layer:
                clock += 10 * US
                x.launch_kernel(t, base + clock % (800 * US), base + clock % (800 * US), name,
                                api_ns=US, gpu_ns=gpu_ns)
            clock = 0
    return x.write(path)


def test_diff_seed_style(tmp_path: Path) -> None:
    a = _arm(tmp_path / "a.sqlite", ["norm", "qkv", "attn", "o", "mlp"], 10 * US)
    b = _arm(tmp_path / "b.sqlite", ["norm", "qkv", "rope", "attn", "o", "ar", "mlp"], 20 * US)
    code, out = invoke("profile", "diff", str(a), str(b))
    assert code == 0, out
    assert "layers.*: 5 k / 50 µs vs 7 k / 140 µs" in out
    assert "  + rope" in out and "  + ar" in out and "  = attn" in out


def test_diff_of_arms_given_per_rank(tmp_path: Path) -> None:
    """FILE,FILE per arm: each arm's ranks merged; per-instance figures over all ranks."""
    a = [_arm(tmp_path / f"a{r}.sqlite", ["norm", "qkv", "attn", "o", "mlp"], 10 * US)
         for r in range(2)]
    b = [_arm(tmp_path / f"b{r}.sqlite", ["norm", "qkv", "rope", "attn", "o", "ar", "mlp"],
              (20 + 20 * r) * US) for r in range(2)]
    code, out = invoke("profile", "diff", ",".join(map(str, a)), ",".join(map(str, b)))
    assert code == 0, out
    # B's ranks: 140 and 280 us per layer instance; the mean over both ranks is 210
    assert "layers.*: 5 k / 50 µs vs 7 k / 210 µs" in out
    assert "a0.sqlite (+1 ranks)" in out
    code, out = invoke("profile", "diff", ",", str(b[0]))
    assert code != 0


def test_capture_needs_a_command() -> None:
    code, _ = invoke("profile", "capture", "--tool", "torch")
    assert code != 0


def _bad_files(tmp: Path) -> dict[str, Path]:
    corrupt = tmp / "corrupt.sqlite"
    corrupt.write_bytes(b"SQLite format 3\x00" + b"\x07" * 4000)
    foreign = tmp / "foreign.sqlite"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    con.commit()
    con.close()
    good = json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1.0, "dur": 2.0,
                                        "pid": 0, "tid": 7, "name": "k"}] * 50})
    truncated = tmp / "truncated.json"
    truncated.write_text(good[: len(good) // 2])
    truncated_gz = tmp / "truncated.json.gz"
    truncated_gz.write_bytes(gzip.compress(good.encode())[:60])
    other = tmp / "notes.txt"
    other.write_text("hello")
    # Directory exports with one damaged table file: Arrow IPC (arrowdir) and Parquet.
    table = pl.DataFrame({"start": list(range(1000)), "end": list(range(1, 1001))})
    arrow_dir = tmp / "arrowdir"
    arrow_dir.mkdir()
    table.write_ipc(arrow_dir / "NVTX_EVENTS.arrow")
    (arrow_dir / "CUPTI_ACTIVITY_KIND_KERNEL.arrow").write_bytes(
        (arrow_dir / "NVTX_EVENTS.arrow").read_bytes()[:300])
    pq_dir = tmp / "parquetdir"
    pq_dir.mkdir()
    table.write_parquet(pq_dir / "CUPTI_ACTIVITY_KIND_KERNEL.parquet")
    (pq_dir / "NVTX_EVENTS.parquet").write_bytes(b"PAR1" + b"\x00" * 64)
    return {"corrupt": corrupt, "foreign": foreign, "truncated": truncated,
            "truncated_gz": truncated_gz, "other": other, "missing": tmp / "nope.sqlite",
            "arrowdir": arrow_dir, "parquetdir": pq_dir}


@pytest.mark.parametrize("kind", ["corrupt", "foreign", "truncated", "truncated_gz", "other",
                                  "missing", "arrowdir", "parquetdir"])
def test_bad_inputs_are_one_line_exit_2(tmp_path: Path, kind: str) -> None:
    path = _bad_files(tmp_path)[kind]
    from agentload.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "layers", str(path)])
    assert exc.value.code == 2


def test_bad_input_subprocess_message(tmp_path: Path) -> None:
    bad = _bad_files(tmp_path)
    for kind in ("foreign", "truncated", "arrowdir"):
        done = run_cli("profile", "layers", str(bad[kind]), timeout=120)
        assert done.returncode == 2
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentload: error: "), done.stderr
        assert "Traceback" not in done.stderr
    assert "not an Nsight Systems export" in run_cli(
        "profile", "layers", str(bad["foreign"]), timeout=120).stderr


async def test_nvtx_handles_cross_await() -> None:
    # Works (as no-ops or real ranges) whether or not the nvtx package is installed.
    handles = [nvtx.start(f"request {i}") for i in range(3)]

    async def request(h: nvtx.RangeHandle) -> str:
        await asyncio.sleep(0)
        nvtx.end(h)
        return h.message

    done = await asyncio.gather(*(request(h) for h in reversed(handles)))
    assert done == ["request 2", "request 1", "request 0"]
    async with nvtx.arange("phase") as h:
        await asyncio.sleep(0)
    assert h.domain == "agentload"
    with nvtx.srange("sync"):
        nvtx.mark("here")


def test_capture_with_torch_profiler(tmp_path: Path) -> None:
    """`profile capture -- python SCRIPT` on the CPU build of torch (no GPU ops, so no
    layers), through the same console entry a user types."""
    pytest.importorskip("torch")
    script = tmp_path / "work.py"
    script.write_text(
        "import torch\n"
        "from torch.profiler import record_function\n"
        "with record_function(\"model.layers.0\"):\n"
        "    torch.ones(8) @ torch.ones(8)\n")
    import sys
    done = run_cli("profile", "capture", "--tool", "torch", "--out", str(tmp_path / "prof"),
                   "--", sys.executable, str(script), timeout=300)
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "prof" / "profile.json.gz"
    assert trace.exists() and f"profile: {trace}" in done.stdout
    from agentload.profiler import load_profile
    profile = load_profile(trace)
    assert "model.layers.0" in profile.ranges["name"].to_list()


def test_nsys_diagnostics_about_lost_events_are_warnings(tmp_path: Path) -> None:
    x = SyntheticExport()
    x.process(1, "p")
    t = x.thread(1, 2)
    x.push(t, 0, 100 * US, "model.layers.0")
    x.launch_kernel(t, 10 * US, 20 * US, "void gemm()", api_ns=US)
    db = x.write(tmp_path / "diag.sqlite")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE DIAGNOSTIC_EVENT (timestamp INTEGER, timestampType INTEGER, "
                "source INTEGER, severity INTEGER, text TEXT, globalPid INTEGER)")
    lost = "CUPTI dropped 1234 activity records: buffer overflow"
    con.executemany("INSERT INTO DIAGNOSTIC_EVENT VALUES (0, 0, 0, 2, ?, 0)",
                    [(lost,), (lost,), ("Profiling started",)])
    con.commit()
    con.close()
    code, out = invoke("profile", "layers", str(db), "--json", "--level", "layer")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["warnings"] == [f"nsys reported: {lost} (2 times)"]
    assert doc["layers"][0]["kernels"] == 1
    code, out = invoke("profile", "layers", str(db))
    assert code == 0 and f"warning: nsys reported: {lost} (2 times)" in out
    assert "Profiling started" not in out


def test_diff_sets_the_kernels_rooms_paths_side_by_side() -> None:
    """``layer3.standard`` and ``layer3.fused`` (one path per trace, from `agentload bench
    kernels --trace-dir`) are both the decoder-layer row, so a diff compares them."""
    from agentload.profiler.diff import LAYER_KEY, canonical_type

    assert canonical_type("layer*.standard") == LAYER_KEY
    assert canonical_type("layer*.fused") == LAYER_KEY
    assert canonical_type("layer*.fused.attn") != LAYER_KEY  # a range inside a layer
    assert canonical_type("player*.fused") != LAYER_KEY
