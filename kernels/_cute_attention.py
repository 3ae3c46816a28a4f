"""CuTe DSL decode attention over a paged KV cache (imported only to compile).

One decode step: each sequence has one new query token per query head and attends to
its whole context, whose keys and values sit in fixed-size pages of a shared cache
(vLLM's layout: ``cache[page, slot, kv_head, d]``, the page ids in a per-sequence block
table). Grouped-query attention: the ``G`` query heads sharing a KV head are handled by
one CTA, so each key and value is read from memory once per step.

Split-KV (flash-decoding): the context is cut into chunks of ``C`` tokens, one CTA per
(chunk, KV head, sequence), so a single long sequence still spreads over every SM. Each
CTA writes its chunk's normalized output and log-sum-exp; :class:`AttentionCombine`
merges the chunks. A context that fits one chunk skips the combine: the CTA writes the
bf16 output itself (``direct``).

Inside a CTA every ``D / 8`` lanes own one token at a time (16 bytes of its key and of
its value per lane), so one warp covers ``256 / D`` tokens per step; the ``U`` steps of
an iteration issue all their loads before any math. Scores are float32 dot products
(shuffles within the token's lanes), the softmax is online in base 2 (the scale times
log2(e) is folded into the query), and the per-token-slot states meet in shared memory
at the end.
"""

# mypy: ignore-errors
# The DSL rewrites these functions' Python AST at trace time (see _cute.py).

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from agentload.kernels._cute import V, _vec_atom

NEG_INIT = -1.0e30  #: finite start for running maxima, so exp2(max_old - max_new) is never NaN


def _cache_vec(t: object, page: object, slot: object, head: object, col: object) -> object:
    """The 8-element vector ``col`` of ``t[page, slot, head, :]`` (a 4-D row-major cache)."""
    return cute.local_tile(t, (1, 1, 1, V), (page, slot, head, col))[0, 0, 0, None]


def _head_vec(t: object, b: object, head: object, col: object) -> object:
    """The 8-element vector ``col`` of ``t[b, head, :]`` (3-D, rows may be strided)."""
    return cute.local_tile(t, (1, 1, V), (b, head, col))[0, 0, None]


