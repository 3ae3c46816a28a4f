"""NVTX categories: names resolved per process and domain, numbers where never named,
``--category`` on the commands; read alike from SQLite and Parquet exports."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from agentload.cli import app
from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.errors import ProfileError
from agentload.profiler.load import keep_categories
from agentload.profiler.synthetic import SyntheticExport

US = 1_000


def export(path: Path) -> Path:
    """Two processes. In each, category 1 is named (differently: ids are per process),
    in the default domain, once with a null domain id as a default-domain call may
    record it; category 7 is never named; a domain of its own reuses id 1 for another
    name. A "layer" range holds an "op" range that wraps the second kernel."""
    x = SyntheticExport()
    for pid, layer_name in ((10, "layer"), (20, "block")):
        x.process(pid, f"rank{pid}")
        th = x.thread(pid, pid + 1)
        x.category(th, 1, layer_name, domain=0 if pid == 10 else None)
        x.domain(th, 3, "lib")
        x.category(th, 1, "lib-cat", domain=3)
        x.push(th, 0, 100 * US, "model.layers.0", category=1)
        x.launch_kernel(th, 1 * US, 10 * US, "gemm", api_ns=1 * US, gpu_ns=5 * US)
        x.push(th, 20 * US, 40 * US, "attn.op", category=7)
        x.launch_kernel(th, 21 * US, 30 * US, "attn_kernel", api_ns=1 * US, gpu_ns=7 * US)
        x.push(th, 50 * US, 60 * US, "lib.call", domain=3, category=1)
        x.push(th, 70 * US, 80 * US, "plain")
    return x.write(path)


def test_category_names_per_process_and_domain(tmp_path: Path) -> None:
    prof = load_profile(export(tmp_path / "c.sqlite"))
    got = prof.ranges.sort("proc", "start").select("name", "domain", "category").rows()
    assert got == [("model.layers.0", None, "layer"), ("attn.op", None, "7"),
                   ("lib.call", "lib", "lib-cat"), ("plain", None, None),
                   ("model.layers.0", None, "block"), ("attn.op", None, "7"),
                   ("lib.call", "lib", "lib-cat"), ("plain", None, None)]


def test_the_same_from_a_parquet_directory_export(tmp_path: Path) -> None:
    db = export(tmp_path / "c.sqlite")
    import sqlite3

    out = tmp_path / "pq"
    out.mkdir()
    with sqlite3.connect(db) as con:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'"):
            cur = con.execute(f"SELECT * FROM {table}")
            cols = [d[0] for d in cur.description]
            rows = cur.fetchall()
            frame = pl.DataFrame([dict(zip(cols, r, strict=True)) for r in rows],
                                 schema=cols if not rows else None, orient="row",
                                 infer_schema_length=None)
            frame.write_parquet(out / f"{table}.parquet")
    assert "category" in pl.read_parquet_schema(out / "NVTX_EVENTS.parquet")
    a = load_profile(db).ranges.sort("proc", "start").select("name", "category")
    b = load_profile(out).ranges.sort("proc", "start").select("name", "category")
    assert a.rows() == b.rows() and a["category"].null_count() == 2


def test_keep_a_category_gives_the_wrapped_kernel_to_the_layer(tmp_path: Path) -> None:
    prof = load_profile(export(tmp_path / "c.sqlite"))
    inner = summarize(attribute(prof), level="innermost")
    assert sorted(inner.layers["name"].to_list()) == ["attn.op", "attn.op", "model.layers.0",
                                                      "model.layers.0"]
    kept = keep_categories(prof, ["layer", "block"])
    assert kept.ranges["name"].to_list() == ["model.layers.0"] * 2
    s = summarize(attribute(kept), level="innermost")
    assert s.layers["kernels"].to_list() == [2, 2]
    assert s.layers["kernel_ns"].to_list() == [12 * US, 12 * US]
    assert any("NVTX category layer, block" in n for n in s.notes)
    # Never named: by its number; without one: "none".
    assert keep_categories(prof, ["7"]).ranges["name"].unique().to_list() == ["attn.op"]
    assert keep_categories(prof, ["none"]).ranges["name"].unique().to_list() == ["plain"]


def test_unknown_category_lists_the_present_ones(tmp_path: Path) -> None:
    prof = load_profile(export(tmp_path / "c.sqlite"))
    with pytest.raises(ProfileError, match=r"'attention'; categories present: 7, block, "
                                           r"layer, lib-cat, none"):
        keep_categories(prof, ["attention"])


def test_category_option_on_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    db = export(tmp_path / "c.sqlite")
    out = CliRunner().invoke(app, ["profile", "layers", str(db), "--json",
                                   "--category", "layer", "--category", "block"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["layers"]
    assert sorted((r["name"], r["kernels"]) for r in rows) == [
        ("model.layers.0", 2), ("model.layers.0", 2)]
    from agentload.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "steps", str(db), "--category", "attention"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "present: 7, block, layer, lib-cat, none" in err[0]


def test_exports_without_categories_read_as_before(tmp_path: Path) -> None:
    x = SyntheticExport()
    x.process(1, "p")
    th = x.thread(1, 2)
    x.push(th, 0, 10 * US, "r")
    x.launch_kernel(th, 1 * US, 2 * US, "k")
    prof = load_profile(x.write(tmp_path / "n.sqlite"))
    assert prof.ranges["category"].to_list() == [None]
    with pytest.raises(ProfileError, match="categories present: none"):
        keep_categories(prof, ["layer"])
