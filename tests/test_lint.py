"""The house checks run with the suite: ruff over everything, mypy --strict over the code."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT
from tests.typecheck import run_mypy


def test_ruff() -> None:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict() -> None:
    out = run_mypy()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success" in out.stdout
