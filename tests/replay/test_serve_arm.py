"""``agentload serve --arm`` as a user runs it, with a stand-in server for the arm's command.

The stand-in takes vLLM's flags, answers /health and logs a line a second, so the test
sees the launcher's GPU check, its start-up wait, the streamed log and a clean Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentload.replay.serve.server import free_port
from tests.support import run_cli

STAND_IN = """
import argparse, http.server, sys, threading, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
args, rest = p.parse_known_args()
print("stand-in argv:", " ".join(sys.argv[1:]), flush=True)
def tick():
    while True:
        print("stand-in tick", flush=True)
        time.sleep(0.3)
threading.Thread(target=tick, daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
"""


def _arm_file(tmp_path: Path, gpus: int = 1) -> Path:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    arms = tmp_path / "arms.toml"
    arms.write_text(f"""
[arm.stand-in]
model = "org/model"
tensor_parallel_size = {gpus}
command = [{sys.executable!r}, {str(script)!r}]
additional_config = {{ decode_backend = "latency_specialized" }}
""")
    return arms


def test_serve_arm_starts_streams_its_log_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    arms = _arm_file(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentload", "serve", "--arm", f"{arms}:stand-in",
         "--port", str(port), "--log", str(tmp_path / "server.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("stand-in tick" in ln for ln in lines):
            lines.append(proc.stdout.readline())
        text = "".join(lines)
        assert f"at http://127.0.0.1:{port}" in text
        assert "stand-in argv: --model org/model --host 127.0.0.1" in text
        assert '--additional-config {"decode_backend":"latency_specialized"}' in text
        assert "stand-in tick" in text  # the log is streamed, not only written
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stopping" in out


def test_serve_arm_refuses_without_enough_gpus(tmp_path: Path) -> None:
    arms = _arm_file(tmp_path, gpus=4)
    proc = run_cli("serve", "--arm", f"{arms}:stand-in", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert proc.returncode == 2
    assert "needs 4 GPUs" in proc.stderr and "2 are visible" in proc.stderr
    assert "Traceback" not in proc.stderr
    dry = run_cli("serve", "--arm", f"{arms}:stand-in", "--dry-run", "--port", "9",
                  env={"CUDA_VISIBLE_DEVICES": ""})
    assert dry.returncode == 0  # a dry run launches nothing, so it needs no GPU
    assert "--tensor-parallel-size 4" in dry.stdout
