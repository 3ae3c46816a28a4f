"""Ahead-of-time build: ``python -m agentload.kernels.aot --arch sm_90a --out DIR``.

Compiles every variant the benchmarks use (``presets.bench_specs``) on a machine with
``nvidia-cutlass-dsl`` and no GPU, writing ``DIR/<arch>/<key>.so``; copy ``DIR`` to the GPU
machine and point ``AGENTLOAD_KERNEL_CACHE`` at it. ``--runtime`` also copies
``libcute_dsl_runtime.so`` beside the kernels.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentload.kernels.aot")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default="", help="build only keys containing this text")
    p.add_argument("--runtime", action="store_true", help="copy libcute_dsl_runtime.so too")
    p.add_argument("--ptx", action="store_true", help="keep the PTX next to each .so")
    p.add_argument("--skip-existing", action="store_true",
                   help="keep .so files already in --out (rebuild after a kernel change: omit)")
    args = p.parse_args(argv)
    os.environ["CUTE_DSL_ARCH"] = args.arch
    from agentload.kernels._build import export_spec, runtime_libraries
    from agentload.kernels.presets import bench_specs

    out = args.out / args.arch
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for spec in bench_specs():
        if args.only and args.only not in spec.key():
            continue
        if args.skip_existing and (out / f"{spec.key()}.so").is_file():
            continue
        t0 = time.perf_counter()
        try:
            path = export_spec(spec, out, keep_ptx=args.ptx)
        except Exception as exc:  # report every failing variant, keep building the rest
            failed += 1
            print(f"FAIL {spec.key()}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        print(f"ok   {path.name} {path.stat().st_size / 1e3:.0f} kB "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.runtime:
        for lib in runtime_libraries():
            if lib.endswith("libcute_dsl_runtime.so"):
                shutil.copy(lib, out / "libcute_dsl_runtime.so")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
