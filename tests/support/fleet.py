"""What the ``--workers`` and ``--ray`` tests share: the request key two runs must agree
on, a replay started as a user starts it, and waits on a worker's journal."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson

from agentload.traces import demo_trace_path
from tests.support import ROOT

KEY = ["request_id", "session_id", "lane", "play", "turn", "phase", "isl_requested",
       "osl_requested", "isl", "osl"]


def worker_pid(journal: Path, timeout_s: float = 60.0) -> int:
    """The pid a worker wrote at the head of its journal (waiting for the journal)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if journal.is_file():
            for line in journal.read_bytes().splitlines():
                obj = orjson.loads(line)
                if obj.get("kind") == "worker":
                    return int(obj["pid"])
        time.sleep(0.1)
    raise AssertionError(f"no worker line in {journal}")


def wait_requests(journal: Path, n: int, timeout_s: float = 60.0) -> None:
    """Wait until ``journal`` holds ``n`` finished requests."""
    deadline = time.monotonic() + timeout_s
    while journal.read_bytes().count(b'{"type":"request"') < n:
        assert time.monotonic() < deadline, f"{journal} never held {n} requests"
        time.sleep(0.05)


def start_replay(server: str, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """``agentload replay`` of the demo trace with two workers, recycling, headless."""
    return subprocess.Popen(
        [sys.executable, "-m", "agentload", "replay", str(demo_trace_path()), "--target",
         server, "--users", "4", "--recycle", "--time-scale", "0.05", "--headless",
         "--no-report", "--workers", "2", "-o", str(run_dir), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