class DecodeAttention:
    """Split-KV decode attention over a paged cache, GQA, one CTA per (chunk, kv head, seq).

    Tensors: ``q [B, Hkv * G, D]`` bf16; ``k_cache, v_cache [pages, P, Hkv, D]`` bf16;
    ``block_table [B, max_pages]`` int32; ``seq_lens [B]`` int32; ``o_part [B, Hq, S, D]``
    and ``lse [B, Hq, S]`` float32 (the chunks' normalized outputs and base-2 log-sum-exps);
    ``out [B, Hq, D]`` bf16 (written only when ``direct``: every context fits one chunk).
    With ``fresh``, ``k_new, v_new [B, Hkv, D]`` are the step's own key and value (token
    ``seq_len - 1``): read from there and appended to the cache. ``q``, ``k_new`` and
    ``v_new`` may be column slices of one q/k/v projection output (any batch stride).
    """

    def __init__(self, head_dim: int, group: int, page: int, chunk: int, threads: int,
                 unroll: int, direct: bool, pdl: bool = False, fresh: bool = False,
                 pipe: bool = False) -> None:
        self.D, self.G, self.P, self.C = head_dim, group, page, chunk
        self.T, self.U = threads, unroll
        self.direct, self.pdl, self.fresh, self.pipe = direct, pdl, fresh, pipe
        self.LT = head_dim // V  # lanes per token
        self.TPW = 32 // self.LT  # tokens per warp per step
        self.W = threads // 32
        self.NS = self.W * self.TPW  # token slots per CTA
        self.NIT = chunk // (self.NS * unroll)  # iterations per chunk

    @cute.jit
    def __call__(self, mQ, mK, mV, mBT, mLen, mOP, mLse, mO, mKN, mVN, qscale: Float32,
                 stream):
        b = mQ.shape[0]
        hkv = mK.shape[2]
        splits = mOP.shape[2]
        smem = self.NS * self.G * (self.D + 2) * 4 + 64
        self.kernel(mQ, mK, mV, mBT, mLen, mOP, mLse, mO, mKN, mVN, qscale).launch(
            grid=[splits, hkv, b], block=[self.T, 1, 1], smem=smem, stream=stream,
            use_pdl=self.pdl)

    @cute.jit
    def load_kv(self, mK, mV, mKN, mVN, mBT, b, kvh, li, base, slot, seq_len, kbuf, vbuf):
        """This lane's 16 bytes of key and value of each of the iteration's ``U`` tokens
        (token ``base + u * NS + slot``) into rows of ``kbuf`` / ``vbuf``."""
        ld_q = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_kv = _vec_atom(cute.nvgpu.LoadCacheMode.STREAMING)
        for u in cutlass.range_constexpr(self.U):
            tok = base + u * self.NS + slot
            # past the end: a valid address, masked by the caller
            tc = cutlass.min(tok, seq_len - 1)
            pi = tc // self.P
            page = mBT[b, pi]
            off = tc - pi * self.P
            if cutlass.const_expr(self.fresh):
                # the step's own token: from the projection, not (yet) the cache
                if tok == seq_len - 1:
                    cute.copy(ld_q, _head_vec(mKN, b, kvh, li), kbuf[u, None])
                    cute.copy(ld_q, _head_vec(mVN, b, kvh, li), vbuf[u, None])
                else:
                    cute.copy(ld_kv, _cache_vec(mK, page, off, kvh, li), kbuf[u, None])
                    cute.copy(ld_kv, _cache_vec(mV, page, off, kvh, li), vbuf[u, None])
            else:
                cute.copy(ld_kv, _cache_vec(mK, page, off, kvh, li), kbuf[u, None])
                cute.copy(ld_kv, _cache_vec(mV, page, off, kvh, li), vbuf[u, None])

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBT: cute.Tensor,
               mLen: cute.Tensor, mOP: cute.Tensor, mLse: cute.Tensor, mO: cute.Tensor,
               mKN: cute.Tensor, mVN: cute.Tensor, qscale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, kvh, b = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        G: cutlass.Constexpr = self.G
        U: cutlass.Constexpr = self.U
        D: cutlass.Constexpr = self.D
        P: cutlass.Constexpr = self.P
        NS: cutlass.Constexpr = self.NS
        LT: cutlass.Constexpr = self.LT
        sub = lane // LT
        li = lane - sub * LT  # this lane's 8-wide slice of the head dimension
        slot = warp * self.TPW + sub  # this lane group's token slot in the CTA
        ld_q = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        smem = cutlass.utils.SmemAllocator()
        s_acc = smem.allocate_tensor(
            Float32, cute.make_layout((NS, G, D), stride=(G * D, D, 1)), byte_alignment=16)
        s_ml = smem.allocate_tensor(
            Float32, cute.make_layout((NS, G, 2), stride=(G * 2, 2, 1)), byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        seq_len = mLen[b]
        t0 = split * self.C
        if t0 < seq_len:
            qf = cute.make_rmem_tensor(cute.make_layout((G, V), stride=(V, 1)), Float32)
            for g in cutlass.range_constexpr(G):
                qr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(ld_q, _head_vec(mQ, b, kvh * G + g, li), qr)
                qv = qr.load().to(Float32) * qscale
                for v in cutlass.range_constexpr(V):
                    qf[g, v] = qv[v]
            run_max = cute.make_rmem_tensor(cute.make_layout((G,)), Float32)
            run_sum = cute.make_rmem_tensor(cute.make_layout((G,)), Float32)
            acc = cute.make_rmem_tensor(cute.make_layout((G, V), stride=(V, 1)), Float32)
            run_max.fill(NEG_INIT)
            run_sum.fill(0.0)
            acc.fill(0.0)
            stop = cutlass.min(seq_len, t0 + self.C)
            if cutlass.const_expr(self.fresh):  # noqa: SIM102 (a compile-time if: kept apart)
                # The CTA whose chunk holds the step's token appends its key and value to
                # the cache (vLLM's reshape_and_cache, folded in); no CTA reads that slot.
                if stop == seq_len and tidx < LT:
                    last = seq_len - 1
                    lp = last // P
                    kn = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    vn = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    cute.copy(ld_q, _head_vec(mKN, b, kvh, tidx), kn)
                    cute.copy(ld_q, _head_vec(mVN, b, kvh, tidx), vn)
                    st = _vec_atom()
                    cute.copy(st, kn, _cache_vec(mK, mBT[b, lp], last - lp * P, kvh, tidx))
                    cute.copy(st, vn, _cache_vec(mV, mBT[b, lp], last - lp * P, kvh, tidx))
            if cutlass.const_expr(self.pipe):  # the next iteration's keys and values
                kbuf = cute.make_rmem_tensor(cute.make_layout((U, V), stride=(V, 1)), BFloat16)
                vbuf = cute.make_rmem_tensor(cute.make_layout((U, V), stride=(V, 1)), BFloat16)
                self.load_kv(mK, mV, mKN, mVN, mBT, b, kvh, li, t0, slot, seq_len, kbuf, vbuf)
            for it in cutlass.range(self.NIT):
                base = t0 + it * (NS * U)
                if base < stop:
                    # Every load of the iteration first (keys and values of U tokens), then
                    # math; with pipe, this iteration's were issued during the last one's
                    # math, and the next iteration's go out now.
                    ks = cute.make_rmem_tensor(cute.make_layout((U, V), stride=(V, 1)), BFloat16)
                    vs = cute.make_rmem_tensor(cute.make_layout((U, V), stride=(V, 1)), BFloat16)
                    if cutlass.const_expr(self.pipe):
                        ks.store(kbuf.load())
                        vs.store(vbuf.load())
                        if base + NS * U < stop:
                            self.load_kv(mK, mV, mKN, mVN, mBT, b, kvh, li, base + NS * U,
                                         slot, seq_len, kbuf, vbuf)
                    else:
                        self.load_kv(mK, mV, mKN, mVN, mBT, b, kvh, li, base, slot, seq_len,
                                     ks, vs)
                    toks = []
                    for u in cutlass.range_constexpr(U):
                        toks.append(base + u * NS + slot)
                    scores = cute.make_rmem_tensor(cute.make_layout((U, G), stride=(G, 1)), Float32)
                    for u in cutlass.range_constexpr(U):
                        kf = ks[u, None].load().to(Float32)
                        for g in cutlass.range_constexpr(G):
                            dot = Float32(0.0)
                            for v in cutlass.range_constexpr(V):
                                dot = dot + qf[g, v] * kf[v]
                            dot = cute.arch.warp_reduction(dot, operator.add, threads_in_group=LT)
                            if toks[u] >= stop:
                                dot = Float32(-float("inf"))
                            scores[u, g] = dot
                    for g in cutlass.range_constexpr(G):
                        new_max = run_max[g]
                        for u in cutlass.range_constexpr(U):
                            new_max = cute.arch.fmax(new_max, scores[u, g])
                        corr = cute.math.exp2(run_max[g] - new_max, fastmath=True)
                        run_max[g] = new_max
                        ssum = run_sum[g] * corr
                        for v in cutlass.range_constexpr(V):
                            acc[g, v] = acc[g, v] * corr
                        for u in cutlass.range_constexpr(U):
                            p = cute.math.exp2(scores[u, g] - new_max, fastmath=True)
                            ssum = ssum + p
                            vf = vs[u, None].load().to(Float32)
                            for v in cutlass.range_constexpr(V):
                                acc[g, v] = acc[g, v] + p * vf[v]
                        run_sum[g] = ssum
            # Token slots meet in shared memory; each thread then merges whole outputs.
            for g in cutlass.range_constexpr(G):
                for v in cutlass.range_constexpr(V):
                    s_acc[slot, g, li * V + v] = acc[g, v]
                if li == 0:
                    s_ml[slot, g, 0] = run_max[g]
                    s_ml[slot, g, 1] = run_sum[g]
            cute.arch.sync_threads()
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            for e in cutlass.range_constexpr((G * D + self.T - 1) // self.T):
                idx = e * self.T + tidx
                if idx < G * D:
                    g = idx // D
                    d = idx - g * D
                    top = Float32(NEG_INIT)
                    for s in cutlass.range_constexpr(NS):
                        top = cute.arch.fmax(top, s_ml[s, g, 0])
                    den = Float32(0.0)
                    num = Float32(0.0)
                    for s in cutlass.range_constexpr(NS):
                        w = cute.math.exp2(s_ml[s, g, 0] - top, fastmath=True)
                        den = den + w * s_ml[s, g, 1]
                        num = num + w * s_acc[s, g, d]
                    o = num / den
                    if cutlass.const_expr(self.direct):
                        mO[b, kvh * G + g, d] = o.to(BFloat16)
                    else:
                        mOP[b, kvh * G + g, split, d] = o
                        if d == 0:
                            mLse[b, kvh * G + g, split] = top + cute.math.log2(den, fastmath=True)


class AttentionCombine:
    """Merge the chunks of :class:`DecodeAttention`: ``out = sum_s 2^lse_s o_s / sum_s 2^lse_s``.

    One CTA per (query head, sequence); each warp streams every ``W``-th chunk (16 bytes
    of ``o_s`` per lane, so ``D / 4`` lanes per chunk row), merging online, and the warps
    meet in shared memory. The number of chunks of sequence ``b`` is
    ``ceil(seq_lens[b] / C)``.
    """

    def __init__(self, head_dim: int, chunk: int, threads: int, pdl: bool = False) -> None:
        self.D, self.C, self.T, self.pdl = head_dim, chunk, threads, pdl
        self.LR = head_dim // 4  # lanes per chunk row (4 floats each)
        self.RPW = 32 // self.LR  # chunk rows per warp per step
        self.R = (threads // 32) * self.RPW  # chunk rows in flight per CTA

    @cute.jit
    def __call__(self, mOP, mLse, mLen, mO, stream):
        b, hq = mO.shape[0], mO.shape[1]
        smem = self.R * (self.D + 2) * 4 + 64
        self.kernel(mOP, mLse, mLen, mO).launch(grid=[hq, b, 1], block=[self.T, 1, 1],
                                                smem=smem, stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOP: cute.Tensor, mLse: cute.Tensor, mLen: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        hq, b, _ = cute.arch.block_idx()
        D: cutlass.Constexpr = self.D
        R: cutlass.Constexpr = self.R
        LR: cutlass.Constexpr = self.LR
        row = tidx // LR
        li = tidx - row * LR
        smem = cutlass.utils.SmemAllocator()
        s_acc = smem.allocate_tensor(Float32, cute.make_layout((R, D), stride=(D, 1)),
                                     byte_alignment=16)
        s_ml = smem.allocate_tensor(Float32, cute.make_layout((R, 2), stride=(2, 1)),
                                    byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        n = (mLen[b] + self.C - 1) // self.C
        top = Float32(NEG_INIT)
        den = Float32(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        acc.fill(0.0)
        for s in cutlass.range(row, n, R, unroll=4):
            lse = mLse[b, hq, s]
            part = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
            cute.autovec_copy(cute.local_tile(mOP, (1, 1, 1, 4), (b, hq, s, li))[0, 0, 0, None],
                              part)
            new_top = cute.arch.fmax(top, lse)
            corr = cute.math.exp2(top - new_top, fastmath=True)
            w = cute.math.exp2(lse - new_top, fastmath=True)
            den = den * corr + w
            for v in cutlass.range_constexpr(4):
                acc[v] = acc[v] * corr + w * part[v]
            top = new_top
        for v in cutlass.range_constexpr(4):
            s_acc[row, li * 4 + v] = acc[v]
        if li == 0:
            s_ml[row, 0] = top
            s_ml[row, 1] = den
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        for e in cutlass.range_constexpr((D + self.T - 1) // self.T):
            d = e * self.T + tidx
            if d < D:
                best = Float32(NEG_INIT)
                for r in cutlass.range_constexpr(R):
                    best = cute.arch.fmax(best, s_ml[r, 0])
                tot = Float32(0.0)
                num = Float32(0.0)
                for r in cutlass.range_constexpr(R):
                    w = cute.math.exp2(s_ml[r, 0] - best, fastmath=True)
                    tot = tot + w * s_ml[r, 1]
                    num = num + w * s_acc[r, d]
                mO[b, hq, d] = (num / tot).to(BFloat16)
