"""``agentload bench kernels``: per-op and per-layer timings against the measured ceilings.

Per op (add+RMSNorm, GEMV, SiLU-and-mul, router, the fused o-proj chain), at batch 1, 8
and 64: µs per call, achieved GB/s (the fewest bytes the op must move) and its share of
the measured copy ceiling, the kernel count, and the same for the torch version. Per
layer (the scaled-down MoE layer of ``layer.py``): standard eager, standard under a CUDA
graph, fused eager, fused under a CUDA graph and torch.compile, against the layer's
weight-streaming speed of light. Every kernel result is checked against its float64
reference (outputs poisoned with NaN first) before it is timed. GEMV and add+RMSNorm time
every tile variant and report the best (all variants go to the JSON); add+RMSNorm at
hidden 7168 is also set against its floor: an empty kernel and a same-size ``copy_``.

Timing (METHOD.md): a CUDA graph of one call per rotating buffer set (sets together
> 4x L2), replayed after warm-up; the median replay over the calls in it is the per-call
time. Layers are timed as a stack of ``layers`` distinct layers (no weight reuse in L2)
divided by the stack depth. Finally one step of each path is captured with
``torch.profiler``; the Kineto trace is saved and its per-layer table printed (kernels
and GPU µs inside each ``layer<i>.<path>`` range).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from agentload.kernels import ceilings as ceil_mod
from agentload.kernels import ops, reference
from agentload.kernels.layer import KVState, MoELayer
from agentload.kernels.presets import (
    ATTN_MMA_LAYER,
    BATCHES,
    CONTEXTS,
    GEMV_ROWS,
    GEMV_SHAPES,
    NORM_HIDDEN,
    SILU_INTER,
    LayerConfig,
    gemv_variants,
    norm_variants,
)
from agentload.kernels.specs import GEMV_MAX_ROWS

_BF16 = torch.bfloat16
Fn = Callable[[], Any]


# -- timing ---------------------------------------------------------------------------------
def graph_us(calls: Sequence[Fn], *, reps: int = 15, min_calls: int = 20) -> float:
    """Median µs per call of ``calls`` captured in one CUDA graph and replayed."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    seq = list(calls) * max(1, -(-min_calls // len(calls)))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in seq[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for c in seq:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times)) * 1e3 / len(seq)


