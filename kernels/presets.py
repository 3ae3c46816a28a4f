"""The scaled-down MoE layer's shape and every kernel variant the benchmarks use (no torch).

``bench_specs()`` is what ``python -m agentload.kernels.aot`` compiles ahead of time, so
a GPU machine without the CuTe DSL compiler can run ``agentload bench kernels``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from agentload.kernels.specs import (
    ATTN_CHUNKS,
    GEMV_MAX_ROWS,
    MMA_MAX_ROWS,
    KernelSpec,
    add_rmsnorm_spec,
    attention_chunk,
    attention_combine_spec,
    decode_attention_spec,
    expert_gemm_spec,
    gemv_spec,
    grouped_gemv_spec,
    mma_chunk_rules,
    router_spec,
    silu_mul_spec,
)

BATCHES = (1, 8, 64)
CONTEXTS = (4096, 32768)  #: tokens of context per sequence in the layer benchmark


@dataclass(frozen=True, slots=True)
class LayerConfig:
    """A toy MoE decoder layer: GQA attention over a paged KV cache, a grouped router,
    routed + shared experts.

    Defaults give 58.8 MB of bf16 weights touched per step at batch 1 (q/k/v projection
    12.6 MB for 16 query and 4 KV heads of 128, o-projection 8.4 MB, router 64 KB, two
    routed experts and the shared expert 12.6 MB each), plus the KV bytes the step reads:
    2 KB per token of context per sequence (4 KV heads x 128 x bf16 x key and value).
    """

    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    page: int = 16  #: tokens per KV-cache page (vLLM's default block size)
    experts: int = 16
    topk: int = 2
    groups: int = 4
    topk_group: int = 2
    inter: int = 1024
    routed_scale: float = 1.0
    eps: float = 1e-6

    @property
    def qkv_out(self) -> int:
        """Width of the fused q/k/v projection: query heads, then keys, then values."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def kv_bytes_read(self, batch: int, context: int) -> int:
        """KV-cache bytes one decode step reads at ``context`` tokens per sequence."""
        return batch * context * self.kv_heads * self.head_dim * 2 * 2

    def step_bytes(self, batch: int, context: int, *, routed: float | None = None) -> float:
        """The step's speed-of-light bytes: weights touched plus KV bytes read (``routed``:
        the distinct routed experts the step actually chose, see weight_bytes_touched)."""
        return (self.weight_bytes_touched(batch, routed=routed)
                + self.kv_bytes_read(batch, context))

    @property
    def slots(self) -> int:
        """Expert rows per token: the routed top-k plus the shared expert."""
        return self.topk + 1

    def weight_bytes_touched(self, batch: int, *, routed: float | None = None) -> float:
        """bf16 weight bytes one decode step must read at least once at ``batch``:
        the dense weights, the shared expert and each distinct routed expert once.
        ``routed`` is the number of distinct routed experts the step chose (a measured
        mean over layers, so possibly fractional); by default every token's top-k is
        assumed distinct (``min(experts, batch * topk)``)."""
        h, i = self.hidden, self.inter
        dense = (h * self.qkv_out + h * h + self.experts * h) * 2
        expert = (h * 2 * i + i * h) * 2
        distinct = min(self.experts, batch * self.topk) if routed is None else routed
        return dense + expert * (1 + distinct) + 2 * h * 2  # + the two norm weights

    def attention_specs(self, batch: int, context: int, *, pdl: bool) -> list[KernelSpec]:
        """The attention kernels the fused path may use at this shape: the CUDA-core one
        and the tensor-core one (its combine, or its own last CTA merging, when the
        context is split)."""
        out = []
        # the CUDA-core kernel, and the tensor-core one at each of its stage counts
        for mma, stages in ((False, 3), *((True, s) for s in ATTN_LAYER_STAGES)):
            threads = ATTN_MMA_LAYER[0] if mma else 128
            step, per_sm = (mma_chunk_rules(self.head_dim, self.group, self.page, threads,
                                            stages, self.head_dim, False)
                            if mma else (32, 2))
            c = attention_chunk(batch, self.kv_heads, context, step=step, ctas_per_sm=per_sm)
            direct = context <= c
            for lines in (False, True) if mma else (False,):  # keys in whole lines or not
                out.append(decode_attention_spec(
                    self.head_dim, self.group, self.page, c, direct=direct, pdl=pdl,
                    fresh=True, mma=mma, threads=threads, stages=stages, lines=lines))
                if mma and not direct:  # its last CTA merging the chunks instead
                    out.append(decode_attention_spec(
                        self.head_dim, self.group, self.page, c, direct=False, pdl=pdl,
                        fresh=True, mma=True, threads=threads, stages=stages, merge=True,
                        lines=lines))
            if not direct:
                out.append(attention_combine_spec(self.head_dim, c, pdl=pdl))
            if mma and direct and batch > GEMV_MAX_ROWS:  # split finer than the GPU holds
                out += [decode_attention_spec(
                    self.head_dim, self.group, self.page, split, direct=False, pdl=pdl,
                    fresh=True, mma=True, threads=threads, stages=stages, merge=True,
                    lines=True) for split in ATTN_LAYER_SPLITS if split < context]
        return out

    def specs(self, batch: int) -> list[KernelSpec]:
        """The kernel variants the fused path uses at ``batch``."""
        h = self.hidden
        out = [add_rmsnorm_spec(h, self.slots), add_rmsnorm_spec(h, 1),
               router_spec(h, self.experts, self.topk, self.groups, self.topk_group,
                           self.routed_scale, shared=True)]
        for context in (1, *CONTEXTS):  # 1: a first token (the cache holds only it)
            out += self.attention_specs(batch, context, pdl=batch <= MMA_MAX_ROWS)
        if batch <= MMA_MAX_ROWS:
            e = self.experts + 1
            for pdl in (False, True):  # plain (op tests) and PDL (the fused layer)
                out += [add_rmsnorm_spec(h, self.slots, pdl=pdl),
                        router_spec(h, self.experts, self.topk, self.groups,
                                    self.topk_group, self.routed_scale, shared=True, pdl=pdl),
                        gemv_spec(h, self.qkv_out, batch, pdl=pdl)]
                if batch <= GEMV_MAX_ROWS:
                    out += [gemv_spec(h, h, batch, residual=True, fuse_norm=True, pdl=pdl),
                            grouped_gemv_spec(h, 2 * self.inter, e, div=self.slots, silu=True,
                                              pdl=pdl),
                            grouped_gemv_spec(self.inter, h, e, div=1, silu=False, pdl=pdl)]
                else:
                    out += [gemv_spec(h, h, batch, pdl=pdl), add_rmsnorm_spec(h, 1, pdl=pdl)]
                    # the projections' wider tiles (MoELayer.gemv_threads)
                    out += [gemv_spec(h, n, batch, pdl=pdl, threads=t)
                            for n in (self.qkv_out, h) for t in LAYER_GEMV_THREADS]
                # the expert GEMM in one pass; above 16 rows also in passes of 1-2 tiles,
                # and those on more warps (MoELayer.expert_threads)
                for pt in (0, 1, 2) if batch > GEMV_MAX_ROWS else (0,) if batch >= 2 else ():
                    for t in (128, *LAYER_EXPERT_THREADS) if pt else (128,):
                        out += [expert_gemm_spec(h, 2 * self.inter, e, tokens=batch,
                                                 slots=self.slots, div=self.slots, silu=True,
                                                 pdl=pdl, pass_tiles=pt, threads=t),
                                expert_gemm_spec(self.inter, h, e, tokens=batch,
                                                 slots=self.slots, div=1, silu=False, pdl=pdl,
                                                 pass_tiles=pt, threads=t)]
            return out
        out.append(silu_mul_spec(self.inter))
        return out


