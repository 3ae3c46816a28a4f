"""The distribution installs only the ``agentload`` import name, editable and as a wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

ROOMS = ("traces", "replay", "profiler", "kernels", "tui")
CHECK = (
    "import importlib.util, agentload, sys\n"
    "import agentload.traces, agentload.replay, agentload.profiler, agentload.kernels, "
    "agentload.tui\n"
    f"clashes = [n for n in {ROOMS!r} if importlib.util.find_spec(n) is not None]\n"
    "assert not clashes, clashes\n"
    "print(agentload.__file__)\n"
)


def test_editable_install_exposes_only_agentload(tmp_path: Path) -> None:
    # Run outside the checkout, so the repository folders are not on sys.path.
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).parent == ROOT / "agentload"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (found,) = out.glob("agentload-*.whl")
    return found


def test_wheel_holds_only_agentload(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"agentload", next(t for t in tops if t.endswith(".dist-info"))}
    for room in ROOMS:
        assert f"agentload/{room}/__init__.py" in names
    assert "agentload/traces/data/demo_agentx.jsonl" in names
    assert "agentload/replay/engine/core.py" in names


def test_wheel_imports_as_agentload(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")
                  and p.name != "bin") == ["agentload"]
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target))