def eager_us(fn: Fn, *, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(statistics.median(times)) * 1e3


def kernel_times(fn: Fn) -> list[tuple[str, float]]:
    """``(name, µs)`` of each CUDA kernel one call of ``fn`` launches, in launch order
    (torch.profiler / CUPTI, Kineto trace; eager launches, so each kernel runs alone)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(str(e.get("name", "?")), float(e.get("dur", 0.0))) for e in kernels]


def kernel_count(fn: Fn) -> int:
    """CUDA kernels one call of ``fn`` launches."""
    return len(kernel_times(fn))


def _short_kernel(name: str) -> str:
    """A kernel's name without its template arguments and CuTe DSL's mangling."""
    for tag in ("DecodeAttentionMma", "DecodeAttentionMla", "DecodeAttention",
                "AttentionCombine"):
        if tag in name:
            return tag
    return name.split("<")[0].split("(")[0][:40]


def copy_same_bytes_us(nbytes: int, l2: int) -> float:
    """Graph µs of a torch copy moving ``nbytes`` (half read, half written), cycling
    buffers past L2: what the copy ceiling gives at this size, launch and ramp included."""
    half = max(1, nbytes // 4)  # bf16 elements per side
    src = [torch.randn(half, device="cuda").to(_BF16) for _ in range(_sets(nbytes, l2))]
    dst = [torch.empty_like(x) for x in src]
    return graph_us([partial(d.copy_, x) for d, x in zip(dst, src, strict=True)])


def pct_of_copy(nbytes: int, us: float, copy_gbps: float) -> float:
    """``nbytes`` moved in ``us`` as a percentage of the copy ceiling."""
    return nbytes / (us * 1e-6) / 1e9 / copy_gbps * 100


def _sets(bytes_per_call: int, l2: int) -> int:
    return int(min(64, max(2, -(-4 * l2 // max(1, bytes_per_call)))))


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype = _BF16) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


# -- results --------------------------------------------------------------------------------
class Report:
    """Rows printed as they come and kept for the JSON file."""

    def __init__(self, ceil: ceil_mod.Ceilings, out: Path | None) -> None:
        self.ceil, self.out = ceil, out
        self.ops: list[dict[str, Any]] = []
        self.layers: list[dict[str, Any]] = []
        self.trace: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.variants: list[dict[str, Any]] = []
        self.floors: list[dict[str, Any]] = []

    def check(self, name: str, err: float, tol: float) -> bool:
        ok = err <= tol
        self.checks.append({"name": name, "rel_err": err, "tol": tol, "ok": ok})
        if not ok:
            print(f"  CHECK FAILED {name}: rel err {err:.3g} > {tol:g}", flush=True)
        return ok

    def op(self, name: str, batch: int, nbytes: int, ours: float | None, torch_us: float,
           k_ours: int | None, k_torch: int, note: str = "") -> None:
        gb = self.ceil.copy_gbps

        def pct(us: float | None) -> float | None:
            return None if us is None else pct_of_copy(nbytes, us, gb)

        row = {"op": name, "batch": batch, "bytes": nbytes, "ours_us": ours,
               "torch_us": torch_us, "ours_pct_copy": pct(ours), "torch_pct_copy": pct(torch_us),
               "ours_kernels": k_ours, "torch_kernels": k_torch, "note": note}
        self.ops.append(row)
        o = "   -   " if ours is None else f"{ours:7.1f}"
        po = "  -  " if ours is None else f"{pct(ours):5.1f}"
        print(f"{name:<28}{batch:>4} {nbytes / 1e6:9.2f} {o} {po}% {k_ours or '-':>3}  "
              f"{torch_us:7.1f} {pct(torch_us):5.1f}% {k_torch:>3}  {note}", flush=True)
        self.save()

    def save(self) -> None:
        if self.out is None:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({
            "ceilings": {"gpu": self.ceil.gpu, "copy_gbps": self.ceil.copy_gbps,
                         "bf16_tflops": self.ceil.bf16_tflops},
            "ops": self.ops, "layers": self.layers, "trace": self.trace,
            "checks": self.checks, "gemv_variants": self.variants, "floors": self.floors},
            indent=1, default=str))


# -- per-op ---------------------------------------------------------------------------------
def bench_norm(rep: Report, hidden: int, batch: int) -> None:
    l2 = rep.ceil.l2_bytes
    nbytes = 4 * batch * hidden * 2 + hidden * 2
    sets = _sets(nbytes, l2)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(_BF16)
    xs = [torch.randn(batch, hidden, device="cuda").to(_BF16) for _ in range(sets)]
    rs = [torch.randn(batch, hidden, device="cuda").to(_BF16) for _ in range(sets)]
    outs = [_poisoned((batch, hidden)) for _ in range(sets)]
    ros = [_poisoned((batch, hidden)) for _ in range(sets)]
    ref_o, ref_h = reference.add_rmsnorm(xs[0], rs[0], w)
    best: tuple[float, str] | None = None
    for spec in norm_variants(hidden):
        c = int(spec.get("c", 1))
        tag = f"t{spec.get('t')} cluster {c}"
        outs[0].fill_(float("nan"))
        ros[0].fill_(float("nan"))
        try:
            ops.add_rmsnorm(xs[0], rs[0], w, out=outs[0], residual_out=ros[0], cluster=c)
        except Exception as exc:  # a variant missing from the AOT cache: skip, say so
            print(f"  skip {spec.key()}: {str(exc)[:120]}", flush=True)
            continue
        rep.check(f"add_rmsnorm h{hidden} b{batch} {tag} out",
                  reference.rel_err(outs[0], ref_o), reference.BF16_TOL)
        rep.check(f"add_rmsnorm h{hidden} b{batch} {tag} h",
                  reference.rel_err(ros[0], ref_h), reference.BF16_TOL)

        def ours_norm(i: int, cc: int) -> Any:
            return ops.add_rmsnorm(xs[i], rs[i], w, out=outs[i], residual_out=ros[i],
                                   cluster=cc)

        us = graph_us([partial(ours_norm, i, c) for i in range(sets)])
        rep.variants.append({"op": f"add+rmsnorm h{hidden}", "rows": batch, "variant": tag,
                             "us": us})
        if best is None or us < best[0]:
            best = (us, tag)
    assert best is not None, f"no add+rmsnorm variant for hidden {hidden} could run"

    def torch_norm(i: int) -> Any:
        h = xs[i] + rs[i]
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(_BF16)

    tt = graph_us([partial(torch_norm, i) for i in range(sets)])
    kt = kernel_count(partial(torch_norm, 0))
    rep.op(f"add+rmsnorm h{hidden}", batch, nbytes, best[0], tt, 1, kt, note=f"best {best[1]}")


def bench_floor(rep: Report, hidden: int, batch: int) -> None:
    """The physical floor for an op of add+RMSNorm's size, timed exactly like the op.

    Under the same CUDA-graph replay and rotating buffers: an empty kernel
    (``torch.cuda._sleep(0)``: a launch that does nothing) and a torch ``copy_`` moving the
    op's byte count (half read, half written). The op's share of both is printed.
    """
    nbytes = 4 * batch * hidden * 2 + hidden * 2
    half = nbytes // 2 // 2  # bf16 elements read (= written) by the copy
    sets = _sets(nbytes, rep.ceil.l2_bytes)
    srcs = [torch.randn(half, device="cuda").to(_BF16) for _ in range(sets)]
    dsts = [torch.empty(half, dtype=_BF16, device="cuda") for _ in range(sets)]

    def copy(i: int) -> Any:
        return dsts[i].copy_(srcs[i])

    def empty() -> None:
        torch.cuda._sleep(0)  # type: ignore[no-untyped-call]

    copy_us = graph_us([partial(copy, i) for i in range(sets)])
    empty_us = graph_us([empty] * sets)
    op = next((r for r in reversed(rep.ops) if r["op"] == f"add+rmsnorm h{hidden}"
               and r["batch"] == batch), None)
    ours: float | None = None if op is None else op["ours_us"]
    gb = rep.ceil.copy_gbps
    row: dict[str, Any] = {
           "hidden": hidden, "batch": batch, "bytes": 2 * half * 2, "copy_us": copy_us,
           "copy_pct_ceiling": pct_of_copy(2 * half * 2, copy_us, gb),
           "empty_kernel_us": empty_us, "ours_us": ours,
           "ours_pct_of_same_size_copy": None if ours is None else copy_us / ours * 100,
           "ours_pct_ceiling": None if ours is None else pct_of_copy(nbytes, ours, gb)}
    rep.floors.append(row)
    print(f"floor h{hidden} b{batch}: empty kernel {empty_us:.2f} µs; copy_ of "
          f"{row['bytes'] / 1e6:.2f} MB {copy_us:.2f} µs ({row['copy_pct_ceiling']:.1f} % of the "
          f"ceiling); ours {ours if ours is None else round(ours, 2)} µs = "
          f"{row['ours_pct_ceiling'] or 0:.1f} % of the ceiling, "
          f"{row['ours_pct_of_same_size_copy'] or 0:.1f} % of the same-size copy", flush=True)
    rep.save()


def bench_silu(rep: Report, inter: int, batch: int) -> None:
    nbytes = batch * inter * 2 * 3
    sets = _sets(nbytes, rep.ceil.l2_bytes)
    xs = [torch.randn(batch, 2 * inter, device="cuda").to(_BF16) for _ in range(sets)]
    outs = [_poisoned((batch, inter)) for _ in range(sets)]
    ops.silu_mul(xs[0], out=outs[0])
    rep.check(f"silu_mul i{inter} b{batch}", reference.rel_err(outs[0], reference.silu_mul(xs[0])),
              reference.BF16_TOL)
    def ours_silu(i: int) -> Any:
        return ops.silu_mul(xs[i], out=outs[i])

    ours = graph_us([partial(ours_silu, i) for i in range(sets)])

    def torch_silu(i: int) -> Any:
        return torch.nn.functional.silu(xs[i][:, :inter]) * xs[i][:, inter:]

    tt = graph_us([partial(torch_silu, i) for i in range(sets)])
    rep.op(f"silu_mul i{inter}", batch, nbytes, ours, tt, 1, kernel_count(partial(torch_silu, 0)))


def bench_gemv(rep: Report, name: str, k: int, n: int, rows: int) -> None:
    nbytes = n * k * 2 + rows * (k + n) * 2
    sets = _sets(nbytes, rep.ceil.l2_bytes)
    ws = [(torch.randn(n, k, device="cuda") * k ** -0.5).to(_BF16) for _ in range(sets)]
    xs = [torch.randn(rows, k, device="cuda").to(_BF16) for _ in range(sets)]
    ys = [_poisoned((rows, n)) for _ in range(sets)]
    ref = reference.gemv(xs[0], ws[0])
    best: tuple[float, str] | None = None
    for spec in gemv_variants(k, n, rows):
        opb, t = int(spec.get("opb")), int(spec.get("t"))
        mma = bool(spec.get("mma", False))
        tag = f"t{t} opb{opb}" + (" mma" if mma else "")
        ys[0].fill_(float("nan"))
        try:
            ops.gemv(xs[0], ws[0], out=ys[0], opb=opb, threads=t, mma=mma)
        except Exception as exc:  # a variant missing from the AOT cache: skip, say so
            print(f"  skip {spec.key()}: {str(exc)[:120]}", flush=True)
            continue
        rep.check(f"gemv {k}x{n} m{rows} {tag}", reference.rel_err(ys[0], ref),
                  reference.BF16_TOL)
        def ours_gemv(i: int, o: int, tt: int, mm: bool) -> Any:
            return ops.gemv(xs[i], ws[i], out=ys[i], opb=o, threads=tt, mma=mm)

        us = graph_us([partial(ours_gemv, i, opb, t, mma) for i in range(sets)])
        rep.variants.append({"op": name, "rows": rows, "variant": tag, "us": us})
        if best is None or us < best[0]:
            best = (us, tag)
    def cublas_gemv(i: int) -> Any:
        return torch.matmul(xs[i], ws[i].T, out=ys[i])

    cublas = graph_us([partial(cublas_gemv, i) for i in range(sets)])
    rep.op(name, rows, nbytes, None if best is None else best[0], cublas,
           None if best is None else 1, kernel_count(partial(cublas_gemv, 0)),
           note="" if best is None else f"best {best[1]}; torch = cuBLAS")


def bench_router(rep: Report, cfg: LayerConfig, batch: int) -> None:
    h, e = cfg.hidden, cfg.experts
    x = torch.randn(batch, h, device="cuda").to(_BF16)
    wr = (torch.randn(e, h, device="cuda") * h ** -0.5).to(_BF16)
    bias = 0.1 * torch.randn(e, device="cuda")
    s = cfg.slots
    lg, ii, ww = (_poisoned((batch, e), torch.float32),
                  torch.full((batch, s), -1, dtype=torch.int32, device="cuda"),
                  _poisoned((batch, s), torch.float32))
    def ours() -> Any:
        return ops.moe_router(x, wr, bias, logits=lg, ids=ii, weights=ww, topk=cfg.topk,
                              groups=cfg.groups, topk_group=cfg.topk_group,
                              scale=cfg.routed_scale, shared=True)

    ours()
    ref_lg, _, _ = reference.router(x, wr, bias, cfg.topk, cfg.groups, cfg.topk_group,
                                    cfg.routed_scale)
    rep.check(f"router b{batch} logits", reference.rel_err(lg, ref_lg), reference.F32_TOL)
    ids_k, w_k = reference.router_select(lg, bias, cfg.topk, cfg.groups, cfg.topk_group,
                                         cfg.routed_scale)
    same = bool((ii[:, :cfg.topk].long().sort(1).values == ids_k.sort(1).values).all())
    rep.check(f"router b{batch} ids (on its own logits)", 0.0 if same else 1.0, 0.0)
    order = ii[:, :cfg.topk].long().argsort(1)
    kw_sorted = ww[:, :cfg.topk].gather(1, order)
    ref_sorted = w_k.gather(1, ids_k.argsort(1))
    rep.check(f"router b{batch} weights", reference.rel_err(kw_sorted, ref_sorted),
              reference.F32_TOL)
    layer = MoELayer.__new__(MoELayer)
    layer.cfg, layer.bias = cfg, bias

    def torch_router() -> Any:
        return layer._select_torch((x @ wr.T).float())

    nbytes = e * h * 2 + batch * h * 2
    rep.op("router (logits+grouped topk)", batch, nbytes, graph_us([ours]),
           graph_us([torch_router]), 1, kernel_count(torch_router))


def bench_oproj(rep: Report, cfg: LayerConfig, batch: int) -> None:
    h = cfg.hidden
    sets = _sets(h * h * 2, rep.ceil.l2_bytes)
    wos = [(torch.randn(h, h, device="cuda") * h ** -0.5).to(_BF16) for _ in range(sets)]
    nw = (1 + 0.1 * torch.randn(h, device="cuda")).to(_BF16)
    v = torch.randn(batch, h, device="cuda").to(_BF16)
    res = torch.randn(batch, h, device="cuda").to(_BF16)
    hs = [_poisoned((batch, h)) for _ in range(sets)]
    ns = [_poisoned((batch, h)) for _ in range(sets)]
    ops.oproj_residual_rmsnorm(v, wos[0], res, nw, h_out=hs[0], normed_out=ns[0])
    ref_n, ref_h = reference.add_rmsnorm(reference.gemv(v, wos[0]), res, nw)
    rep.check(f"oproj+res+rmsnorm b{batch} h", reference.rel_err(hs[0], ref_h),
              reference.BF16_TOL)
    rep.check(f"oproj+res+rmsnorm b{batch} normed", reference.rel_err(ns[0], ref_n),
              reference.BF16_TOL)
    # Re-armed scratch: a second call must give the same answer.
    ns[0].fill_(float("nan"))
    ops.oproj_residual_rmsnorm(v, wos[0], res, nw, h_out=hs[0], normed_out=ns[0])
    rep.check(f"oproj+res+rmsnorm b{batch} second call", reference.rel_err(ns[0], ref_n),
              reference.BF16_TOL)
    def ours_chain(i: int) -> Any:
        return ops.oproj_residual_rmsnorm(v, wos[i], res, nw, h_out=hs[i], normed_out=ns[i])

    ours = graph_us([partial(ours_chain, i) for i in range(sets)])

    def torch_chain(i: int) -> Any:
        hh = res + v @ wos[i].T
        return hh, MoELayer_rms(hh, nw)

    tt = graph_us([partial(torch_chain, i) for i in range(sets)])
    nbytes = h * h * 2 + batch * h * 2 * 4
    rep.op("oproj+residual+rmsnorm", batch, nbytes, ours, tt, 1,
           kernel_count(partial(torch_chain, 0)))


def bench_experts(rep: Report, cfg: LayerConfig, batch: int) -> None:
    """The MoE experts of one step (gate/up + SiLU, down; routed + shared) on router-like
    ids: ours grouped by expert (``expert_gemm``; the per-row ``grouped_gemv`` as a second
    row at <= 16 rows) against torch's gather-or-mask experts; bytes = experts touched."""
    from agentload.kernels.layer import experts_torch

    h, i, s, e = cfg.hidden, cfg.inter, cfg.slots, cfg.experts + 1
    g = torch.Generator().manual_seed(batch)
    rows = [[*torch.randperm(cfg.experts, generator=g)[:cfg.topk].tolist(), cfg.experts]
            for _ in range(batch)]
    ids = torch.tensor(rows, dtype=torch.int32, device="cuda")
    wts = torch.rand(batch, s, device="cuda")
    flat_ids, flat_w, ids_long = ids.view(-1), wts.view(-1), ids.long()
    x = torch.randn(batch, h, device="cuda").to(_BF16)
    wgu = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).to(_BF16)
    wd = (torch.randn(e, h, i, device="cuda") * i ** -0.5).to(_BF16)
    act, y = _poisoned((batch * s, i)), _poisoned((batch * s, h))
    distinct = len(set(ids.reshape(-1).tolist()))
    nbytes = distinct * 3 * h * i * 2 + batch * h * 2 * (1 + s)
    want = experts_torch(cfg, wgu, wd, x, ids_long, wts).float().sum(1)

    def ours(pt: int = 0) -> Any:
        ops.expert_gemm(x, wgu, flat_ids, flat_w, silu=True, div=s, tokens=batch, slots=s,
                        out=act, pass_tiles=pt)
        return ops.expert_gemm(act, wd, flat_ids, flat_w, silu=False, div=1, tokens=batch,
                               slots=s, out=y, pass_tiles=pt)

    def per_row() -> Any:
        ops.grouped_gemv(x, wgu, flat_ids, flat_w, silu=True, div=s, out=act)
        return ops.grouped_gemv(act, wd, flat_ids, flat_w, silu=False, div=1, out=y)

    def torch_experts() -> Any:
        return experts_torch(cfg, wgu, wd, x, ids_long, wts)

    tt = graph_us([torch_experts])
    kt = kernel_count(torch_experts)
    runs: list[tuple[str, Fn]] = [("experts (grouped, mma)", ours)] if batch >= 2 else []
    if batch > GEMV_MAX_ROWS:  # fewer tiles per pass: more loads in flight, L2 re-reads
        runs += [(f"experts (grouped, {pt} tile/pass)", partial(ours, pt)) for pt in (1, 2)]
    if batch <= GEMV_MAX_ROWS:
        runs.append(("experts (per-row gemv)", per_row))
    for name, fn in runs:
        try:
            fn()
        except Exception as exc:  # a variant missing from the AOT cache: skip, say so
            print(f"  skip {name} b{batch}: {str(exc)[:120]}", flush=True)
            continue
        got = y.view(batch, s, h).float().sum(1)
        rep.check(f"{name} b{batch}", reference.rel_err(got, want), reference.BF16_TOL)
        rep.op(name, batch, nbytes, graph_us([fn]), tt, 2, kt,
               note=f"{distinct - 1} routed experts + shared")


