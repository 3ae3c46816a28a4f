"""The SQLite export read through ADBC's driver equals the ``sqlite3`` read, and falls
back to ``sqlite3`` for columns the driver cannot type."""

from __future__ import annotations

import importlib
import sqlite3
from pathlib import Path

import polars as pl
import pytest

from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.synthetic import SyntheticExport

nsight = importlib.import_module("agentload.profiler.nsight")
pytest.importorskip("adbc_driver_sqlite")
US = 1_000


def export(path: Path) -> Path:
    """NULLs first and values later in the same columns (the driver types a column from
    its first rows): open ranges, registered strings, unregistered text, two ranks."""
    x = SyntheticExport()
    for pid in (10, 20):
        x.process(pid, f"rank{pid}")
        th = x.thread(pid, pid + 1, name="main")
        for step in range(3):
            t0 = step * 1_000 * US
            x.push(th, t0, t0 + 900 * US, "decode_step", registered=step == 2)
            for layer in range(4):
                l0 = t0 + 10 * US + layer * 200 * US
                x.push(th, l0, l0 + 190 * US, f"model.layers.{layer}")
                x.launch_kernel(th, l0 + US, l0 + 5 * US, f"k{layer}", api_ns=US, gpu_ns=3 * US)
                x.memcpy(th, x.launch(th, l0 + 50 * US, l0 + 51 * US), l0 + 60 * US,
                         l0 + 61 * US)
        x.start_end(th, 5_000 * US, 6_000 * US, "async_tail")
        x.push(th, 7_000 * US, None, "still_open")
    return x.write(path)


def frames(path: Path) -> tuple[pl.DataFrame, ...]:
    p = load_profile(path)
    return (p.ops, p.launches, p.ranges, p.strings, p.threads, p.processes)


def test_adbc_read_equals_sqlite3_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = export(tmp_path / "x.sqlite")
    fast = frames(db)
    monkeypatch.setattr(nsight, "_adbc", lambda: None)
    slow = frames(db)
    for a, b in zip(fast, slow, strict=True):
        assert a.schema == b.schema
        assert a.equals(b), (a, b)
    assert fast[2]["end"].null_count() == 0 and fast[2].height == 2 * (3 * 5 + 2)


def test_a_column_the_driver_cannot_type_falls_back(tmp_path: Path) -> None:
    """A string in an integer column: the driver types the column as text (or fails
    mid-read on a big table); the sqlite3 path then reports the bad value as always."""
    db = export(tmp_path / "x.sqlite")
    want = summarize(attribute(load_profile(db)), level="layer").layers
    con = sqlite3.connect(db)
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = 'seven' WHERE rowid = "
                "(SELECT max(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    con.commit()
    con.close()
    with pytest.raises(Exception, match="cannot read CUPTI_ACTIVITY_KIND_KERNEL"):
        load_profile(db)
    assert want.height == 2 * 4  # before the damage: 4 layers per rank


def test_a_file_name_with_uri_characters(tmp_path: Path) -> None:
    """``#`` and ``?`` would end the path in a SQLite URI: the file is still read, and
    nothing is created beside it."""
    db = export(tmp_path / "run#1?b.sqlite")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert load_profile(db).ops.height == 2 * 3 * 4 * 2  # kernels and memcpys
    assert sorted(p.name for p in tmp_path.iterdir()) == before