#: Shapes of the per-op benchmark: (name, K, N) GEMVs and the hidden sizes of the norms.
GEMV_SHAPES = (("gemv 7168x16384", 7168, 16384), ("gemv 16384x7168", 16384, 7168),
               ("gemv 2048x6144", 2048, 6144))
GEMV_ROWS = (1, 2, 4, 8, 12, 16, 32, 64)
NORM_HIDDEN = (2048, 7168)
SILU_INTER = (1024, 18432)
NORM_CLUSTERS = (1, 2, 4)


def gemv_variants(k: int, n: int, rows: int) -> list[KernelSpec]:
    """Tile variants to try for one GEMV shape (the benchmark keeps the fastest)."""
    out: list[KernelSpec] = []
    # opb 8 at 8 rows halves the activation re-reads from L2 (each CTA reads all of x:
    # rows/opb bytes of x per weight byte) at the price of 64 accumulators per thread.
    for threads, opb in ((128, 4), (128, 8), (256, 4), (64, 8), (256, 8)):
        if rows > GEMV_MAX_ROWS or k % (threads * 8) or n % opb or rows * opb > threads:
            continue
        if rows < 8 and (threads, opb) == (256, 8):
            continue
        out.append(gemv_spec(k, n, rows, opb=opb, threads=threads, mma=False))
    # tensor cores at every row count: 16 or 32 outputs per CTA, K split over its warps
    if rows <= MMA_MAX_ROWS:
        wide = ((512, 16),) if rows > GEMV_MAX_ROWS else ()  # 16 warps: K split finer
        for threads, opb in ((128, 16), (64, 16), (256, 16), (256, 32), *wide):
            if k % threads == 0 and n % opb == 0:
                out.append(gemv_spec(k, n, rows, opb=opb, threads=threads, mma=True))
    return out


