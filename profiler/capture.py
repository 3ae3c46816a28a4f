"""``agentload profile capture -- CMD``: run a command under a profiler, then attribute.

With ``nsys`` on the PATH (or ``--tool nsys``) the command runs under
``nsys profile --trace=cuda,nvtx --cuda-graph-trace=node --trace-fork-before-exec=true``
(node tracing so graph replays map back to capture-time layers; fork tracing so
spawned TP workers are seen) and is exported to SQLite. Otherwise a Python command
(``python script.py ...`` or ``python -m mod ...``) runs inside
:mod:`agentload.profiler.torch_run`, which wraps it in ``torch.profiler.profile`` and
writes a gzipped Kineto trace. The argv is passed as a list, never through a shell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from agentload.profiler.errors import ProfileError

NSYS_FLAGS = ("--trace=cuda,nvtx", "--cuda-graph-trace=node", "--trace-fork-before-exec=true",
              "--sample=none", "--cpuctxsw=none", "--force-overwrite=true")


def _is_python(arg: str) -> bool:
    name = Path(arg).name
    return name.startswith("python") or arg == sys.executable


def capture(cmd: list[str], out_dir: Path, tool: str = "auto") -> Path:
    """Run ``cmd`` profiled; return the profile file (``.sqlite`` or ``.json.gz``)."""
    if not cmd:
        raise ProfileError("capture: no command given (use `agentload profile capture -- CMD`)")
    out_dir.mkdir(parents=True, exist_ok=True)
    nsys = shutil.which("nsys")
    if tool == "nsys" or (tool == "auto" and nsys):
        if not nsys:
            raise ProfileError("capture: --tool nsys but no nsys on the PATH")
        rep = out_dir / "profile"
        _run([nsys, "profile", *NSYS_FLAGS, "-o", str(rep), *cmd])
        sqlite = out_dir / "profile.sqlite"
        _run([nsys, "export", "--type", "sqlite", "--force-overwrite=true", "-o", str(sqlite),
              str(rep) + ".nsys-rep"])
        return sqlite
    if not _is_python(cmd[0]):
        raise ProfileError("capture: without nsys only Python commands can be profiled "
                           f"(python script.py ... or python -m module ...), not {cmd[0]!r}")
    trace = out_dir / "profile.json.gz"
    _run([cmd[0], "-m", "agentload.profiler.torch_run", "--out", str(trace), "--", *cmd[1:]])
    if not trace.exists():
        raise ProfileError(f"capture: the command ran but wrote no trace at {trace}")
    return trace


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(argv, env=os.environ.copy(), check=False)
    except OSError as exc:
        raise ProfileError(f"capture: cannot start {argv[0]} ({exc.strerror})") from None
    if done.returncode:
        raise ProfileError(f"capture: {Path(argv[0]).name} exited with status {done.returncode}")