#: Decode attention cases: (batch, context); 16 query heads over 4 KV heads of 128, pages of 16.
ATTN_CASES = ((1, 4096), (1, 32768), (8, 4096), (8, 32768), (64, 4096), (64, 32768))
ATTN_HEADS = (16, 4, 128, 16)  # query heads, KV heads, head dim, page


def _best_tile(rep: Report, op: str, check: str, batch: int, tiles: Sequence[tuple[Any, ...]],
               tag: Callable[[tuple[Any, ...]], str], is_auto: Callable[[tuple[Any, ...]], bool],
               call: Callable[[int, tuple[Any, ...]], Any], want: torch.Tensor,
               outs: Sequence[torch.Tensor], sets: int
               ) -> tuple[float, tuple[Any, ...], str] | None:
    """Each tile checked against ``want`` (``call(0, tile)`` writes ``outs[0]``; the check
    is named ``check`` and the tile's tag) and timed
    over the rotating sets; every variant's time is kept. ``(µs, tile, tag)`` of the
    fastest, or None when no tile could run (one missing from the AOT cache is skipped
    and named)."""
    best: tuple[float, tuple[Any, ...], str] | None = None
    for tile in tiles:
        name = tag(tile)
        outs[0].fill_(float("nan"))
        try:
            call(0, tile)
        except Exception as exc:  # a variant missing from the AOT cache: skip, say so
            print(f"  skip {op} {name}: {str(exc)[:120]}", flush=True)
            continue
        if not rep.check(f"{check} {name}", reference.rel_err(outs[0], want),
                         reference.BF16_TOL):
            continue  # a wrong answer is never the fastest
        us = graph_us([partial(call, i, tile) for i in range(sets)])
        rep.variants.append({"op": op, "rows": batch,
                             "variant": name + (" (auto)" if is_auto(tile) else ""), "us": us})
        if best is None or us < best[0]:
            best = (us, tile, name)
    return best