def norm_variants(hidden: int) -> list[KernelSpec]:
    """add+RMSNorm variants the benchmark tries: one CTA per row, or a 2- or 4-CTA cluster."""
    return [add_rmsnorm_spec(hidden, 1, cluster=c) for c in NORM_CLUSTERS
            if (hidden // 8) % (32 * c) == 0]


#: Decode attention variants compiled ahead of time: (head dim, query heads per KV head, page).
ATTN_SHAPES = ((128, 4, 16), (128, 1, 16), (128, 8, 16))


#: (threads, unroll, pipe) tiles the attention benchmark tries on the layer's shape: more
#: warps, more steps per iteration, or the next iteration's loads issued during this one's
#: math (pipe) put more KV bytes in flight per CTA.
ATTN_TILES = ((128, 4, False), (128, 8, False), (256, 4, False), (128, 4, True),
              (128, 8, True))


#: (threads, stages) tiles of the tensor-core attention the benchmark tries; the first is
#: the one the fused layer uses with ``MoELayer.attention_mma``.
ATTN_MMA_TILES = ((128, 3), (128, 2), (64, 4), (256, 2), (256, 3), (128, 6))
ATTN_MMA_LAYER = ATTN_MMA_TILES[0]
#: stage counts of that tile the layer may take (``MoELayer.attention_stages``)
ATTN_LAYER_STAGES = (ATTN_MMA_LAYER[1], 2)
#: threads the layer's projection GEMVs may take above GEMV_MAX_ROWS rows
#: (``MoELayer.gemv_threads``) beside the op's default 128
LAYER_GEMV_THREADS = (256, 512)
#: threads the layer's expert GEMM may take in passes (``MoELayer.expert_threads``)
#: beside its default 128
LAYER_EXPERT_THREADS = (256,)
#: chunk lengths the layer's tensor-core attention may take when its sequences already
#: fill the GPU (``MoELayer.attention_chunk``, merged by the last CTA): more chunks than
#: the GPU holds, so SMs that stream faster take more of them
ATTN_LAYER_SPLITS = (2048, 4096, 8192)
#: (threads, stages) tiles of the tensor-core attention whose CTA reads every KV head of
#: its chunk (:data:`ATTN_ALL_HEADS` of them: whole pages), tried on the bench's shape
ATTN_HEADS_TILES = ((128, 3), (256, 2), (256, 3), (128, 6))
ATTN_ALL_HEADS = 4


#: MLA attention as in DeepSeek-V3 / Kimi at 16 heads a GPU: (key = latent 512 + rope 64,
#: heads, page, value = the latent), and the (threads, stages) tiles the bench tries.
MLA_SHAPE = (576, 16, 16, 512)
MLA_TILES = ((64, 3), (64, 2), (32, 4))  # 22.5 KiB a warp's stage: 4 warps x 2 do not fit
#: heads a GPU also compiled (first tile only): Kimi K2's 64 heads at TP 8
MLA_OTHER_HEADS = (8,)
#: stages of the shared-tile MLA kernel (one CTA of 4 warps per chunk) the bench tries
MLA_SHARED_STAGES = (2, 3, 4)


def mla_variants() -> list[KernelSpec]:
    """Every chunk of the MLA shape on each tile, direct and split, and the combines."""
    dk, h, page, dv = MLA_SHAPE
    out: list[KernelSpec] = []
    for c in ATTN_CHUNKS:
        for heads, tiles in ((h, MLA_TILES), *((o, MLA_TILES[:1]) for o in MLA_OTHER_HEADS)):
            for threads, stages in tiles:
                if c % (16 * (threads // 32)) == 0:
                    for direct in (False, True):
                        out.append(decode_attention_spec(
                            dk, heads, page, c, direct=direct, threads=threads,
                            stages=stages, mma=True, value_dim=dv, latent=True))
        for heads in (h, *MLA_OTHER_HEADS):  # one CTA per chunk sharing each tile
            # other head counts: the tests call decode_attention_mla's default 3 stages
            for stages in MLA_SHARED_STAGES if heads == h else (3,):
                for direct in (False, True):
                    out.append(decode_attention_spec(
                        dk, heads, page, c, direct=direct, stages=stages, mma=True,
                        value_dim=dv, latent=True, shared=True))
        out.append(attention_combine_spec(dv, c))
    return out


#: quarters of each warp's even share the dynamic split deals out statically before its
#: counter (``dynamic_fixed``) that the bench tries beside the ramp's two tiles
ATTN_DYNAMIC_FIXED = (2, 3)
#: tiles ``attn_probe --timeline`` stamps, as (batch, chunk, threads, stages, lines,
#: dynamic CTAs a (sequence, KV head) or 0) at a 32k context over the attention bench's
#: shape (16 q / 4 KV heads of 128, pages of 16); a dynamic tile's chunk is one
#: iteration's tokens (33 CTAs a head of 4 fill 132 SMs at one 8-warp CTA each)
TIMELINE_TILES = ((1, 1024, 256, 2, True, 0), (1, 512, 128, 2, True, 0),
                  (1, 128, 256, 2, True, 33), (1, 128, 256, 2, True, 66),
                  (1, 64, 128, 2, True, 66), (64, 32768, 128, 2, True, 0),
                  (64, 64, 128, 2, True, 2), (64, 2048, 128, 2, True, 0))
TIMELINE_CONTEXT = 32768


def timeline_specs() -> list[KernelSpec]:
    """The diagnostic variants of :data:`TIMELINE_TILES` (their outputs carry stamps)."""
    return [decode_attention_spec(128, 4, 16, c, direct=c >= TIMELINE_CONTEXT, threads=t,
                                  stages=st, mma=True, lines=kl, timeline=True,
                                  dynamic=dyn > 0)
            for _b, c, t, st, kl, dyn in TIMELINE_TILES]


def attention_variants() -> list[KernelSpec]:
    """Every chunk length of each attention shape, direct and split, and their combines;
    on the layer's shape also every tile of :data:`ATTN_TILES` and the ``fresh`` variants
    (the step's own key and value from the projection) that the GPU tests call."""
    out: list[KernelSpec] = []
    for i, (d, g, p) in enumerate(ATTN_SHAPES):
        for c in ATTN_CHUNKS:
            for direct in (False, True):
                tiles = ATTN_TILES if i == 0 else ATTN_TILES[:1]
                for threads, unroll, pipe in tiles:
                    out.append(decode_attention_spec(d, g, p, c, direct=direct,
                                                     threads=threads, unroll=unroll,
                                                     pipe=pipe))
                if i == 0:
                    out.append(decode_attention_spec(d, g, p, c, direct=direct, fresh=True))
                # tensor cores: one KV head a CTA (MMA tiles) or all of them (heads
                # tiles); the first tile of each also with the step's own key (the
                # layer's tile, the tests')
                families = ((1, ATTN_MMA_TILES if i == 0 else ATTN_MMA_TILES[:1]),
                            (ATTN_ALL_HEADS, ATTN_HEADS_TILES if i == 0 else ()))
                for kh, tiles_mma in families:
                    for j, (threads, stages) in enumerate(tiles_mma):
                        step, _ = mma_chunk_rules(d, g, p, threads, stages, d, False,
                                                  kv_heads=kh)
                        if c % step:
                            continue
                        for merge, lines in itertools.product(
                                (False,) if direct else (False, True),
                                (False, True) if i == 0 else (False,)):
                            out.append(decode_attention_spec(
                                d, g, p, c, direct=direct, threads=threads, mma=True,
                                stages=stages, merge=merge, kv_heads=kh, lines=lines))
                        if i == 0 and j == 0:
                            out.append(decode_attention_spec(
                                d, g, p, c, direct=direct, threads=threads, mma=True,
                                stages=stages, fresh=True, kv_heads=kh))
                        if i == 0 and kh == 1 and not direct:  # the bench's PDL retry
                            for lines in (False, True):
                                out.append(decode_attention_spec(
                                    d, g, p, c, direct=False, threads=threads, mma=True,
                                    stages=stages, lines=lines, pdl=True))
            out.append(attention_combine_spec(d, c))
            if i == 0:
                out.append(attention_combine_spec(d, c, pdl=True))
        if i == 0:
            out += dynamic_attention_variants(d, g, p)
    return out


def dynamic_attention_variants(d: int, g: int, p: int) -> list[KernelSpec]:
    """The dynamic split (CTAs taking tiles from a shared counter) on each two-stage
    tensor-core tile, keys in lines or not, plain and PDL, and their combines; with
    lines also each of :data:`ATTN_DYNAMIC_FIXED` quarters dealt out statically first."""
    out: list[KernelSpec] = []
    for (threads, stages), lines, pdl in itertools.product(
            ATTN_MMA_TILES, (False, True), (False, True)):
        if stages == 2:
            step, _ = mma_chunk_rules(d, g, p, threads, stages, d, False)
            for fixed in (0, *ATTN_DYNAMIC_FIXED) if lines else (0,):
                out.append(decode_attention_spec(d, g, p, step, direct=False,
                                                 threads=threads, mma=True, stages=2,
                                                 lines=lines, pdl=pdl, dynamic=True,
                                                 dynamic_fixed=fixed))
            out.append(attention_combine_spec(d, step, pdl=pdl, every=True))
    return out


def bench_specs(layer: LayerConfig | None = None) -> list[KernelSpec]:
    """Every variant ``agentload bench kernels`` may load (deduplicated, stable order)."""
    layer = layer or LayerConfig()
    seen: dict[str, KernelSpec] = {}
    specs: list[KernelSpec] = []
    for b in BATCHES:
        specs += layer.specs(b)
    for _name, k, n in GEMV_SHAPES:
        for rows in GEMV_ROWS:
            specs += gemv_variants(k, n, rows)
            specs.append(gemv_spec(k, n, rows, residual=True))  # the tests' residual case
    for h in NORM_HIDDEN:
        specs += norm_variants(h)
    for i in SILU_INTER:
        specs.append(silu_mul_spec(i))
    specs += attention_variants()
    specs += mla_variants()
    specs += timeline_specs()  # kernels.tools.attn_probe --timeline
    for s in specs:
        seen.setdefault(s.key(), s)
    return list(seen.values())
