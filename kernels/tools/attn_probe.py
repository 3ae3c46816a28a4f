"""Where batch-1 decode attention loses time against the copy ceiling (GPU; a diagnostic).

Times one tensor-core tile over the same KV bytes laid out four ways -- 4 KV heads
interleaved in each page (vLLM's layout) or 1 KV head (each page one contiguous run),
pages shuffled or in order -- with and without the last-CTA merge, and each kernel alone
under the profiler. If the one-head layouts run faster, a CTA should read every KV head
of its chunk (whole pages) rather than one head's slices.

``--timeline`` instead runs the stamping variants (``presets.TIMELINE_TILES``): each CTA
records %globaltimer at entry, after its prologue (length, Q, page ids), when its first
tile lands, when its last tile lands and at its end; the phases' spread says whether the
time goes to the launch, the ramp, the stream or the tail.

    python -m agentload.kernels.tools.attn_probe [--tile 1024,256,2] [--tokens 131072]
    python -m agentload.kernels.tools.attn_probe --timeline
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from agentload.kernels import _cache, ops
from agentload.kernels import ceilings as ceil_mod
from agentload.kernels.bench import copy_same_bytes_us, graph_us, kernel_times, pct_of_copy
from agentload.kernels.presets import TIMELINE_CONTEXT, TIMELINE_TILES, timeline_specs

WRAP = 1 << 24  #: the stamps keep the timer's low 24 bits (exact in a float32)
PHASES = ("prologue", "first tile", "stream", "epilogue")


def paged_kv(batch: int, ctx: int, hkv: int, sets: int, *, shuffled: bool = True,
             d: int = 128, page: int = 16, device: str = "cuda"
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``sets`` random paged key and value caches of ``batch`` sequences of ``ctx``
    tokens (vLLM's layout), their block table (pages shuffled, or in order) and lengths."""
    pages = batch * ctx // page
    gen = torch.Generator(device="cpu").manual_seed(1)
    kc = [torch.randn(pages, page, hkv, d, device=device, dtype=torch.bfloat16)
          for _ in range(sets)]
    vc = [torch.randn(pages, page, hkv, d, device=device, dtype=torch.bfloat16)
          for _ in range(sets)]
    order = torch.randperm(pages, generator=gen) if shuffled else torch.arange(pages)
    table = order.to(torch.int32).view(batch, -1).to(device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return kc, vc, table, lens


def probe(hkv: int, shuffled: bool, tokens: int, tile: tuple[int, int, int], merge: bool,
          gbps: float) -> None:
    g, d = 4, 128
    ctx = tokens // hkv
    sets = 2
    kc, vc, table, lens = paged_kv(1, ctx, hkv, sets, shuffled=shuffled)
    qs = [torch.randn(1, hkv * g, d, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    chunk, threads, stages = tile
    c = chunk  # 1 head over 4x the tokens: as many CTAs, as many bytes each

    def call(i: int) -> torch.Tensor:
        return ops.decode_attention(qs[i], kc[i], vc[i], table, lens, max_len=ctx, chunk=c,
                                    threads=threads, mma=True, stages=stages, merge=merge)

    nbytes = 2 * tokens * d * 2
    try:
        us = graph_us([partial(call, i) for i in range(sets)])
        alone = kernel_times(partial(call, 0))
    except Exception as exc:  # a variant not in the AOT cache
        print(f"hkv {hkv} shuffled {shuffled} merge {merge}: {str(exc)[:100]}", flush=True)
        return
    pct = pct_of_copy(nbytes, us, gbps)
    parts = " + ".join(f"{us_:.1f}" for _, us_ in alone)
    print(f"hkv {hkv} {'shuffled' if shuffled else 'in order':>8} chunk {c:>5} "
          f"{'merge' if merge else 'combine':>7}: {us:6.1f} µs graph, {pct:5.1f}% of copy; "
          f"kernels alone {parts} µs", flush=True)


def unwrap(stamps: torch.Tensor) -> torch.Tensor:
    """``[ctas, 5]`` stamps (timer mod 2^24, ns) as ns since the earliest CTA's entry."""
    ref = stamps[0, 0]
    rel = torch.remainder(stamps - ref, WRAP)
    rel = torch.where(rel > WRAP // 2, rel - WRAP, rel)  # stamps a little before ref
    return rel - rel[:, 0].min()


def timeline_report(rel: torch.Tensor, nbytes: int) -> str:
    """One tile's phases over its CTAs (``rel``: ``[ctas, 5]`` ns since the first entry)."""
    us = rel.double() / 1e3
    lines = [f"  {len(us)} CTAs; span {us[:, 4].max():.1f} µs; entries over "
             f"{us[:, 0].max():.1f} µs; last tile landed {us[:, 3].min():.1f}..."
             f"{us[:, 3].max():.1f} µs; ends {us[:, 4].min():.1f}..{us[:, 4].max():.1f} µs"]
    for i, name in enumerate(PHASES):
        d = us[:, i + 1] - us[:, i]
        lines.append(f"  {name:>10}: median {d.median():6.2f} µs, min {d.min():6.2f}, "
                     f"max {d.max():6.2f}")
    # while every CTA streams: from the last first-tile to the first last-tile
    lo, hi = float(us[:, 2].max()), float(us[:, 3].min())
    whole = nbytes / (float(us[:, 4].max()) * 1e-6) / 1e9
    lines.append(f"  whole kernel {whole:.0f} GB/s; every CTA streaming from {lo:.1f} to "
                 f"{hi:.1f} µs" + (f" ({(hi - lo) / us[:, 4].max() * 100:.0f}% of the span)"
                                   if hi > lo else " (never all at once)"))
    return "\n".join(lines)


def timeline(batch: int, chunk: int, threads: int, stages: int, lines: bool, dynamic: int,
             repeats: int = 5) -> None:
    """Runs one stamping variant ``repeats`` times (KV past L2 each time) and prints the
    phases of the median-span run."""
    hq, hkv, d, page, ctx = 16, 4, 128, 16, TIMELINE_CONTEXT
    spec = next(s for s, t in zip(timeline_specs(), TIMELINE_TILES, strict=True)
                if t == (batch, chunk, threads, stages, lines, dynamic))
    sets = 2 if batch * ctx * hkv * d * 4 < (1 << 30) else 1  # past L2; 4 GB: one is plenty
    kc, vc, table, lens = paged_kv(batch, ctx, hkv, sets, d=d, page=page)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    splits = -(-ctx // chunk)
    if dynamic:  # that many CTAs a (sequence, KV head)
        splits = dynamic
    part = torch.zeros(batch, hq, splits, d, device="cuda")
    lse = torch.zeros(batch, hq, splits, device="cuda")
    out = torch.empty_like(q)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")
    fn = _cache.get(spec)
    runs = []
    for i in range(repeats + 1):
        fn(q, kc[i % sets], vc[i % sets], table, lens, part, lse, out, q[:, :hkv],
           q[:, :hkv], counters, d ** -0.5)
        torch.cuda.synchronize()
        counters.zero_()  # no combine runs here to re-arm the dynamic split's
        if i:  # the first run loads the module
            stamps = part[:, :: hq // hkv, :, :5]  # each CTA's first head
            runs.append(unwrap(stamps.reshape(-1, 5).to(torch.int64).cpu()))
    sms = part[:, :: hq // hkv, :, 5].reshape(-1).to(torch.int64).cpu()  # the last run's
    per_sm = torch.bincount(sms)
    runs.sort(key=lambda r: float(r[:, 4].max()))
    nbytes = batch * ctx * hkv * d * 2 * 2
    name = (f"b{batch} {f'dynamic {dynamic} a head' if dynamic else f'chunk {chunk}'} "
            f"t{threads} s{stages}"
            f"{' lines' if lines else ''}")
    spans = ", ".join(f"{float(r[:, 4].max()) / 1e3:.1f}" for r in runs)
    print(f"{name}: spans {spans} µs; {int((per_sm > 0).sum())} SMs, at most "
          f"{int(per_sm.max())} CTAs on one; the median run:", flush=True)
    print(timeline_report(runs[len(runs) // 2], nbytes), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentload.kernels.tools.attn_probe")
    p.add_argument("--tile", default="1024,256,2", help="chunk,threads,stages (4 KV heads)")
    p.add_argument("--tokens", type=int, default=131072, help="KV head-tokens in all")
    p.add_argument("--timeline", action="store_true",
                   help="stamp each CTA's phases (the TIMELINE_TILES variants) instead")
    a = p.parse_args(argv)
    if a.timeline:
        for tl in TIMELINE_TILES:
            try:
                timeline(*tl)
            except Exception as exc:  # a variant not in the AOT cache
                print(f"{tl}: {str(exc)[:120]}", flush=True)
        return 0
    tile = tuple(int(x) for x in a.tile.split(","))
    ceil = ceil_mod.load_or_measure()
    nbytes = 2 * a.tokens * 128 * 2
    copy_us = copy_same_bytes_us(nbytes, ceil.l2_bytes)
    print(f"{ceil.gpu}: copy ceiling {ceil.copy_gbps} GB/s; {nbytes / 1e6:.1f} MB of KV; "
          f"a torch copy of as many bytes: {copy_us:.1f} µs", flush=True)
    for merge in (False, True):
        for hkv in (4, 1):
            for shuffled in (True, False):
                probe(hkv, shuffled, a.tokens, tile, merge, ceil.copy_gbps)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
