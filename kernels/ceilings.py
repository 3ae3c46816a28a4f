"""The GPU's measured ceilings: device-to-device copy bandwidth and the bf16 matrix rate.

Both are timed with CUDA events after a warm-up, as the median of many runs, rotating
over buffers whose total is several times the L2 (so the copy measures HBM, not cache),
on random data (zeros run faster). Copy bandwidth counts bytes read plus bytes written.
The result is a JSON file, by default ``~/.cache/agentload/ceilings-<gpu>.json``, which
``agentload bench kernels`` reads to express achieved GB/s as a share of the ceiling.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentload.kernels.errors import KernelsError


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Measured ceilings of one GPU (GB/s are 1e9 bytes per second)."""

    gpu: str
    copy_gbps: float
    copy_bytes: int
    bf16_tflops: float
    matmul_n: int
    l2_bytes: int
    sms: int
    torch: str
    measured_at: str
    method: str = ("CUDA events, warm-up, median; copy: dst.copy_(src) over rotating buffers "
                   "totalling > 4x L2, bytes = read + written; matmul: n^3 bf16 on random "
                   "data, 2 n^3 FLOP")


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_path(gpu: str) -> Path:
    env = os.environ.get("AGENTLOAD_CEILINGS")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "agentload" / f"ceilings-{gpu_slug(gpu)}.json"


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise KernelsError("measuring ceilings needs torch with CUDA (pip install "
                           "'agentload[gpu]')") from exc
    if not torch.cuda.is_available():
        raise KernelsError("no CUDA GPU visible: ceilings are measured on the GPU")
    return torch


def _median_ms(fn: Any, warmup: int, reps: int) -> float:
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times))


def measure(*, copy_mib: int = 1024, matmul_n: int = 8192, reps: int = 30) -> Ceilings:
    """Measure both ceilings on the current GPU (about 10 s)."""
    torch = _torch()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    n_el = copy_mib * 2 ** 20 // 2
    sets = max(2, -(-4 * l2 // (n_el * 2)) if l2 else 2)
    srcs = [torch.randn(n_el, device="cuda", dtype=torch.float32).to(torch.bfloat16)
            for _ in range(sets)]
    dsts = [torch.empty_like(s) for s in srcs]
    state = {"i": 0}

    def copy() -> None:
        i = state["i"] = (state["i"] + 1) % sets
        dsts[i].copy_(srcs[i])

    ms = _median_ms(copy, 5, reps)
    copy_gbps = 2 * n_el * 2 / (ms * 1e-3) / 1e9
    srcs.clear()
    dsts.clear()
    mats = [(torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16),
             torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16))
            for _ in range(3)]
    out = torch.empty(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)

    def mm() -> None:
        i = state["i"] = (state["i"] + 1) % 3
        torch.matmul(*mats[i], out=out)

    ms_mm = _median_ms(mm, 5, reps)
    tflops = 2 * matmul_n ** 3 / (ms_mm * 1e-3) / 1e12
    return Ceilings(gpu=props.name, copy_gbps=round(copy_gbps, 1), copy_bytes=2 * n_el * 2,
                    bf16_tflops=round(tflops, 1), matmul_n=matmul_n, l2_bytes=l2,
                    sms=props.multi_processor_count, torch=str(torch.__version__),
                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def save(c: Ceilings, path: Path | None = None) -> Path:
    p = path or default_path(c.gpu)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(asdict(c), indent=2) + "\n")
    return p


def load(gpu: str, path: Path | None = None) -> Ceilings | None:
    """The saved ceilings for ``gpu`` (None when none were measured yet)."""
    p = path or default_path(gpu)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        return Ceilings(**data)
    except (ValueError, TypeError) as exc:
        raise KernelsError(f"{p}: not a ceilings file ({exc})") from exc


def load_or_measure(path: Path | None = None) -> Ceilings:
    torch = _torch()
    name = torch.cuda.get_device_properties(0).name
    c = load(name, path)
    if c is None:
        c = measure()
        save(c, path)
    return c
