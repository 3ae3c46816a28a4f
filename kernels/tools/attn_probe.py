"""Where batch-1 decode attention loses time against the copy ceiling (GPU; a diagnostic).

Times one tensor-core tile over the same KV bytes laid out four ways -- 4 KV heads
interleaved in each page (vLLM's layout) or 1 KV head (each page one contiguous run),
pages shuffled or in order -- with and without the last-CTA merge, and each kernel alone
under the profiler. If the one-head layouts run faster, a CTA should read every KV head
of its chunk (whole pages) rather than one head's slices.

    python -m agentload.kernels.tools.attn_probe [--tile 1024,256,2] [--tokens 131072]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from agentload.kernels import ceilings as ceil_mod
from agentload.kernels import ops
from agentload.kernels.bench import copy_same_bytes_us, graph_us, kernel_times, pct_of_copy


def probe(hkv: int, shuffled: bool, tokens: int, tile: tuple[int, int, int], merge: bool,
          gbps: float) -> None:
    g, d, page = 4, 128, 16
    ctx = tokens // hkv
    pages = ctx // page
    sets = 2
    gen = torch.Generator(device="cpu").manual_seed(1)
    kc = [torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
          for _ in range(sets)]
    vc = [torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
          for _ in range(sets)]
    order = torch.randperm(pages, generator=gen) if shuffled else torch.arange(pages)
    table = order.to(torch.int32).view(1, -1).cuda()
    lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agentload.kernels.tools.attn_probe")
    p.add_argument("--tile", default="1024,256,2", help="chunk,threads,stages (4 KV heads)")
    p.add_argument("--tokens", type=int, default=131072, help="KV head-tokens in all")
    a = p.parse_args(argv)
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
