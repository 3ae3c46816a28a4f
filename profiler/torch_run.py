"""Run a Python script or module under ``torch.profiler`` and write a Kineto trace.

``python -m agentload.profiler.torch_run --out T.json.gz -- script.py ARGS`` (or
``-- -m module ARGS``): CPU and, when CUDA is available, CUDA activities; the trace is
written even when the script exits through ``SystemExit``.
"""

from __future__ import annotations

import argparse
import gzip
import runpy
import shutil
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentload.profiler.torch_run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("target", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    target: list[str] = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        parser.error("no script or -m module given")
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("agentload: error: capture needs torch in this Python", file=sys.stderr)
        return 2
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    code = 0
    with profile(activities=acts) as prof:
        try:
            if target[0] == "-m":
                sys.argv = target[1:]
                runpy.run_module(target[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = target
                runpy.run_path(target[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    tmp = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(tmp))
    with open(tmp, "rb") as src, gzip.open(args.out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return code


if __name__ == "__main__":
    sys.exit(main())
