"""The rooms' contracts (docs/architecture.md), checked on the source so a breach fails CI.

- Dependencies run one way: ``traces`` <- ``replay`` <- ``tui``; ``profiler`` imports no
  other room, ``kernels`` only ``profiler``. Only the top-level ``agentload`` package (the CLI)
  may import every room, and any room may use its small shared helpers
  (``agentload._hugepages`` and the like), never its CLI.
- No room imports another room's private names or modules (``_name``).
- Every package folder is listed in ``pyproject.toml`` (a missing one silently drops out
  of the wheel).
- Every name in an ``__all__`` exists.
- A test imports a private name or module (``_name``) only from the module it is the
  test of (``tests/.../test_<stem>.py`` for ``<stem>.py`` or ``_<stem>.py``); every other
  test goes through the public surface.

Each checker runs on the repository and, to show it can fail, on a small tree with the
breach it looks for.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("traces", "replay", "profiler", "kernels", "tui")
ALLOWED: dict[str, set[str]] = {
    "traces": set(),
    "replay": {"traces"},
    "tui": {"replay", "traces"},
    "profiler": set(),
    "kernels": {"profiler"},  # to measure itself
}
CLI_MODULES = {"agentload.cli", "agentload.__main__"}


def _imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module, imported names, line) of every absolute import in a file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno


def room_breaches(root: Path) -> list[str]:
    """Imports against the dependency direction, or of another room's private names."""
    found = []
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            where = path.relative_to(root)
            for module, names, line in _imports(path):
                parts = module.split(".")
                if parts[0] != "agentload" or len(parts) < 2:
                    continue
                target = parts[1]
                if target == room:
                    continue
                if target not in ROOMS:
                    if module in CLI_MODULES:
                        found.append(f"{where}:{line}: {room} imports the CLI ({module})")
                    continue
                if target not in ALLOWED[room]:
                    found.append(f"{where}:{line}: {room} may not import {target} ({module})")
                private = [p for p in parts[2:] if p.startswith("_")]
                private += [n for n in names if n.startswith("_")]
                if private:
                    found.append(f"{where}:{line}: private {', '.join(private)} of {target} "
                                 f"imported by {room}")
    return found


def missing_packages(root: Path) -> list[str]:
    """Package folders (with an ``__init__.py``) that ``pyproject.toml`` does not list."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder: package for package, folder in config["package-dir"].items()}
    listed = set(config["packages"])
    missing = []
    for init in sorted(root.glob("*/**/__init__.py")):
        folder = init.parent.relative_to(root).as_posix()
        if folder.split("/")[0] not in (*ROOMS, "agentload"):
            continue
        package = folders.get(folder)
        if package is None or package not in listed:
            missing.append(folder)
    return missing


def test_rooms_depend_one_way_and_keep_private_names_private() -> None:
    assert room_breaches(ROOT) == []


def test_the_room_check_catches_a_private_import_and_a_backward_one(tmp_path: Path) -> None:
    for room in ROOMS:
        (tmp_path / room).mkdir()
    (tmp_path / "tui" / "ok.py").write_text("from agentload.replay.live import LiveBoard\n")
    (tmp_path / "tui" / "peek.py").write_text(
        "from agentload.replay.live._board import LiveBoard\n"
        "from agentload.replay.live import _Intervals\n")
    (tmp_path / "traces" / "back.py").write_text("import agentload.replay.run\n")
    (tmp_path / "profiler" / "cli_use.py").write_text("from agentload.cli import main\n")
    found = room_breaches(tmp_path)
    assert len(found) == 4
    assert any("private _board of replay imported by tui" in f for f in found)
    assert any("private _Intervals" in f for f in found)
    assert any("traces may not import replay" in f for f in found)
    assert any("profiler imports the CLI" in f for f in found)


def test_every_package_folder_is_in_pyproject() -> None:
    assert missing_packages(ROOT) == []


def test_the_package_check_catches_an_unlisted_folder(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["agentload.replay"]\n'
        '[tool.setuptools.package-dir]\n"agentload.replay" = "replay"\n')
    for folder in ("replay", "replay/live"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    assert missing_packages(tmp_path) == ["replay/live"]


def _modules_with_all() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = []
    for package, folder in config["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if "__all__" not in path.read_text():
                continue
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out.append(name)
    return out


@pytest.mark.parametrize("module", _modules_with_all())
def test_every_name_in___all___exists(module: str) -> None:
    loaded = importlib.import_module(module)
    missing = [name for name in getattr(loaded, "__all__", ()) if not hasattr(loaded, name)]
    assert missing == []


def private_test_imports(root: Path) -> list[str]:
    """Tests importing a private name or module of agentload that is not theirs."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        if "data" in path.relative_to(root / "tests").parts:
            continue
        own = path.stem.removeprefix("test_")
        for module, names, line in _imports(path):
            parts = module.split(".")
            if parts[0] != "agentload":
                continue
            private = [p for p in parts[1:] if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            if not private:
                continue
            # The module under test: the last dotted part, or an imported private module.
            subjects = {parts[-1].lstrip("_")} | {n.lstrip("_") for n in names
                                                   if n.startswith("_")}
            if not any(own == s or own.endswith("_" + s) for s in subjects):
                found.append(f"{path.relative_to(root)}:{line}: private "
                             f"{', '.join(private)} of {module}")
    return found


def test_tests_use_public_names_except_in_their_own_modules_tests() -> None:
    assert private_test_imports(ROOT) == []


def test_the_test_import_check_catches_a_peek_into_another_module(tmp_path: Path) -> None:
    tests = tmp_path / "tests" / "tui"
    tests.mkdir(parents=True)
    peek = "from agentload.replay.live._board import _Intervals\n"
    (tests / "test_live.py").write_text(peek)
    (tests / "test_board.py").write_text(peek)
    (tests / "test_cache.py").write_text("from agentload.kernels import _cache\n")
    (tests / "test_ops.py").write_text("from agentload.kernels import _cache, ops\n")
    found = private_test_imports(tmp_path)
    assert [f.split(":")[0] for f in found] == ["tests/tui/test_live.py",
                                                "tests/tui/test_ops.py"]
