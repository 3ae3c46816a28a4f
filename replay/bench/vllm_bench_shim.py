"""``vllm bench serve`` with its dataset replaced by the prompts in
``$AGENTLOAD_AGREE_PROMPTS`` (token-id lists): its request function sends a list prompt as
token ids, unchanged. ``bench agree`` runs it as ``python -P vllm_bench_shim.py ARGS`` in
vLLM's Python, so it imports nothing of agentload. ``$AGENTLOAD_AGREE_STAT`` receives the
host's ``/proc/stat`` first line before and after the benchmark alone (read by
``hostload.host_ticks``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def main(argv: list[str]) -> None:
    import vllm.benchmarks.serve as serve
    from vllm.benchmarks.datasets import SampleRequest

    with open(os.environ["AGENTLOAD_AGREE_PROMPTS"]) as fh:
        spec = json.load(fh)

    def get_samples(args: Any, tokenizer: Any, **_: Any) -> list[Any]:
        return [SampleRequest(prompt=ids, prompt_len=len(ids),
                              expected_output_len=spec["output_len"], request_id=f"agree{i}")
                for i, ids in enumerate(spec["prompts"])]

    run = serve.benchmark
    stat = os.path.exists("/proc/stat") and os.environ.get("AGENTLOAD_AGREE_STAT")

    async def benchmark(*a: Any, **k: Any) -> Any:
        # The host's CPU ticks around the benchmark alone, not vLLM's import.
        t0 = ""
        if stat:
            with open("/proc/stat") as fh:
                t0 = fh.readline()
        try:
            return await run(*a, **k)
        finally:
            if stat:
                with open("/proc/stat") as fh, open(stat, "w") as out:
                    out.write(t0 + fh.readline())

    serve.get_samples = get_samples  # type: ignore[attr-defined]
    serve.benchmark = benchmark
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)  # type: ignore[arg-type]  # a plain parser does
    serve.main(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
