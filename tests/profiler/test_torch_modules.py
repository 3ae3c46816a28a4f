"""PyTorch-profiler module ranges (``nn.Module: <Class>_<k>``) as layers.

vLLM's torch profiler runs with ``with_stack=True``; in eager mode the only layer
structure its Kineto trace holds is the Python tracer's module forwards, one
``python_function`` event per module call. A decoder-layer class's instance count is
the layer index; other Python frames are not ranges.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from agentload.profiler import attribute, load_profile, summarize


def _trace(path: Path, layers: int = 3, steps: int = 2) -> Path:
    events: list[dict[str, object]] = []
    t, corr = 1000.0, 1

    def x(cat: str, name: str, ts: float, dur: float, **kw: object) -> None:
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw})

    for _ in range(steps):
        x("python_function", "nn.Module: TinyForCausalLM_0", t, 10 * layers + 5,
          pid=7, tid=7)
        x("python_function", "vllm/model_executor/models/tiny.py(12): forward", t, 1,
          pid=7, tid=7)
        for i in range(layers):
            start = t + 1 + 10 * i
            x("python_function", f"nn.Module: TinyDecoderLayer_{i}", start, 9, pid=7, tid=7)
            x("python_function", f"nn.Module: Linear_{2 * i}", start + 1, 3, pid=7, tid=7)
            for k, kernel in enumerate(("gemv_kernel", "rmsnorm_kernel")):
                launch = start + 1 + 3 * k
                x("cuda_runtime", "cudaLaunchKernel", launch, 1, pid=7, tid=7,
                  args={"correlation": corr})
                x("kernel", kernel, launch + 50, 2, pid=0, tid=7,
                  args={"correlation": corr, "device": 0, "stream": 7})
                corr += 1
        t += 100
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return path


def test_decoder_layer_classes_are_layers(tmp_path: Path) -> None:
    s = summarize(attribute(load_profile(_trace(tmp_path / "t.json.gz"))), level="layer")
    rows = {r["name"]: r for r in s.layers.iter_rows(named=True)}
    for i in range(3):
        row = rows[f"nn.Module: TinyDecoderLayer_{i}"]
        assert (row["instances"], row["kernels"]) == (2, 4)
    assert not any("tiny.py" in name for name in rows)  # plain Python frames are not ranges
