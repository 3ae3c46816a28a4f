"""Snapshot tests pinning the dashboard's layout (pytest-textual-snapshot, Textual 8.2.8).

Each screen is drawn from a scripted source (a synthetic run on a clock that does not
move), so the SVGs in ``__snapshots__/test_snapshots/`` change only when the
layout does. After a deliberate change, review and regenerate them with
``pytest tests/tui/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentload.tui.app import DashboardApp
from agentload.tui.synthetic import ScriptedSource, write_synthetic_run

SnapCompare = Callable[..., bool]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("snap") / "run", users=30,
                               duration_s=180, seed=21, error_rate=0.02, gpus=2).run_dir


@pytest.fixture
def app_for(run_dir: Path) -> Iterator[Callable[..., DashboardApp]]:
    sources: list[ScriptedSource] = []

    def make(live: bool = False, **kw: Any) -> DashboardApp:
        source = ScriptedSource(run_dir, live=live, start_s=90.0)
        sources.append(source)
        return DashboardApp(source, **kw)

    yield make
    for s in sources:
        s.close()


def test_dashboard_100x30(snap_compare: SnapCompare, app_for: Callable[..., DashboardApp]
                          ) -> None:
    assert snap_compare(app_for(), terminal_size=(100, 30))


def test_dashboard_200x60(snap_compare: SnapCompare, app_for: Callable[..., DashboardApp]
                          ) -> None:
    assert snap_compare(app_for(), terminal_size=(200, 60))


def test_zoomed_users_table(snap_compare: SnapCompare,
                            app_for: Callable[..., DashboardApp]) -> None:
    assert snap_compare(app_for(), press=["2"], terminal_size=(100, 30))


def test_user_weighting_and_paused(snap_compare: SnapCompare,
                                   app_for: Callable[..., DashboardApp]) -> None:
    assert snap_compare(app_for(), press=["w", "p"], terminal_size=(100, 30))


def test_help_screen(snap_compare: SnapCompare, app_for: Callable[..., DashboardApp]) -> None:
    assert snap_compare(app_for(), press=["question_mark"], terminal_size=(100, 30))


def test_confirm_stop_on_a_live_run(snap_compare: SnapCompare,
                                    app_for: Callable[..., DashboardApp]) -> None:
    assert snap_compare(app_for(live=True), press=["q"], terminal_size=(100, 30))


def test_stopping_a_live_run(snap_compare: SnapCompare,
                             app_for: Callable[..., DashboardApp]) -> None:
    assert snap_compare(app_for(live=True), press=["q", "y"], terminal_size=(100, 30))


@pytest.fixture(scope="module")
def saturated_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("snap-sat") / "run", users=12,
                               duration_s=120, seed=21, error_rate=0.0, gpus=1,
                               client_saturated_at_s=60).run_dir


def test_saturated_client_is_invalid(snap_compare: SnapCompare, saturated_run_dir: Path
                                     ) -> None:
    source = ScriptedSource(saturated_run_dir, start_s=90.0)
    try:
        assert snap_compare(DashboardApp(source), terminal_size=(160, 30))
    finally:
        source.close()
