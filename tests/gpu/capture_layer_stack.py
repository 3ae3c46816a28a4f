"""A decode loop for ``agentload profile capture`` on a GPU machine (torch + agentload only).

Runs a stack of the kernels room's scaled-down MoE decoder layers on the ``standard``
(eager torch) path for a few decode steps, each step in ``record_function("decode_step")``
and each layer in its own ``layer<i>.standard`` range (NVTX and ``record_function``).

    python -m agentload.profiler.torch_run --out cap.json.gz -- capture_layer_stack.py
    agentload profile layers cap.json.gz        # kernels per layer, from the trace

``--count OUT.json`` instead profiles each layer once on its own and writes the number of
GPU kernels it launched, counted from torch's own event list (not from a JSON trace): the
ground truth the trace's per-layer table must match. Needs no polars, so it runs on a
machine with torch alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from agentload.kernels.layer import MoELayer
from agentload.kernels.presets import LayerConfig


def build(depth: int, device: str) -> list[MoELayer]:
    cfg = LayerConfig()
    return [MoELayer(cfg, device, seed=10 + i, index=i) for i in range(depth)]


def step(layers: list[MoELayer], x: torch.Tensor, r: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    for lay in layers:
        x, r = lay.standard(x, r)
    return x, r


def count_kernels(layers: list[MoELayer], x: torch.Tensor, r: torch.Tensor) -> dict[str, int]:
    """GPU kernels each layer launches when profiled alone (torch's event list)."""
    counts: dict[str, int] = {}
    for lay in layers:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            lay.standard(x, r)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        counts[f"layer{lay.index}.standard"] = len(kernels)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--count", type=Path, help="write per-layer kernel counts here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("capture_layer_stack: needs a CUDA GPU", file=sys.stderr)
        return 2
    layers = build(args.depth, "cuda")
    x, r = layers[0].inputs(args.batch)
    step(layers, x, r)  # warm-up: cuBLAS handles and workspaces outside the measured steps
    torch.cuda.synchronize()
    if args.count:
        args.count.write_text(json.dumps({"batch": args.batch,
                                          "kernels": count_kernels(layers, x, r)}))
        return 0
    for _ in range(args.steps):
        with record_function("decode_step"):
            x, r = step(layers, x, r)
    torch.cuda.synchronize()
    print(f"capture_layer_stack: {args.steps} steps x {args.depth} layers, batch {args.batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
