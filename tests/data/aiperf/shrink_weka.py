"""Shrink WEKA session files so the embedded CPU server (16k context) can serve them.

Every token count (``in``, ``out``, ``tool_tokens``, ``system_tokens``) is divided by
FACTOR, and so is every time (``t``, ``api_time``, ``think_time``, ``duration_ms``,
``ttft``: the sessions run FACTOR times faster), and each ``hash_ids`` list keeps
its first ``in // block_size`` ids, so prompts that shared a prefix still share it
(and the system/tool prefix fits the first prompt's blocks). Usage:

    python tests/data/aiperf/shrink_weka.py tests/data/weka tests/data/aiperf/weka-mini
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FACTOR = 16


def shrink(entry: dict[str, Any], block: int) -> dict[str, Any]:
    out = dict(entry)
    for key in ("tool_tokens", "system_tokens"):
        if key in out:
            out[key] = out[key] // FACTOR
    if isinstance(out.get("requests"), list):
        out["requests"] = [shrink(r, block) for r in out["requests"]]
        # AIPerf rebuilds the system/tool prefix from the first prompt's hash blocks:
        # rounding must not leave it longer than they are.
        first = next((r for r in out["requests"] if "hash_ids" in r), None)
        if first is not None and "tool_tokens" in out:
            room = block * len(first["hash_ids"]) - out.get("system_tokens", 0)
            out["tool_tokens"] = max(0, min(out["tool_tokens"], room))
    for key in ("t", "api_time", "think_time", "duration_ms", "ttft"):
        if isinstance(out.get(key), (int, float)):
            out[key] = out[key] / FACTOR
    if "in" in out:
        out["in"] = max(1, round(out["in"] / FACTOR))
        out["out"] = max(1, round(out["out"] / FACTOR))
        out["hash_ids"] = list(out.get("hash_ids", []))[: out["in"] // block]
    return out


def main(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.json")):
        data = json.loads(path.read_text())
        small = shrink(data, int(data.get("block_size", 64)))
        (dst / path.name).write_text(json.dumps(small, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
