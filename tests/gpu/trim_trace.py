"""Cut a Kineto trace (``.json.gz``) down for a fixture or for the trip back from the GPU box.

Keeps every metadata event (``ph == "M"``: process and thread names) and:

- ``--events N``: the first N timed events, a contiguous stretch of the capture;
- ``--steps A:B``: the step ranges (``user_annotation``, in time order) A to B-1, with
  the launches inside them and the GPU work those launches started (by correlation id);
  ``--lean`` also drops what agentload never reads (``cpu_op``, flow arrows, Python
  frames other than ``nn.Module:`` module ranges), which is most of a ``with_stack``
  trace.

Standard library only: it runs on the GPU box too.

    python3 tests/gpu/trim_trace.py IN.json.gz OUT.json.gz --events 60000
    python3 tests/gpu/trim_trace.py IN.json.gz OUT.json.gz --steps 6:9 --lean
"""

from __future__ import annotations

import argparse
import gzip
import json
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def _read_agentload_kept(e: dict[str, Any]) -> bool:
    cat = e.get("cat")
    if cat == "python_function":
        return str(e.get("name", "")).startswith("nn.Module: ")
    return cat in GPU_CATS | LAUNCH_CATS | {"user_annotation"}


def trim_steps(events: list[dict[str, Any]], first: int, last: int,
               lean: bool) -> list[dict[str, Any]]:
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"),
                   key=lambda e: float(e["ts"]))[first:last]
    if not steps:
        raise SystemExit("no step ranges (user_annotation events) in that range")
    lo = float(steps[0]["ts"])
    hi = max(float(s["ts"]) + float(s.get("dur", 0)) for s in steps)
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") not in GPU_CATS
           and lo <= float(e["ts"]) and float(e["ts"]) + float(e.get("dur", 0)) <= hi]
    launched = {(e.get("args") or {}).get("correlation") for e in cpu
                if e.get("cat") in LAUNCH_CATS}
    gpu = [e for e in events if e.get("cat") in GPU_CATS
           and (e.get("args") or {}).get("correlation") in launched]
    kept = cpu + gpu
    if lean:
        kept = [e for e in kept if _read_agentload_kept(e)]
    return sorted(kept, key=lambda e: float(e["ts"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--steps", help="A:B, the step ranges to keep (0-based, B excluded)")
    parser.add_argument("--lean", action="store_true")
    args = parser.parse_args()
    with gzip.open(args.src, "rt") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    if args.steps:
        a, _, b = args.steps.partition(":")
        timed = trim_steps(events, int(a), int(b), args.lean)
    else:
        timed = sorted((e for e in events if e.get("ph") != "M" and "ts" in e),
                       key=lambda e: float(e["ts"]))
        if len(timed) > args.events:
            cut = float(timed[args.events]["ts"])
            timed = [e for e in timed if float(e["ts"]) < cut]
    trace["traceEvents"] = meta + timed
    with gzip.open(args.dst, "wt", compresslevel=9) as fh:
        json.dump(trace, fh, separators=(",", ":"))
    print(f"{args.src}: kept {len(timed)} of {len(events)} events")


if __name__ == "__main__":
    main()
