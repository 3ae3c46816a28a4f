"""Headless Chromium for report tests: render a page offline, dump its DOM, screenshot it.

Chromium starts with the background-networking features off and a fresh profile, and the
pages are opened from file:// URLs, so a report that tried to fetch anything (a CDN copy
of plotly.js, say) would render without its figures and fail the test.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=15000")


def chromium() -> str:
    """The browser's path, or skip the test saying why (``make test`` installs it)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on PATH (make test installs Debian's chromium where it can)")


def _run(page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120, check=False)


def rendered_dom(page: Path) -> str:
    """The page's DOM after its scripts ran (plotly draws its SVG then)."""
    proc = _run(page, "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-1000:]
    return proc.stdout


def screenshot(page: Path, out: Path, size: str = "1300,4000") -> Path:
    proc = _run(page, f"--window-size={size}", f"--screenshot={out}")
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-1000:]
    return out


def distinct_colors(png: Path) -> int:
    """How many colours a screenshot holds: a blank or text-only page has few."""
    from PIL import Image

    with Image.open(png) as img:
        colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colors) if colors is not None else 1 << 20