def bench_attention(rep: Report, batch: int, ctx: int) -> None:
    """Decode attention over a paged cache (pages shuffled) against the KV bytes' copy
    time; torch = SDPA (GQA) over the same keys laid out contiguously, no paging."""
    from agentload.kernels.presets import (
        ATTN_ALL_HEADS,
        ATTN_DYNAMIC_FIXED,
        ATTN_HEADS_TILES,
        ATTN_LAYER_SPLITS,
        ATTN_MMA_TILES,
        ATTN_TILES,
    )
    from agentload.kernels.specs import (
        ATTN_CHUNKS,
        attention_chunk,
        dynamic_fill_ctas,
        mma_chunk_rules,
    )

    hq, hkv, d, page = ATTN_HEADS
    kv_bytes = batch * ctx * hkv * d * 2 * 2
    nbytes = kv_bytes + batch * hq * d * 2 * 2
    sets = _sets(nbytes, rep.ceil.l2_bytes)
    pages = batch * ctx // page
    gen = torch.Generator(device="cpu").manual_seed(batch * 7 + ctx)
    kc = [torch.randn(pages, page, hkv, d, device="cuda").to(_BF16) for _ in range(sets)]
    vc = [torch.randn(pages, page, hkv, d, device="cuda").to(_BF16) for _ in range(sets)]
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, -1).cuda()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, hq, d, device="cuda").to(_BF16) for _ in range(sets)]
    outs = [_poisoned((batch, hq, d)) for _ in range(sets)]
    want = reference.paged_decode_attention(qs[0], kc[0], vc[0], table, lens)
    auto = attention_chunk(batch, hkv, ctx, sms=rep.ceil.sms)
    # (chunk, threads, unroll, pipe, mma, stages, merge, KV heads a CTA, key lines,
    # dynamic CTAs a head or 0, quarters dealt out statically first): CUDA-core tiles,
    # tensor-core ones, those whose last CTA merges the chunks (split contexts only),
    # those whose CTA reads every KV head of its chunk (whole pages), those copying keys
    # in whole lines, and the dynamic split (CTAs taking tiles from a shared counter: no
    # chunk)
    tiles = [(c, t, u, p, False, 3, False, 1, False, 0, 0)
             for c, (t, u, p) in itertools.product(ATTN_CHUNKS, ATTN_TILES)]
    for kh, mma_tiles in ((1, ATTN_MMA_TILES), (ATTN_ALL_HEADS, ATTN_HEADS_TILES)):
        tiles += [(c, t, 4, False, True, st, mg, kh, kl, 0, 0)
                  for c, (t, st), mg, kl in itertools.product(ATTN_CHUNKS, mma_tiles,
                                                              (False, True), (False, True))
                  if c % mma_chunk_rules(d, hq // hkv, page, t, st, d, False, kv_heads=kh)[0]
                  == 0 and not (mg and c >= ctx)]
    # where the sequences alone fill the GPU, also the layer's finer splits (more chunks
    # than the GPU holds: the block scheduler balances the SMs' unequal bandwidth)
    over = batch * hkv >= rep.ceil.sms
    tiles = [tl for tl in tiles if tl[0] == auto
             or 64 <= batch * hkv // tl[7] * -(-ctx // tl[0]) <= 4 * rep.ceil.sms
             or (over and tl[4] and tl[7] == 1 and tl[8] and tl[0] in ATTN_LAYER_SPLITS)]
    for (t, st), kl in itertools.product(ATTN_MMA_TILES, (False, True)):
        if st == 2:  # as many CTAs a (sequence, KV head) as fill the GPU, and twice that
            per_sm = mma_chunk_rules(d, hq // hkv, page, t, st, d, False)[1]
            fill = dynamic_fill_ctas(batch, hkv, sms=rep.ceil.sms, ctas_per_sm=per_sm)
            tiles += [(0, t, 4, False, True, 2, False, 1, kl, n, 0) for n in (fill, 2 * fill)]
            if kl:  # its warps' first quarters dealt out statically, the rest counted
                tiles += [(0, t, 4, False, True, 2, False, 1, kl, fill, fx)
                          for fx in ATTN_DYNAMIC_FIXED]

    def tag(tl: tuple[Any, ...]) -> str:
        c, threads, unroll, pipe, mma, stages, merge, kh, kl, dyn, fixed = tl
        return ((f"dynamic {dyn} a head" + (f" {fixed}/4 own" if fixed else "")
                 if dyn else f"chunk {c}")
                + f" mma t{threads} s{stages}" + (" merge" if merge else "")
                + (f" {kh} heads a CTA" if kh > 1 else "")
                + (" lines" if kl else "") if mma
                else f"chunk {c} t{threads} u{unroll}" + (" pipe" if pipe else ""))

    def ours(i: int, tl: tuple[Any, ...], pdl: bool = False) -> Any:
        return ops.decode_attention(qs[i], kc[i], vc[i], table, lens, max_len=ctx,
                                    out=outs[i], chunk=tl[0] or None, threads=tl[1],
                                    unroll=tl[2], pipe=tl[3], mma=tl[4], stages=tl[5],
                                    merge=tl[6], kv_heads_per_cta=tl[7], lines=tl[8],
                                    dynamic=bool(tl[9]), dynamic_ctas=tl[9],
                                    dynamic_fixed=tl[10], pdl=pdl)

    best = _best_tile(rep, f"attention ctx{ctx}", f"attention b{batch} ctx{ctx}", batch,
                      tiles, tag, lambda tl: tl[0] == auto, ours, want, outs, sets)
    if best is not None and best[1][4] and best[1][0] < ctx and not best[1][6]:
        # the winner split over chunks, its combine a PDL dependent: launched while the
        # chunks run, it waits for their outputs on the GPU instead of behind the launch
        with_pdl = _best_tile(rep, f"attention ctx{ctx}", f"attention b{batch} ctx{ctx}",
                              batch, [best[1]], lambda tl: tag(tl) + " pdl",
                              lambda tl: False, partial(ours, pdl=True), want, outs, sets)
        if with_pdl is not None and with_pdl[0] < best[0]:
            best = with_pdl
    # torch's peer reads the same keys contiguously: [B, Hkv, ctx, D] (no paging to follow)
    order = table.long()
    kt = [k[order.view(-1)].view(batch, ctx, hkv, d).transpose(1, 2).contiguous()
          for k in kc[:2]]
    vt = [v[order.view(-1)].view(batch, ctx, hkv, d).transpose(1, 2).contiguous()
          for v in vc[:2]]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_attn(i: int) -> Any:
        return sdpa(qs[i].unsqueeze(2), kt[i], vt[i], enable_gqa=True)

    rep.check(f"attention b{batch} ctx{ctx} torch sdpa",
              reference.rel_err(torch_attn(0).squeeze(2), want), reference.BF16_TOL)
    torch_us = graph_us([partial(torch_attn, i) for i in range(2)])
    times = [] if best is None else kernel_times(partial(ours, 0, best[1],
                                                         pdl=best[2].endswith(" pdl")))
    k_ours = len(times) or None
    rep.op(f"attention ctx{ctx}", batch, nbytes, None if best is None else best[0], torch_us,
           k_ours, kernel_count(partial(torch_attn, 0)),
           note=("" if best is None else f"best {best[2]} (auto chunk {auto}); ")
           + "torch = SDPA, contiguous KV, 2 sets (L2-warm)")
    _kernel_detail(rep, times, nbytes)
    rep.save()  # a time limit mid-run keeps the cases done


def bench_attention_mla(rep: Report, batch: int, ctx: int) -> None:
    """MLA decode attention (latent 512 + rope 64, 16 heads, absorbed) over a paged latent
    cache against its bytes' copy time; torch = scores, softmax and output as batched
    matmuls over the same latent laid out contiguously (the key is latent + rope, the
    value the latent; SDPA would repeat the one KV head for all 16)."""
    from agentload.kernels.presets import MLA_SHAPE, MLA_SHARED_STAGES, MLA_TILES
    from agentload.kernels.specs import ATTN_CHUNKS, attention_chunk

    dk, h, page, dv = MLA_SHAPE
    scale = (128 + 64) ** -0.5  # DeepSeek-V3's unabsorbed head width
    nbytes = batch * ctx * dk * 2 + batch * h * (dk + dv) * 2
    sets = _sets(nbytes, rep.ceil.l2_bytes)
    pages = batch * ctx // page
    gen = torch.Generator(device="cpu").manual_seed(batch * 11 + ctx)
    kv = [torch.randn(pages, page, 1, dk, device="cuda").to(_BF16) for _ in range(sets)]
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(batch, -1).cuda()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, h, dk, device="cuda").to(_BF16) for _ in range(sets)]
    outs = [_poisoned((batch, h, dv)) for _ in range(sets)]
    want = reference.paged_decode_attention(qs[0], kv[0], kv[0][..., :dv], table, lens,
                                            scale=scale)
    # (chunk, threads, stages, shared): a CTA per 128 value columns, or one sharing tiles
    tiles = [(c, t, st, False) for c, (t, st) in itertools.product(ATTN_CHUNKS, MLA_TILES)]
    tiles += [(c, 32 * (dv // 128), st, True)
              for c, st in itertools.product(ATTN_CHUNKS, MLA_SHARED_STAGES)]

    def step_ctas(tl: tuple[Any, ...]) -> tuple[int, int]:  # tokens a step, CTAs a chunk
        return (16, 1) if tl[3] else (16 * (tl[1] // 32), dv // 128)

    def auto_chunk(tl: tuple[Any, ...]) -> int:
        step, ctas = step_ctas(tl)
        return attention_chunk(batch, ctas, ctx, sms=rep.ceil.sms, step=step)

    def wanted(tl: tuple[Any, ...]) -> bool:
        (step, ctas), c = step_ctas(tl), int(tl[0])
        return c % step == 0 and (c == auto_chunk(tl) or 64 <= batch * ctas * -(-ctx // c)
                                  <= 4 * rep.ceil.sms)

    def ours(i: int, tl: tuple[Any, ...]) -> Any:
        return ops.decode_attention_mla(qs[i], kv[i], table, lens, max_len=ctx, scale=scale,
                                        value_dim=dv, chunk=tl[0], threads=tl[1],
                                        stages=tl[2], shared=tl[3], out=outs[i])

    best = _best_tile(rep, f"mla ctx{ctx}", f"mla b{batch} ctx{ctx}", batch,
                      [tl for tl in tiles if wanted(tl)],
                      lambda tl: f"chunk {tl[0]} " + (f"shared s{tl[2]}" if tl[3]
                                                      else f"t{tl[1]} s{tl[2]}"),
                      lambda tl: tl[0] == auto_chunk(tl), ours, want, outs, sets)
    order = table.long().view(-1)
    lat = [k[order].view(batch, ctx, dk) for k in kv[:2]]

    def torch_mla(i: int) -> Any:  # absorbed MLA in torch: two batched matmuls
        scores = torch.matmul(qs[i], lat[i].transpose(1, 2)).float() * scale
        return torch.matmul(torch.softmax(scores, -1).to(_BF16), lat[i][..., :dv])

    rep.check(f"mla b{batch} ctx{ctx} torch matmul",
              reference.rel_err(torch_mla(0), want), reference.BF16_TOL)
    torch_us = graph_us([partial(torch_mla, i) for i in range(2)])
    times = [] if best is None else kernel_times(partial(ours, 0, best[1]))
    k_ours = len(times) or None
    rep.op(f"mla ctx{ctx}", batch, nbytes, None if best is None else best[0], torch_us,
           k_ours, kernel_count(partial(torch_mla, 0)),
           note=("" if best is None else f"best {best[2]}; ")
           + "torch = matmul-softmax-matmul over the latent, contiguous, 2 sets")
    _kernel_detail(rep, times, nbytes)
    rep.save()


def _kernel_detail(rep: Report, times: list[tuple[str, float]], nbytes: int) -> None:
    """Under the last row: the best variant's kernels, each timed alone (eager), and a
    torch copy of the row's bytes in a graph: how near the ceiling this size can get."""
    copy_us = copy_same_bytes_us(nbytes, rep.ceil.l2_bytes)
    row = rep.ops[-1]
    row["kernel_us"] = [{"kernel": _short_kernel(n), "us": us} for n, us in times]
    row["copy_same_bytes_us"] = copy_us
    pct = pct_of_copy(nbytes, copy_us, rep.ceil.copy_gbps)
    parts = " + ".join(f"{_short_kernel(n)} {us:.1f}" for n, us in times) or "-"
    print(f"{'':<28}     kernels alone (µs): {parts}; a copy of these bytes: "
          f"{copy_us:.1f} µs ({pct:.0f}% of the ceiling)", flush=True)


def MoELayer_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from agentload.kernels.layer import _rms

    return _rms(x, w, 1e-6)


# -- per layer ------------------------------------------------------------------------------
def bench_layers(rep: Report, cfg: LayerConfig, batches: Sequence[int], depth: int,
                 contexts: Sequence[int] = CONTEXTS) -> list[MoELayer]:
    layers = [MoELayer(cfg, "cuda", seed=10 + i, index=i) for i in range(depth)]
    defaults = {k: getattr(layers[0], k) for k in MoELayer.KNOBS}  # before any is tried
    gb = rep.ceil.copy_gbps
    print(f"\nlayer: hidden {cfg.hidden}, attention {cfg.heads} q / {cfg.kv_heads} kv heads of "
          f"{cfg.head_dim} over a paged cache (pages of {cfg.page}), {cfg.experts} experts "
          f"top-{cfg.topk} ({cfg.groups} groups, keep {cfg.topk_group}) + shared, inter "
          f"{cfg.inter}; timed as a stack of {depth} distinct layers, per-layer µs; SoL = "
          f"weights touched + KV bytes read at the copy ceiling", flush=True)
    print(f"{'batch':>5} {'ctx':>6} {'MB':>7} {'SoL':>7} | {'std eager':>9} {'std graph':>9} "
          f"{'fused eag':>9} {'fused grf':>9} {'compile':>8} | {'k std':>5} {'k fused':>7} | "
          f"{'vs SoL':>6} {'vs graph':>8} {'k ratio':>7}", flush=True)
    for b in batches:
        for ctx in contexts:
            states = [KVState.random(cfg, b, ctx, "cuda", seed=1000 * i + b) for i in
                      range(depth)]
            x0, r0 = layers[0].inputs(b, seed=100 + b)
            kv0 = states[0]
            # correctness of both paths on layer 0, against the float32 reference
            for path in ("fused", "standard"):
                got = MoELayer.result(getattr(layers[0], path)(x0, r0, kv0))
                ids = layers[0].last_ids
                assert ids is not None
                rep.check(f"layer b{b} ctx{ctx} {path}",
                          reference.rel_err(got, layers[0].reference(x0, r0, ids, kv=kv0)),
                          reference.BF16_TOL)
                differ, off = layers[0].routing_check(x0, r0, ids, kv=kv0)
                rep.check(f"layer b{b} ctx{ctx} {path} routing: {differ} of {b} tokens differ "
                          f"from the float reference, {off} not at a near-tie", float(off), 0.0)

            def stack(path: str, x0: torch.Tensor = x0, r0: torch.Tensor = r0,
                      states: list[KVState] = states) -> Fn:
                def run() -> Any:
                    x, r = x0, r0
                    for lay, st in zip(layers, states, strict=True):
                        x, r = getattr(lay, path)(x, r, st)
                    return x, r
                return run

            std_e = eager_us(stack("standard")) / depth
            std_g = graph_us([stack("standard")], min_calls=1) / depth
            fus_e = eager_us(stack("fused")) / depth
            fus_g = graph_us([stack("fused")], min_calls=1) / depth
            # the fused path's options, each checked and timed; the fastest is the row's
            tried = {"default": fus_g}
            best_knobs = dict(defaults)
            for knobs in layer_knobs(b, ctx):
                tag = ", ".join(f"{k}={v}" for k, v in knobs.items())
                for lay in layers:
                    for k, v in {**defaults, **knobs}.items():
                        setattr(lay, k, v)
                try:
                    got = MoELayer.result(layers[0].fused(x0, r0, kv0))
                    if not rep.check(f"layer b{b} ctx{ctx} fused {tag}",
                                     reference.rel_err(got, layers[0].reference(
                                         x0, r0, layers[0].last_ids, kv=kv0)),
                                     reference.BF16_TOL):
                        continue  # a wrong answer is never the fastest
                    us = graph_us([stack("fused")], min_calls=1) / depth
                except Exception as exc:  # a variant missing from the AOT cache: say so
                    print(f"  skip layer {tag}: {str(exc)[:120]}", flush=True)
                    continue
                tried[tag] = us
                if us < fus_g:
                    fus_g, best_knobs = us, {**defaults, **knobs}
            for lay in layers:  # the kernel count, trace and SoL below use the best
                for k, v in best_knobs.items():
                    setattr(lay, k, v)
            k_std = kernel_count(partial(layers[0].standard, x0, r0, kv0))
            k_fus = kernel_count(partial(layers[0].fused, x0, r0, kv0))
            # SoL counts the experts this traffic actually routed to (mean over the stack)
            stack("fused")()
            chosen = [len(set(lay.last_ids[:, :cfg.topk].reshape(-1).tolist()))
                      for lay in layers if lay.last_ids is not None]
            routed = sum(chosen) / max(len(chosen), 1)
            nbytes = cfg.step_bytes(b, ctx, routed=routed)
            sol = nbytes / (gb * 1e9) * 1e6
            row = {"batch": b, "context": ctx, "routed_experts": routed,
                   "weight_bytes": cfg.weight_bytes_touched(b, routed=routed),
                   "kv_bytes": cfg.kv_bytes_read(b, ctx), "step_bytes": nbytes, "sol_us": sol,
                   "standard_eager_us": std_e, "standard_graph_us": std_g,
                   "fused_eager_us": fus_e, "fused_graph_us": fus_g, "compile_us": None,
                   "kernels_standard": k_std, "kernels_fused": k_fus,
                   "fused_variants_us": tried, "fused_best": best_knobs}
            rep.layers.append(row)
            _print_layer(row)
            rep.save()
            del states, kv0
            torch.cuda.empty_cache()
    return layers


def layer_knobs(batch: int, context: int) -> list[dict[str, Any]]:
    """The fused layer's options the benchmark tries beside its defaults: attention on
    tensor cores (its last CTA merging a split context, or a combine kernel after it),
    and (above the GEMV's rows) the expert GEMM in passes of 1-2 tiles; on tensor cores
    also the keys copied in whole lines and the tile's other stage count; and, where the
    sequences alone fill the GPU, the context split finer than it holds (merged, with
    lines, experts in passes of 2 tiles); and above the GEMV's rows the projection GEMVs
    and the expert GEMM on more warps."""
    from agentload.kernels.presets import (
        ATTN_LAYER_SPLITS,
        ATTN_LAYER_STAGES,
        LAYER_EXPERT_THREADS,
        LAYER_GEMV_THREADS,
    )

    passes = (0, 1, 2) if batch > GEMV_MAX_ROWS else (0,)
    attention = [(False, False, False, ATTN_MMA_LAYER[1])]
    attention += list(itertools.product((True,), (False, True), (False, True),
                                        ATTN_LAYER_STAGES))
    out: list[dict[str, Any]] = []
    for (mma, merge, lines, stages), pt in itertools.product(attention, passes):
        if mma or pt:
            out.append({"attention_mma": mma, "attention_merge": merge,
                        "attention_lines": lines, "attention_stages": stages,
                        "expert_pass_tiles": pt})
    if batch > GEMV_MAX_ROWS:
        out += [{"attention_mma": True, "attention_merge": True, "attention_lines": True,
                 "attention_stages": stages, "expert_pass_tiles": 2, "attention_chunk": c}
                for c, stages in itertools.product(ATTN_LAYER_SPLITS, ATTN_LAYER_STAGES)
                if c < context]
        # the projection GEMVs with more warps, on the best attention of runs 10-14
        out += [{"attention_mma": True, "attention_merge": merge, "attention_lines": True,
                 "attention_stages": 2, "expert_pass_tiles": pt, "gemv_threads": t,
                 "expert_threads": et}
                for t, merge, pt, et in itertools.product(
                    (0, *LAYER_GEMV_THREADS), (False, True), (1, 2),
                    (128, *LAYER_EXPERT_THREADS)) if t or et != 128]
    return out


def _print_layer(row: dict[str, Any]) -> None:
    def f(v: float | None) -> str:
        return "      -  " if v is None else f"{v:9.1f}"

    print(f"{row['batch']:>5} {row.get('context', 1):>6} {row['step_bytes'] / 1e6:7.1f} "
          f"{row['sol_us']:7.1f} | "
          f"{f(row['standard_eager_us'])} {f(row['standard_graph_us'])} "
          f"{f(row['fused_eager_us'])} {f(row['fused_graph_us'])} {f(row['compile_us'])[1:]} | "
          f"{row['kernels_standard']:>5} {row['kernels_fused']:>7} | "
          f"{row['fused_graph_us'] / row['sol_us']:5.1f}x "
          f"{row['standard_graph_us'] / row['fused_graph_us']:7.1f}x "
          f"{row['kernels_fused'] / row['kernels_standard']:7.2f}", flush=True)
    if len(row.get("fused_variants_us", {})) > 1:
        print("        fused, graph µs: " + "; ".join(
            f"{k} {v:.1f}" for k, v in row["fused_variants_us"].items()), flush=True)


# -- trace ----------------------------------------------------------------------------------
def capture_trace(layers: Sequence[MoELayer], batch: int, path: Path,
                  context: int = CONTEXTS[0],
                  paths: Sequence[str] = ("standard", "fused")) -> Path:
    """One step of each of ``paths`` through the stack under torch.profiler; Kineto JSON.
    One path per file gives ``agentload profile diff standard.json fused.json``."""
    from torch.profiler import ProfilerActivity, profile

    x0, r0 = layers[0].inputs(batch, seed=7)
    states = [KVState.random(lay.cfg, batch, context, "cuda", seed=i)
              for i, lay in enumerate(layers)]

    def step(p: str) -> None:
        x, r = x0, r0
        for lay, st in zip(layers, states, strict=True):
            x, r = getattr(lay, p)(x, r, st)

    for p in ("standard", "fused"):
        step(p)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for p in paths:
            step(p)
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return path


def layer_table(trace: Path) -> list[dict[str, Any]]:
    """Kernels and GPU µs per ``layer<i>.<path>`` range, from a Kineto trace.

    A kernel belongs to the range whose CPU span holds the launch that the kernel's
    correlation id points at (``ac2g`` flow); GPU µs sums kernel durations.
    """
    doc = json.loads(trace.read_text())
    ev = doc.get("traceEvents", [])
    ranges = [e for e in ev if e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith("layer")]
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    rows: dict[str, dict[str, Any]] = {}
    for k in (e for e in ev if e.get("cat") == "kernel"):
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            continue
        ts = launch["ts"]
        owner = None
        for r in ranges:
            if r["ts"] <= ts <= r["ts"] + r.get("dur", 0) and r.get("tid") == launch.get("tid"):
                owner = r["name"]
        if owner is None:
            continue
        row = rows.setdefault(owner, {"range": owner, "kernels": 0, "gpu_us": 0.0})
        row["kernels"] += 1
        row["gpu_us"] += float(k.get("dur", 0))
    return sorted(rows.values(), key=lambda r: (r["range"].split(".")[1], r["range"]))


# -- driver ---------------------------------------------------------------------------------
def run(*, batches: Sequence[int] = BATCHES, ceilings_path: Path | None = None,
        out: Path | None = None, trace_dir: Path | None = None, depth: int = 4,
        do_compile: bool = True, ops_only: bool = False, layers_only: bool = False,
        attention_only: bool = False, contexts: Sequence[int] = CONTEXTS) -> Report:
    """Run the whole benchmark; print tables; write ``out`` JSON (and a trace)."""
    if not torch.cuda.is_available():
        from agentload.kernels.errors import KernelsError

        raise KernelsError("agentload bench kernels needs a CUDA GPU")
    ceil = ceil_mod.load_or_measure(ceilings_path)
    rep = Report(ceil, out)
    print(f"{ceil.gpu}: copy ceiling {ceil.copy_gbps:.0f} GB/s, bf16 {ceil.bf16_tflops:.0f} "
          f"TFLOP/s, L2 {ceil.l2_bytes / 2**20:.0f} MiB, {ceil.sms} SMs; torch {torch.__version__}",
          flush=True)
    cfg = LayerConfig()
    if attention_only:
        print(f"\n{'op':<28}{'b':>4} {'MB':>9} {'ours µs':>7} {'%copy':>6} {'k':>3}  "
              f"{'torch µs':>7} {'%copy':>6} {'k':>3}", flush=True)
        cases = [(b, ctx) for b, ctx in ATTN_CASES if b in batches and ctx in contexts]
        for b, ctx in cases:
            bench_attention(rep, b, ctx)
        for b, ctx in cases:
            bench_attention_mla(rep, b, ctx)
        bad = [c for c in rep.checks if not c["ok"]]
        print(f"\nchecks: {len(rep.checks) - len(bad)}/{len(rep.checks)} passed", flush=True)
        rep.save()
        return rep
    if not layers_only:
        print(f"\n{'op':<28}{'b':>4} {'MB':>9} {'ours µs':>7} {'%copy':>6} {'k':>3}  "
              f"{'torch µs':>7} {'%copy':>6} {'k':>3}", flush=True)
        for rows in GEMV_ROWS:
            for name, k, n in GEMV_SHAPES:
                bench_gemv(rep, name, k, n, rows)
        for b in batches:
            for hsz in NORM_HIDDEN:
                bench_norm(rep, hsz, b)
            for i in SILU_INTER:
                bench_silu(rep, i, b)
            bench_router(rep, cfg, b)
            bench_experts(rep, cfg, b)
            if b <= 16:
                bench_oproj(rep, cfg, b)
        for b, ctx in ATTN_CASES:
            bench_attention(rep, b, ctx)
            bench_attention_mla(rep, b, ctx)
        # Where add+RMSNorm has enough bytes to leave launch latency behind (scaling row).
        bench_norm(rep, 7168, 512)
        # The floor at the target's size (and at b1 / b512 for the trend).
        for b in (1, 64, 512):
            bench_floor(rep, 7168, b)
    if not ops_only:
        layers = bench_layers(rep, cfg, batches, depth, contexts)
        if trace_dir is not None:
            for b in (x for x in (1, 8, 64) if x in batches):
                ctx = CONTEXTS[0]
                for row in rep.layers:  # the fused options that won at this batch
                    if row["batch"] == b and row["context"] == ctx:
                        for lay in layers:
                            for k, v in row.get("fused_best", {}).items():
                                setattr(lay, k, v)
                path = capture_trace(layers, b, trace_dir / f"kernels-trace-b{b}.json", ctx)
                table = layer_table(path)
                rep.trace += [{"batch": b, "context": ctx, **t} for t in table]
                print(f"\ntrace {path.name} (context {ctx}): per-layer kernels and GPU µs "
                      "(Kineto)")
                for t in table:
                    print(f"  {t['range']:<20} {t['kernels']:>4} kernels {t['gpu_us']:8.1f} µs")
                # one path per file, for `agentload profile diff` (standard vs fused)
                for p in ("standard", "fused"):
                    capture_trace(layers, b, trace_dir / f"kernels-trace-b{b}-{p}.json", ctx,
                                  paths=(p,))
                rep.save()
        if do_compile:
            bench_compile(rep, layers)
    bad = [c for c in rep.checks if not c["ok"]]
    print(f"\nchecks: {len(rep.checks) - len(bad)}/{len(rep.checks)} passed", flush=True)
    rep.save()
    return rep


def bench_compile(rep: Report, layers: Sequence[MoELayer]) -> None:
    """torch.compile (default mode) of the standard step, one compile per shape (the
    weights and caches are arguments, so every layer of the stack shares the graph)."""
    from agentload.kernels.layer import layer_range, standard_step

    print("\ntorch.compile (standard path, default mode), per layer µs:", flush=True)
    depth = len(layers)
    step = torch.compile(standard_step, dynamic=False)
    for row in rep.layers:
        b, ctx = row["batch"], row.get("context", 1)
        x0, r0 = layers[0].inputs(b, seed=100 + b)
        states = [KVState.random(lay.cfg, b, ctx, "cuda", seed=i)
                  for i, lay in enumerate(layers)]
        t0 = time.perf_counter()
        try:
            def run_c(x0: Any = x0, r0: Any = r0, states: Any = states, ctx: int = ctx) -> Any:
                x, r = x0, r0
                for lay, st in zip(layers, states, strict=True):
                    with layer_range(f"layer{lay.index}.compiled"):
                        x, r, _ = step(lay.cfg, lay.weights(), x, r, st.tensors(), ctx)
                return x, r

            run_c()
            row["compile_s"] = time.perf_counter() - t0
            row["compile_us"] = eager_us(run_c) / depth
            row["kernels_compiled"] = kernel_count(
                partial(step, layers[0].cfg, layers[0].weights(), x0, r0, states[0].tensors(),
                        ctx))
            print(f"  batch {b} ctx {ctx}: {row['compile_us']:.1f} µs, "
                  f"{row['kernels_compiled']} kernels (compiled in {row['compile_s']:.0f} s)",
                  flush=True)
        except Exception as exc:  # report and go on: a compile failure is a result too
            print(f"  batch {b} ctx {ctx}: torch.compile failed: {str(exc)[:300]}", flush=True)
        del states
        rep.save()


def main(argv: list[str] | None = None) -> int:
    """``python -m agentload.kernels.bench {ceilings|kernels} ...`` (no typer needed)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m agentload.kernels.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("ceilings")
    c.add_argument("--out", type=Path)
    k = sub.add_parser("kernels")
    k.add_argument("--ceilings", type=Path)
    k.add_argument("--out", type=Path)
    k.add_argument("--trace-dir", type=Path)
    k.add_argument("--batches", default="1,8,64")
    k.add_argument("--contexts", default=",".join(str(c) for c in CONTEXTS),
                   help="contexts of the layer and attention rows")
    k.add_argument("--depth", type=int, default=4)
    k.add_argument("--no-compile", action="store_true")
    k.add_argument("--ops-only", action="store_true")
    k.add_argument("--layers-only", action="store_true")
    k.add_argument("--attention-only", action="store_true")
    a = p.parse_args(argv)
    if a.cmd == "ceilings":
        cl = ceil_mod.measure()
        path = ceil_mod.save(cl, a.out)
        print(f"{cl.gpu}: copy {cl.copy_gbps:.0f} GB/s (read + write), "
              f"bf16 matmul {cl.bf16_tflops:.0f} TFLOP/s (n={cl.matmul_n})")
        print(f"wrote {path}")
        return 0
    run(batches=[int(x) for x in a.batches.split(",")], ceilings_path=a.ceilings, out=a.out,
        trace_dir=a.trace_dir, depth=a.depth, do_compile=not a.no_compile, ops_only=a.ops_only,
        layers_only=a.layers_only, attention_only=a.attention_only,
        contexts=[int(x) for x in a.contexts.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
