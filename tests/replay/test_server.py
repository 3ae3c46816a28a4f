"""The launcher with stand-in servers: health wait, log capture, clean stop, no orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from agentload.replay.errors import ServerError
from agentload.replay.serve.server import ManagedServer, ServerSpec, free_port, last_log_error

# A server that forks a grandchild (as vLLM forks its engine core), writes the
# grandchild's pid to a file, then answers /health; it ignores SIGINT when asked to, so
# the SIGKILL fallback is exercised too.
FAKE_SERVER = r"""
import http.server, os, signal, sys, time
port, pidfile, ignore_int = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
child = os.fork()
if child == 0:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        time.sleep(1)
open(pidfile, "w").write(str(child))
if ignore_int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print("fake server starting", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_spec(tmp_path: Path, ignore_int: bool = False, script: str = FAKE_SERVER) -> ServerSpec:
    port = free_port()
    path = tmp_path / "fake_server.py"
    path.write_text(script)
    argv = (sys.executable, str(path), str(port), str(tmp_path / "child.pid"),
            "1" if ignore_int else "0")
    return ServerSpec(argv=argv, host="127.0.0.1", port=port, served_model="fake",
                      label="fake server")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ignore_int", [False, True])
def test_start_health_stop_leaves_no_process(tmp_path: Path, ignore_int: bool) -> None:
    spec = fake_spec(tmp_path, ignore_int=ignore_int)
    lines: list[str] = []
    server = ManagedServer(spec, tmp_path / "server.log", stop_timeout_s=1.0,
                           progress=lines.append)
    with server:
        assert server.running()
        pid = server.pid
        assert pid is not None
        grandchild = int((tmp_path / "child.pid").read_text())
        assert alive(grandchild)
    assert wait_dead(pid) and wait_dead(grandchild)
    assert "fake server starting" in (tmp_path / "server.log").read_text()
    assert any("ready on" in line for line in lines)
    assert server.stop() is None  # idempotent


def test_nice_lowers_the_priority_of_the_server_and_its_children(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with ManagedServer(spec, tmp_path / "server.log", stop_timeout_s=1.0, nice=7) as server:
        assert server.pid is not None
        grandchild = int((tmp_path / "child.pid").read_text())
        assert os.getpriority(os.PRIO_PROCESS, server.pid) == min(19, base + 7)
        assert os.getpriority(os.PRIO_PROCESS, grandchild) == min(19, base + 7)
    with ManagedServer(fake_spec(tmp_path), tmp_path / "plain.log", stop_timeout_s=1.0) as plain:
        assert plain.pid is not None
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == base


def test_exception_inside_the_block_still_stops_the_server(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)
    with pytest.raises(RuntimeError), ManagedServer(spec, tmp_path / "s.log") as server:
        pid = server.pid
        raise RuntimeError("boom")
    assert pid is not None and wait_dead(pid)


def test_server_that_dies_at_start_reports_its_last_error(tmp_path: Path) -> None:
    script = ("import sys\nprint('loading model')\n"
              "print('ValueError: head_dim 16 is not supported')\nsys.exit(3)\n")
    spec = fake_spec(tmp_path, script=script)
    with pytest.raises(ServerError) as info, ManagedServer(spec, tmp_path / "s.log"):
        pass
    message = str(info.value)
    assert "exited with status 3 during start-up" in message
    assert "head_dim 16 is not supported" in message and "s.log" in message


def test_port_in_use_is_refused_before_starting(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        spec = fake_spec(tmp_path)
        spec = ServerSpec(argv=spec.argv, host="127.0.0.1", port=port, served_model="x",
                          label="x")
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            ManagedServer(spec, tmp_path / "s.log").start()


def test_startup_timeout(tmp_path: Path) -> None:
    script = "import time\nwhile True: time.sleep(1)\n"
    spec = fake_spec(tmp_path, script=script)
    server = ManagedServer(spec, tmp_path / "s.log", startup_timeout_s=1.0)
    with pytest.raises(ServerError, match="did not answer"), server:
        pass
    assert not server.running()


def test_last_log_error_prefers_error_lines(tmp_path: Path) -> None:
    log = tmp_path / "l.log"
    log.write_text("INFO ok\nRuntimeError: out of memory\nINFO shutting down\n")
    assert last_log_error(log) == "RuntimeError: out of memory"
    assert last_log_error(tmp_path / "missing.log") == "no log was written"


def test_parent_death_signal_reaches_the_server(tmp_path: Path) -> None:
    """kill -9 of the process that started the server must not leave the server behind."""
    spec = fake_spec(tmp_path)
    launcher = tmp_path / "launcher.py"
    launcher.write_text(
        "import sys, time\nfrom pathlib import Path\n"
        "from agentload.replay.serve.server import ManagedServer, ServerSpec\n"
        f"spec = ServerSpec(argv={spec.argv!r}, host='127.0.0.1', port={spec.port}, "
        "served_model='x', label='x')\n"
        f"s = ManagedServer(spec, Path({str(tmp_path / 's.log')!r})); s.start()\n"
        f"Path({str(tmp_path / 'server.pid')!r}).write_text(str(s.pid))\n"
        "time.sleep(600)\n")
    import subprocess
    proc = subprocess.Popen([sys.executable, str(launcher)])
    pidfile = tmp_path / "server.pid"
    deadline = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    server_pid = int(pidfile.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_dead(server_pid, timeout=10)
    # The grandchild ignores SIGINT and gets no death signal; a real vLLM engine core
    # watches its parent itself. Clean it up here so the test leaves nothing behind.
    grandchild = int((tmp_path / "child.pid").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(grandchild, signal.SIGKILL)
