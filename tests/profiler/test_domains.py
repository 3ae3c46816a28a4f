"""NVTX domains: names resolved per process, ``domain:text`` labels, ``--domain``."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from agentload.cli import app
from agentload.profiler import attribute, load_profile, summarize
from agentload.profiler.errors import ProfileError
from agentload.profiler.load import keep_domains
from agentload.profiler.synthetic import SyntheticExport

US = 1_000


def export(path: Path) -> Path:
    """Two processes; in each, domain id 1 names a different domain (ids are per
    process). A layer range in the default domain holds a library range that wraps the
    all-reduce kernel."""
    x = SyntheticExport()
    for pid, lib in ((10, "NCCL"), (20, "cuBLAS")):
        x.process(pid, f"rank{pid}")
        th = x.thread(pid, pid + 1)
        x.domain(th, 1, lib)
        x.push(th, 0, 100 * US, "model.layers.0")
        x.launch_kernel(th, 1 * US, 10 * US, "gemm", api_ns=1 * US, gpu_ns=5 * US)
        x.push(th, 20 * US, 40 * US, "allreduce", domain=1)
        x.launch_kernel(th, 21 * US, 30 * US, "nccl_kernel", api_ns=1 * US, gpu_ns=7 * US)
    return x.write(path)


def test_domain_names_are_per_process_and_prefix_labels(tmp_path: Path) -> None:
    prof = load_profile(export(tmp_path / "d.sqlite"))
    got = prof.ranges.sort("proc", "start").select("name", "domain").rows()
    assert got == [("model.layers.0", None), ("allreduce", "NCCL"),
                   ("model.layers.0", None), ("allreduce", "cuBLAS")]
    s = summarize(attribute(prof), level="innermost")
    names = sorted(s.layers["name"].to_list())
    assert names == ["NCCL:allreduce", "cuBLAS:allreduce", "model.layers.0", "model.layers.0"]
    # the library range owns its kernel: 1 kernel of 7 us in each
    lib = s.layers.filter(pl.col("name").str.contains(":"))
    assert lib["kernels"].to_list() == [1, 1] and lib["kernel_ns"].to_list() == [7 * US] * 2


def test_keep_default_domain_gives_the_wrapped_kernel_to_the_layer(tmp_path: Path) -> None:
    prof = keep_domains(load_profile(export(tmp_path / "d.sqlite")), ["default"])
    s = summarize(attribute(prof), level="innermost")
    assert s.layers["name"].to_list() == ["model.layers.0", "model.layers.0"]
    assert s.layers["kernels"].to_list() == [2, 2]
    assert s.layers["kernel_ns"].to_list() == [12 * US, 12 * US]
    assert any("NVTX domain default" in n for n in s.notes)


def test_unknown_domain_lists_the_present_ones(tmp_path: Path) -> None:
    prof = load_profile(export(tmp_path / "d.sqlite"))
    with pytest.raises(ProfileError, match=r"'MPI'; domains present: NCCL, cuBLAS, default"):
        keep_domains(prof, ["MPI"])


def test_domain_option_on_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = export(tmp_path / "d.sqlite")
    out = CliRunner().invoke(app, ["profile", "layers", str(db), "--json", "--domain", "NCCL"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["layers"]
    assert sorted((r["name"], r["kernels"]) for r in rows) == [
        ("(no range)", 1), ("(no range)", 2), ("NCCL:allreduce", 1)]
    from agentload.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "layers", str(db), "--domain", "MPI"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "domains present: NCCL, cuBLAS, default" in err[0]
