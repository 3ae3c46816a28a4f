"""Capture the real Kineto fixture for the profiler tests on a GPU machine (torch only).

Runs a small decoder-ish model (4 layers: norm, qkv, attention, o_proj, norm, MLP) under
``torch.profiler`` and writes, to ``--out``:

- ``decoder4_kineto.json.gz``: the Chrome trace. Each decode step is a
  ``record_function("decode_step")``; each module runs inside a ``record_function``
  named with vLLM's layerwise NVTX text (a dict repr with a ``'Module'`` key) followed by
  an empty ``'Outputs'`` marker range, exactly as vLLM's hooks emit them; layer 2 also
  launches one op on a side stream. Then a CUDA graph of the whole forward (captured
  outside the profiler) is replayed twice inside ``record_function("graph_step")``.
- ``decoder4_truth.json``: the ground truth, measured apart from that trace: each layer
  is run alone under its own profiler session and its GPU kernels are counted from the
  profiler's Python event list (not from the JSON the tests parse), in launch order.

This file needs only torch and the standard library because the GPU machine has
neither polars nor agentload installed. ``--device cpu`` is a dry run of the code paths.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

HIDDEN = 256
HEADS = 4
LAYERS = 4
STEPS = 3
REPLAYS = 2


def marker(module: str, inputs: list[list[int]], output: bool = False) -> str:
    """vLLM's layerwise NVTX text: a Python dict repr (single quotes, not JSON)."""
    key = "Outputs" if output else "Inputs"
    return str({"Module": module, key: inputs})


class Layer(nn.Module):
    def __init__(self, index: int, side: torch.cuda.Stream | None) -> None:
        super().__init__()
        self.index = index
        self.side = side
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def _scope(self, name: str, x: torch.Tensor) -> record_function:
        return record_function(marker(f"model.layers.{self.index}.{name}", [list(x.shape)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = f"model.layers.{self.index}"
        with record_function(marker(path, [list(x.shape)])):
            with self._scope("self_attn", x):
                h = self.norm1(x)
                q, k, v = self.qkv(h).view(x.shape[0], x.shape[1], 3, HEADS, -1).unbind(2)
                a = torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
                x = x + self.o_proj(a.transpose(1, 2).reshape(x.shape))
            with record_function(marker(f"{path}.self_attn", [list(x.shape)], output=True)):
                pass
            if self.side is not None and self.index == 2:
                # One op on a side stream, still launched inside this layer's range.
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    y = x * 0.5
                torch.cuda.current_stream().wait_stream(self.side)
                x = x + y
            with self._scope("mlp", x):
                x = x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))
            with record_function(marker(f"{path}.mlp", [list(x.shape)], output=True)):
                pass
        with record_function(marker(path, [list(x.shape)], output=True)):
            pass
        return x


class Model(nn.Module):
    def __init__(self, side: torch.cuda.Stream | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i, side) for i in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def activities(device: str) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def gpu_kernels(prof: profile) -> list[str]:
    """Kernel names in GPU start order, from the profiler's own event list."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA]
    # start_ns() is the newer spelling; older builds only have start_us().
    events.sort(key=lambda e: e.start_ns() if hasattr(e, "start_ns") else e.start_us())
    return [e.name() for e in events]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    device: str = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    side = torch.cuda.Stream() if device == "cuda" else None
    model = Model(side).to(device).eval()
    x = torch.randn(1, 8, HIDDEN, device=device)
    started = time.perf_counter()
    with torch.inference_mode():
        for _ in range(3):  # warm up cuBLAS handles and workspaces outside the profiler
            model(x)
        sync(device)

        truth_layers: dict[str, dict[str, object]] = {}
        for i, layer in enumerate(model.layers):
            with profile(activities=activities(device)) as prof:
                layer(x)
                sync(device)
            names = gpu_kernels(prof)
            memops = sum(n.startswith(("Memcpy", "Memset")) for n in names)
            truth_layers[f"model.layers.{i}"] = {"kernels_per_instance": len(names) - memops,
                                                 "memops_per_instance": memops,
                                                 "kernel_names": names}
        with profile(activities=activities(device)) as prof:
            model(x)
            sync(device)
        forward_kernels = len(gpu_kernels(prof))

        graph = None
        if device == "cuda":
            static_x = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(static_x)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = model(static_x)
            sync(device)

        tmp = Path(tempfile.mkdtemp())
        trace = tmp / "trace.json"
        with profile(activities=activities(device)) as prof:
            for _ in range(STEPS):
                with record_function("decode_step"):
                    x = model(x) * 0.01
            sync(device)
            if graph is not None:
                with record_function("graph_step"):
                    for _ in range(REPLAYS):
                        graph.replay()
                sync(device)
                del static_y
        prof.export_chrome_trace(str(trace))
        traced_kernels = len(gpu_kernels(prof))

    target = args.out / "decoder4_kineto.json.gz"
    with open(trace, "rb") as src, gzip.open(target, "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    truth = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "steps": STEPS,
        "layers": truth_layers,
        "forward_kernels": forward_kernels,
        "graph_replays": REPLAYS if graph is not None else 0,
        "graph_kernels_per_replay": forward_kernels if graph is not None else 0,
        "traced_kernels": traced_kernels,
        "capture_s": round(time.perf_counter() - started, 2),
    }
    (args.out / "decoder4_truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    print(json.dumps({k: v for k, v in truth.items() if k != "layers"}))
    for name, info in truth_layers.items():
        print(name, info["kernels_per_instance"])
    print("trace bytes (gz):", target.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
