"""The CLI as a user meets it: help, and bad input ending in one clear line and status 2."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support import run_cli


def assert_one_line_error(proc, *fragments: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("agentload: error:")]
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_lists_the_commands() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("replay", "demo", "serve", "report", "traces"):
        assert command in proc.stdout
    assert run_cli("--version").stdout.startswith("agentload ")


def test_missing_trace(tmp_path: Path) -> None:
    proc = run_cli("replay", str(tmp_path / "nope.jsonl"), "--target", "http://127.0.0.1:9",
                   "-o", str(tmp_path / "run"))
    assert_one_line_error(proc, "trace file not found", "nope.jsonl")


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://x", "http://", "http://h:99999"])
def test_malformed_target_url(tmp_path: Path, url: str) -> None:
    proc = run_cli("replay", str(Path(__file__).parents[1] / "traces/data/demo_agentx.jsonl"),
                   "--target", url, "-o", str(tmp_path / "run"))
    assert_one_line_error(proc, "--target")


def test_unreachable_target_leaves_the_run_dir_reusable(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    trace = Path(__file__).parents[1] / "traces/data/demo_agentx.jsonl"
    proc = run_cli("replay", str(trace), "--target", f"http://127.0.0.1:{port}",
                   "-o", str(tmp_path / "run"))
    assert_one_line_error(proc, f"cannot reach http://127.0.0.1:{port}")
    assert not (tmp_path / "run" / "journal.jsonl").exists()


def test_target_and_embedded_are_exclusive(tmp_path: Path) -> None:
    trace = Path(__file__).parents[1] / "traces/data/demo_agentx.jsonl"
    proc = run_cli("replay", str(trace), "-o", str(tmp_path / "run"))
    assert_one_line_error(proc, "exactly one target")


def test_serve_on_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = run_cli("serve", "--embedded", "--port", str(port), "--log",
                       str(tmp_path / "s.log"))
    assert_one_line_error(proc, f"port {port}", "already in use")


def test_serve_without_embedded() -> None:
    assert_one_line_error(run_cli("serve"), "--embedded")


def test_report_on_a_directory_without_a_run(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("report", str(tmp_path)), "holds no run journal")


def test_traces_stats_json() -> None:
    import json
    proc = run_cli("traces", "stats", "--json",
                   str(Path(__file__).parents[1] / "traces/data/demo_agentx.jsonl"))
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert stats["requests"] == 49
    assert 0.75 < stats["theoretical_prefix_cache_hit_rate"] < 0.82


def test_bad_trace_line_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"agentload_trace": 1}\n{"session": "s", "requests": [{"id": "a"}]}\n')
    assert_one_line_error(run_cli("traces", "stats", str(bad)), "bad.jsonl:2", "'a'", "blocks")
