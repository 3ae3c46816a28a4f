"""Run ``mypy --strict`` over the installed package layout (``python tests/typecheck.py``).

The rooms live in top-level folders and install as ``agentload.*`` through setuptools'
package-dir mapping; an editable install resolves that with an import hook, which mypy
cannot follow, so without help every cross-room import would be typed ``Any``. This
builds the layout as symlinks in a temporary directory and checks ``-p agentload``
there, so imports between rooms are checked for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("traces", "replay", "profiler", "kernels", "tui")


def run_mypy() -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="agentload-mypy-") as tmp:
        pkg = Path(tmp) / "agentload"
        pkg.mkdir()
        for src in (ROOT / "agentload").glob("*.py"):
            (pkg / src.name).symlink_to(src)
        for room in ROOMS:
            (pkg / room).symlink_to(ROOT / room, target_is_directory=True)
        env = {**os.environ, "MYPYPATH": tmp}
        return subprocess.run(
            [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
             "--cache-dir", str(ROOT / ".mypy_cache"), "-p", "agentload"],
            cwd=tmp, env=env, capture_output=True, text=True)


if __name__ == "__main__":
    result = run_mypy()
    sys.stdout.write(result.stdout.replace(str(Path(tempfile.gettempdir())), "<tmp>"))
    sys.stderr.write(result.stderr)
    sys.exit(result.returncode)
