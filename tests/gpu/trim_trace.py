"""Cut a Kineto trace (``.json.gz``) down to its first N events in time, for a fixture.

Keeps every metadata event (``ph == "M"``: process and thread names) and the events that
start before the cut, so what is kept is a contiguous stretch of the capture, whole
steps at its start. Standard library only: it runs on the GPU box too.

    python3 tests/gpu/trim_trace.py IN.json.gz OUT.json.gz --events 60000
"""

from __future__ import annotations

import argparse
import gzip
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--events", type=int, default=60_000)
    args = parser.parse_args()
    with gzip.open(args.src, "rt") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") != "M" and "ts" in e),
                   key=lambda e: float(e["ts"]))
    if len(timed) > args.events:
        cut = float(timed[args.events]["ts"])
        timed = [e for e in timed if float(e["ts"]) < cut]
    trace["traceEvents"] = meta + timed
    with gzip.open(args.dst, "wt") as fh:
        json.dump(trace, fh)
    print(f"{args.src}: kept {len(timed)} of {len(events)} events")


if __name__ == "__main__":
    main()
