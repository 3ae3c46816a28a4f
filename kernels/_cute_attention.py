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
from cutlass import BFloat16, Float32, Int32

from agentload.kernels._cute import V, _mma_k16, _vec_atom
from agentload.kernels.specs import mma_attention_smem

NEG_INIT = -1.0e30  #: finite start for running maxima, so exp2(max_old - max_new) is never NaN


def _cache_vec(t: object, page: object, slot: object, head: object, col: object) -> object:
    """The 8-element vector ``col`` of ``t[page, slot, head, :]`` (a 4-D row-major cache)."""
    return cute.local_tile(t, (1, 1, 1, V), (page, slot, head, col))[0, 0, 0, None]


def _head_vec(t: object, b: object, head: object, col: object) -> object:
    """The 8-element vector ``col`` of ``t[b, head, :]`` (3-D, rows may be strided)."""
    return cute.local_tile(t, (1, 1, V), (b, head, col))[0, 0, None]


def _append_token(mKN, mVN, mK, mV, mBT, b, head, col, seq_len, page: int) -> None:
    """The step's own key and value (vector ``col`` of ``head`` in ``k_new``/``v_new``)
    written to the cache at token ``seq_len - 1``: vLLM's ``reshape_and_cache``, folded
    into the attention kernel."""
    last = seq_len - 1
    lp = last // page
    ld = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
    kn = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
    vn = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
    cute.copy(ld, _head_vec(mKN, b, head, col), kn)
    cute.copy(ld, _head_vec(mVN, b, head, col), vn)
    st = _vec_atom()
    cute.copy(st, kn, _cache_vec(mK, mBT[b, lp], last - lp * page, head, col))
    cute.copy(st, vn, _cache_vec(mV, mBT[b, lp], last - lp * page, head, col))


def _softmax_state(columns: int) -> tuple[list[object], object, object]:
    """A warp's fresh online-softmax state: ``columns / 8`` m16n8 accumulators of ``O``
    (zeros), and the running max and sum of the MMA's two row halves."""
    acc_o = []
    for _n in range(columns // 8):
        a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        a.fill(0.0)
        acc_o.append(a)
    run_max = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
    run_sum = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
    run_max.fill(NEG_INIT)
    run_sum.fill(0.0)
    return acc_o, run_max, run_sum


def _lse_weights(top: object, lse: object) -> tuple[object, object, object]:
    """One more partial (log-sum-exp ``lse``) into a merge whose running max is ``top``:
    the new max, the factor the sums so far take, and the partial's weight."""
    new_top = cute.arch.fmax(top, lse)
    return (new_top, cute.math.exp2(top - new_top, fastmath=True),
            cute.math.exp2(lse - new_top, fastmath=True))


@cute.jit
def _online_softmax(acc_s, acc_o, run_max, run_sum, base, stop, qscale, t, hi: bool):
    """One 16-token tile's scores (``acc_s``: two ``m16n8k16`` accumulators, c0, c1 =
    head g at tokens 8 r + 2t + (0, 1), c2, c3 = head g + 8) into the online softmax:
    tokens from ``stop`` on masked, the running max and this lane's share of the sum
    updated (the quad's shares add up at the end), ``acc_o`` rescaled. Returns P as the
    next MMA's A fragment (16 heads x 16 tokens: a0a1 = [g, 2t..], a2a3 = [g + 8, 2t..],
    a4a5 = [g, 2t + 8..], a6a7 = [g + 8, 2t + 8..], the order the scores already have);
    without ``hi`` the MMA's rows 8-15 hold no heads and are zeros."""
    p = cute.make_rmem_tensor(cute.make_layout((8,)), Float32)  # [r, row, q]
    for h in cutlass.range_constexpr(2 if hi else 1):
        top = run_max[h]
        for r in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(2):
                sv = acc_s[r][2 * h + q] * qscale
                if base + 8 * r + 2 * t + q >= stop:
                    sv = Float32(-float("inf"))
                p[r * 4 + h * 2 + q] = sv
                top = cute.arch.fmax(top, sv)
        top = cute.arch.warp_reduction(top, cute.arch.fmax, threads_in_group=4)
        corr = cute.math.exp2(run_max[h] - top, fastmath=True)
        run_max[h] = top
        ssum = run_sum[h] * corr
        for r in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(2):
                e = cute.math.exp2(p[r * 4 + h * 2 + q] - top, fastmath=True)
                p[r * 4 + h * 2 + q] = e
                ssum = ssum + e
        run_sum[h] = ssum
        for n in cutlass.range_constexpr(len(acc_o)):
            for q in cutlass.range_constexpr(2):
                acc_o[n][2 * h + q] = acc_o[n][2 * h + q] * corr
    if cutlass.const_expr(not hi):
        for r in cutlass.range_constexpr(2):
            for q in cutlass.range_constexpr(2):
                p[r * 4 + 2 + q] = 0.0
    pa = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), BFloat16)
    pa.store(p.load().to(BFloat16))
    return pa


@cute.jit
def _pv_mma(atom, acc_o, blk, pa, vs):
    """``O += P V`` for one 64-wide block of value columns: ``vs`` are this lane's 16-byte
    loads of tokens 2t, 2t + 1, 2t + 8, 2t + 9 (B = V, 16 tokens x 8 columns: b0b1, b2b3),
    and the lane's column of n-tile i is element i of each load."""
    for i in cutlass.range_constexpr(V):
        bv = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), BFloat16)
        for q in cutlass.range_constexpr(4):
            bv[q] = vs[q][i]
        cute.gemm(atom, acc_o[blk * V + i], pa, bv, acc_o[blk * V + i])


@cute.jit
def _merge_states(s_acc, s_ml, parts: int, group: int, dim: int, threads: int, tidx,
                  direct: bool, mO, mOP, mLse, b, kvh, split, sl, heads: int = 1,
                  maybe_empty: bool = False):
    """The CTA's ``parts`` softmax states in shared memory (``s_acc[part, head, d]``
    un-normalized, ``s_ml[part, head]`` = running max, sum) merged into whole outputs,
    each thread a column at a time: the bf16 output (``direct``), or this chunk's
    normalized output and log-sum-exp for the combine. ``sl``: which ``dim`` value
    columns of the head (MLA's slices; 0 otherwise), the one that writes the lse.
    ``heads``: KV heads the CTA holds (``kvh`` the first); head ``kvh + i``'s states are
    the parts ``w`` with ``w % heads == i``. ``maybe_empty``: the CTA may have seen no
    token (a dynamic split): its output is then 0 with a log-sum-exp of -inf."""
    per: cutlass.Constexpr = parts // heads
    for e in cutlass.range_constexpr((heads * group * dim + threads - 1) // threads):
        idx = e * threads + tidx
        if idx < heads * group * dim:
            hh = idx // dim  # query head within the CTA's KV heads
            d = idx - hh * dim
            hc = 0
            gh = hh
            if cutlass.const_expr(heads > 1):
                hc = hh // group
                gh = hh - hc * group
            top = Float32(NEG_INIT)
            for j in cutlass.range_constexpr(per):
                top = cute.arch.fmax(top, s_ml[hc + heads * j, gh, 0])
            den = Float32(0.0)
            num = Float32(0.0)
            for j in cutlass.range_constexpr(per):
                w = hc + heads * j
                wt = cute.math.exp2(s_ml[w, gh, 0] - top, fastmath=True)
                den = den + wt * s_ml[w, gh, 1]
                num = num + wt * s_acc[w, gh, d]
            if cutlass.const_expr(maybe_empty):
                den = cute.arch.fmax(den, Float32(1.0e-30))  # no token: 0, never 0 / 0
            o = num / den
            if cutlass.const_expr(direct):
                mO[b, kvh * group + hh, sl * dim + d] = o.to(BFloat16)
            else:
                mOP[b, kvh * group + hh, split, sl * dim + d] = o
                if d == 0 and sl == 0:
                    mLse[b, kvh * group + hh, split] = top + cute.math.log2(den, fastmath=True)


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
                # the step's own token (and padding clamped to it): from the projection,
                # not the cache slot this CTA is writing
                if tok >= seq_len - 1:
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
                    _append_token(mKN, mVN, mK, mV, mBT, b, kvh, tidx, seq_len, P)
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
            _merge_states(s_acc, s_ml, NS, G, D, self.T, tidx, self.direct, mO, mOP, mLse, b,
                          kvh, split, 0)


class AttentionCombine:
    """Merge the chunks of :class:`DecodeAttention`: ``out = sum_s 2^lse_s o_s / sum_s 2^lse_s``.

    One CTA per (query head, sequence); each warp streams every ``W``-th chunk (``E``
    floats of ``o_s`` per lane: 4, or ``D / 32`` for rows wider than 128, so ``D / E``
    lanes per chunk row), merging online, and the warps
    meet in shared memory. The number of chunks of sequence ``b`` is
    ``ceil(seq_lens[b] / C)``.
    """

    def __init__(self, head_dim: int, chunk: int, threads: int, pdl: bool = False,
                 every: bool = False) -> None:
        self.D, self.C, self.T, self.pdl = head_dim, chunk, threads, pdl
        self.every = every  # merge every partial (dynamic split: one per CTA, not chunk)
        self.E = max(4, head_dim // 32)  # floats per lane
        self.LR = head_dim // self.E  # lanes per chunk row
        self.RPW = 32 // self.LR  # chunk rows per warp per step
        self.R = (threads // 32) * self.RPW  # chunk rows in flight per CTA

    @cute.jit
    def __call__(self, mOP, mLse, mLen, mO, stream):
        self.launch(mOP, mLse, mLen, mO, mLen, stream)  # no counters: mLen stands in

    @cute.jit
    def launch(self, mOP, mLse, mLen, mO, mCnt, stream):
        b, hq = mO.shape[0], mO.shape[1]
        smem = self.R * (self.D + 2) * 4 + 64
        self.kernel(mOP, mLse, mLen, mO, mCnt).launch(
            grid=[hq, b, 1], block=[self.T, 1, 1], smem=smem, stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOP: cute.Tensor, mLse: cute.Tensor, mLen: cute.Tensor, mO: cute.Tensor,
               mCnt: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        hq, b, _ = cute.arch.block_idx()
        D: cutlass.Constexpr = self.D
        R: cutlass.Constexpr = self.R
        LR: cutlass.Constexpr = self.LR
        E: cutlass.Constexpr = self.E
        row = tidx // LR
        li = tidx - row * LR
        smem = cutlass.utils.SmemAllocator()
        s_acc = smem.allocate_tensor(Float32, cute.make_layout((R, D), stride=(D, 1)),
                                     byte_alignment=16)
        s_ml = smem.allocate_tensor(Float32, cute.make_layout((R, 2), stride=(2, 1)),
                                    byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.every):
            n = mOP.shape[2]
            # the dynamic split's tile counters of this sequence, re-armed for the next
            # step (every CTA of the attention is done: stream order, or PDL's wait)
            hkv = mCnt.shape[0] // mO.shape[0]
            if hq == 0 and tidx < hkv:
                mCnt[b * hkv + tidx] = Int32(0)
        else:
            n = (mLen[b] + self.C - 1) // self.C
        top = Float32(NEG_INIT)
        den = Float32(0.0)
        acc = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
        acc.fill(0.0)
        for s in cutlass.range(row, n, R, unroll=4):
            lse = mLse[b, hq, s]
            part = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
            cute.autovec_copy(cute.local_tile(mOP, (1, 1, 1, E), (b, hq, s, li))[0, 0, 0, None],
                              part)
            new_top, corr, w = _lse_weights(top, lse)
            den = den * corr + w
            for v in cutlass.range_constexpr(E):
                acc[v] = acc[v] * corr + w * part[v]
            top = new_top
        for v in cutlass.range_constexpr(E):
            s_acc[row, li * E + v] = acc[v]
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


class AttentionCombineEvery(AttentionCombine):
    """:class:`AttentionCombine` over every partial (one per CTA of the dynamic split,
    whatever the length), which also zeroes the split's tile counters ``cnt [B * Hkv]``
    int32 for the next step."""

    def __init__(self, head_dim: int, chunk: int, threads: int, pdl: bool = False) -> None:
        super().__init__(head_dim, chunk, threads, pdl, every=True)

    @cute.jit
    def __call__(self, mOP, mLse, mLen, mO, mCnt, stream):
        self.launch(mOP, mLse, mLen, mO, mCnt, stream)


class DecodeAttentionMma:
    """Split-KV decode attention on tensor cores, KV streamed by ``cp.async`` (GQA).

    Same tensors, grid and outputs as :class:`DecodeAttention`, for ``D`` a multiple of
    64, up to 16 query heads per KV head and pages of a multiple of 16 tokens. ``latent``
    is MLA (DeepSeek-V3 / Kimi, projections absorbed): one KV head whose key is
    ``D`` wide (latent + rope, e.g. 512 + 64) and whose value is the key's first ``DV``
    columns (``v_cache`` unread); the value columns are split over ``DV / 128`` CTAs per
    chunk (each scores the whole key; the chunk's bytes come from L2 after the first).
    Each warp
    takes tiles of 16 tokens (one page's worth or less, so one block-table entry per
    tile); the CTA's page ids sit in shared memory. A tile's keys and values go to this
    lane's own slots of shared memory with ``cp.async``, ``S - 1`` tiles ahead of the
    math, so the bytes in flight do not hold registers and no barrier is needed (a lane
    reads back only what it copied).

    Math per tile, ``mma.sync.m16n8k16`` with the query heads as the MMA's 16 rows:
    ``S = Q K^T`` takes each key row straight from its 16-byte loads (the head dimension
    is the reduction, so the same permutation of it in Q and K is free, as in
    :meth:`Gemv.mma_loop`); the accumulator of ``S`` is already the A fragment of
    ``O += P V`` (FlashAttention-2's register reuse). For ``V`` as B the lane loads 8
    head-dim values of the 4 tokens its fragment needs and pairs them by token; the
    n-tile ``i`` of a 64-wide block then holds columns ``8 j + i``.
    """

    def __init__(self, head_dim: int, group: int, page: int, chunk: int, warps: int,
                 stages: int, direct: bool, pdl: bool = False, fresh: bool = False,
                 value_dim: int = 0, latent: bool = False, merge: bool = False,
                 kv_heads: int = 1, lines: bool = False, timeline: bool = False,
                 dynamic: bool = False, dynamic_fixed: int = 0) -> None:
        self.D, self.G, self.P, self.C = head_dim, group, page, chunk
        # timeline (a diagnostic): thread 0 stamps %globaltimer at the CTA's phases and
        # writes the stamps over its first head's partial output (kernels.tools.attn_probe)
        self.TL = timeline
        # dynamic: the CTAs of a (sequence, KV head) take its tiles from a shared counter
        # (see run_dynamic) instead of a chunk each
        self.DYN = dynamic
        self.DFX = dynamic_fixed  # quarters of a warp's even share dealt out statically
        self.HC = kv_heads  # KV heads per CTA: warp w takes head w % HC of the CTA's
        self.WH = warps // kv_heads  # warps per KV head
        # lines: a tile's keys copied in whole 128-byte lines (row-major in the stage,
        # 16-byte chunks swizzled), read back by the MMA's lanes after a warp barrier
        self.KL = lines
        self.CPT = head_dim // V  # 16-byte chunks per key row
        self.DV = value_dim or head_dim
        self.DVS = 128 if latent else self.DV  # value columns per CTA
        self.NSL = self.DV // self.DVS  # CTAs per (chunk, KV head)
        self.latent = latent
        self.W, self.S = warps, stages
        self.T = warps * 32
        self.direct, self.pdl, self.fresh = direct, pdl, fresh
        self.merge = merge and not direct  # the last CTA of a (sequence, KV head) merges
        self.NC = head_dim // 32  # 32-wide head-dim chunks: 16-byte K loads per token row
        self.NB = self.DVS // 64  # 64-wide blocks: 16-byte V loads per token
        self.NK = 2 * self.NC  # K vectors per lane per tile (two n-tiles of 8 tokens)
        self.NV = self.NK + 4 * self.NB  # + V vectors (4 tokens per lane)
        self.HI = group > 8  # the MMA's rows 8-15 hold real heads
        self.QS = self.NC > 8  # Q's fragments in shared memory (registers for wide keys)

    @cute.jit
    def __call__(self, mQ, mK, mV, mBT, mLen, mOP, mLse, mO, mKN, mVN, mCnt,
                 qscale: Float32, stream):
        b = mQ.shape[0]
        hkv = mK.shape[2]
        splits = mOP.shape[2]
        smem = mma_attention_smem(self.D, self.G, self.P, self.C, self.W, self.S, self.DV,
                                  self.latent)
        grid = [splits, hkv // self.HC * self.NSL, b]
        if cutlass.const_expr(self.DYN):  # every head's first CTA launched before any second
            grid = [hkv // self.HC * self.NSL, b, splits]
        self.kernel(mQ, mK, mV, mBT, mLen, mOP, mLse, mO, mKN, mVN, mCnt, qscale).launch(
            grid=grid, block=[self.T, 1, 1], smem=smem, stream=stream, use_pdl=self.pdl)

    @cute.jit
    def issue(self, mK, mV, s_kv, s_bt, b, kvh, sl, t0, stop, k, stage, warp, lane):
        """``cp.async`` this lane's key and value vectors of tile ``k`` (tokens
        ``t0 + 16 k ..``, its page id in ``s_bt``) into its slots of ``stage``."""
        base = t0 + 16 * k
        if base < stop:
            self.issue_page(mK, mV, s_kv, s_bt[(16 * k) // self.P], (16 * k) % self.P,
                            base, stop, kvh, sl, stage, warp, lane)

    @cute.jit
    def issue_page(self, mK, mV, s_kv, page, slot0, base, stop, kvh, sl, stage, warp, lane):
        """``cp.async`` the tile of tokens ``base ..`` (``base < stop``), slots
        ``slot0 ..`` of ``page``, into this lane's slots of ``stage``; tokens past ``stop``
        read the last valid one (finite values, weighted 0)."""
        g = lane // 4
        t = lane - g * 4
        cp = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
            num_bits_per_copy=128)
        last = stop - 1 - base  # the tile's last valid token
        if cutlass.const_expr(self.KL):
            # consecutive lanes on consecutive chunks of a row: whole lines per copy
            for m in cutlass.range_constexpr(self.NK):
                e = m * 32 + lane
                tok = e // self.CPT
                ch = e - tok * self.CPT
                es = self.k_slot(tok, ch)
                cute.copy(cp, _cache_vec(mK, page, slot0 + cutlass.min(tok, last), kvh, ch),
                          s_kv[warp, stage, es // 32, es % 32, None])
        else:
            for r in cutlass.range_constexpr(2):
                off = slot0 + cutlass.min(8 * r + g, last)
                for c in cutlass.range_constexpr(self.NC):
                    cute.copy(cp, _cache_vec(mK, page, off, kvh, c * 4 + t),
                              s_kv[warp, stage, r * self.NC + c, lane, None])
        for q in cutlass.range_constexpr(4):
            off = slot0 + cutlass.min((q // 2) * 8 + 2 * t + q % 2, last)
            for blk in cutlass.range_constexpr(self.NB):
                # MLA: the value is the key's latent prefix, this CTA's columns of it
                src = mK if self.latent else mV
                col = sl * (self.DVS // V) + blk * 8 + g
                cute.copy(cp, _cache_vec(src, page, off, kvh, col),
                          s_kv[warp, stage, self.NK + q * self.NB + blk, lane, None])

    def k_slot(self, tok, ch):
        """Where chunk ``ch`` of key row ``tok`` sits in a stage with ``lines``, in 16-byte
        vectors: row-major, the chunk's bit 2 flipped on odd rows, so the MMA's reads
        (rows g and g + 1, four chunks each, per 8 lanes) fall in distinct banks."""
        return tok * self.CPT + (ch ^ ((tok & 1) << 2))

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBT: cute.Tensor,
               mLen: cute.Tensor, mOP: cute.Tensor, mLse: cute.Tensor, mO: cute.Tensor,
               mKN: cute.Tensor, mVN: cute.Tensor, mCnt: cute.Tensor, qscale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, hy, b = cute.arch.block_idx()
        if cutlass.const_expr(self.DYN):
            hy, b, split = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        kv0 = hy // self.NSL  # the CTA's first KV head
        sl = hy - kv0 * self.NSL  # which DVS value columns
        kvh = kv0  # this warp's KV head, and its place among that head's warps
        wt = warp
        if cutlass.const_expr(self.HC > 1):
            kv0 = kv0 * self.HC
            hc = warp % self.HC
            kvh = kv0 + hc
            wt = warp // self.HC
        G: cutlass.Constexpr = self.G
        D: cutlass.Constexpr = self.D
        DVS: cutlass.Constexpr = self.DVS
        P: cutlass.Constexpr = self.P
        S: cutlass.Constexpr = self.S
        NC: cutlass.Constexpr = self.NC
        NV: cutlass.Constexpr = self.NV
        W: cutlass.Constexpr = self.W
        WH: cutlass.Constexpr = self.WH
        g = lane // 4
        t = lane - g * 4
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        smem = cutlass.utils.SmemAllocator()
        s_kv = smem.allocate_tensor(
            BFloat16, cute.make_layout((W, S, NV, 32, V),
                                       stride=(S * NV * 32 * V, NV * 32 * V, 32 * V, V, 1)),
            byte_alignment=128)
        s_bt = smem.allocate_tensor(Int32, cute.make_layout((self.C // P,)), byte_alignment=16)
        s_acc = smem.allocate_tensor(
            Float32, cute.make_layout((W, G, DVS), stride=(G * DVS, DVS, 1)), byte_alignment=16)
        s_ml = smem.allocate_tensor(
            Float32, cute.make_layout((W, G, 2), stride=(G * 2, 2, 1)), byte_alignment=16)
        s_flag = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=16)
        s_q = None
        if cutlass.const_expr(self.QS):
            s_q = smem.allocate_tensor(
                BFloat16, cute.make_layout((NC, 2, 32, V), stride=(64 * V, 32 * V, V, 1)),
                byte_alignment=16)
        stamp0 = Int32(0)
        if cutlass.const_expr(self.TL):
            stamp0 = cute.arch.globaltimer_lo()
        stamp1 = stamp0
        stamp2 = stamp0
        stamp3 = stamp0
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        seq_len = mLen[b]
        t0 = split * self.C
        # the length, Q and the page ids in flight together: the ids are read up to the
        # chunk's end or the table's, whatever the length
        q_lo, q_hi = self.q_fragments(mQ, s_q, b, kvh, warp, g, t, lane)
        if cutlass.const_expr(self.DYN):
            stamp1, stamp2, stamp3 = self.run_dynamic(
                atom, q_lo, q_hi, s_q, s_kv, s_acc, s_ml, mK, mV, mBT, mOP, mLse, mO, mCnt, b,
                kvh, sl, split, seq_len, warp, lane, g, t, tidx, qscale)
        else:
            for i in cutlass.range(tidx, cutlass.min(self.C // P, mBT.shape[1] - t0 // P), self.T):
                s_bt[i] = mBT[b, t0 // P + i]
            if t0 < seq_len:
                stop = cutlass.min(seq_len, t0 + self.C)
                if cutlass.const_expr(self.fresh):  # noqa: SIM102 (a compile-time if: kept apart)
                    # The step's own key and value go to the cache first; the barrier below
                    # makes them visible to this CTA's cp.async reads (through L2).
                    if stop == seq_len and tidx < self.HC * (D // V):
                        nh = kv0  # the CTA's KV head whose column this thread appends
                        col = tidx
                        if cutlass.const_expr(self.HC > 1):
                            nh = kv0 + tidx // (D // V)
                            col = tidx % (D // V)
                        _append_token(mKN, mVN, mK, mV, mBT, b, nh, col, seq_len, P)
                cute.arch.sync_threads()  # page ids, the step's own key and Q's fragments
                if cutlass.const_expr(self.TL):
                    stamp1 = cute.arch.globaltimer_lo()
                # O: n-tile (block, i) holds columns 64 block + 8 j + i, j = 2t, 2t + 1.
                acc_o, run_max, run_sum = _softmax_state(DVS)
                for k in cutlass.range_constexpr(S - 1):
                    self.issue(mK, mV, s_kv, s_bt, b, kvh, sl, t0, stop, k * WH + wt, k, warp,
                               lane)
                    cute.arch.cp_async_commit_group()
                # the chunk's live iterations only (a short context in a long chunk)
                for it in cutlass.range((stop - t0 + 16 * WH - 1) // (16 * WH)):
                    k = it * WH + wt
                    cute.arch.cp_async_wait_group(S - 2)
                    if cutlass.const_expr(self.KL):
                        # other lanes' copies of this tile landed; every lane is done reading
                        # the stage the issue below overwrites
                        cute.arch.sync_warp()
                    if cutlass.const_expr(self.TL):  # noqa: SIM102
                        if it == 0:
                            stamp2 = cute.arch.globaltimer_lo()
                    # the tile S - 1 ahead, into the stage read in the previous iteration
                    self.issue(mK, mV, s_kv, s_bt, b, kvh, sl, t0, stop, k + (S - 1) * WH,
                               (it + S - 1) % S, warp, lane)
                    cute.arch.cp_async_commit_group()
                    base = t0 + 16 * k
                    if base < stop:
                        self.tile(atom, q_lo, q_hi, s_q, s_kv, it % S, warp, lane, acc_o, run_max,
                                  run_sum, base, stop, qscale)
                cute.arch.cp_async_wait_group(0)
                if cutlass.const_expr(self.TL):
                    stamp3 = cute.arch.globaltimer_lo()
                self.epilogue(acc_o, run_max, run_sum, s_acc, s_ml, mOP, mLse, mO, b, kv0, sl,
                              split, warp, g, t, tidx)
                if cutlass.const_expr(self.merge):
                    self.merge_if_last(mOP, mLse, mO, mCnt, s_flag, b, kv0, mK.shape[2], seq_len,
                                       tidx)
        if cutlass.const_expr(self.TL):
            cute.arch.sync_threads()  # every thread's outputs written: the CTA's end
            if tidx == 0:
                stamps = (stamp0, stamp1, stamp2, stamp3, cute.arch.globaltimer_lo())
                for i in cutlass.range_constexpr(5):
                    # 24 bits: exact in a float32; the host unwraps them
                    mOP[b, kv0 * G, split, i] = Float32(stamps[i] & 0xFFFFFF)
                mOP[b, kv0 * G, split, 5] = Float32(cute.arch.smid())

    @cute.jit
    def run_dynamic(self, atom, q_lo, q_hi, s_q, s_kv, s_acc, s_ml, mK, mV, mBT, mOP, mLse,
                    mO, mCnt, b, kvh, sl, split, seq_len, warp, lane, g, t, tidx, qscale):
        """The dynamic split: the ``slots`` CTAs of a (sequence, KV head) share its
        16-token tiles, so a CTA on a slower SM takes fewer (a static chunk each leaves the
        fast ones idle while the slow ones finish). Each warp's first two tiles are fixed
        (no atomic on the ramp), or with ``DFX`` that many quarters of its even share;
        later ones come one at a time from the (sequence, KV head) counter ``mCnt[ci]``.
        A tile is taken two iterations before its ``cp.async``: at the end of an
        iteration (ptxas makes the warp wait for the atomic's return right there, which
        the wait for the next tile's data then covers); its page id is read before the
        next iteration's math, which hides that latency. Two stages. The CTA's state
        covers whatever it took, written as one partial (slot ``split``);
        :class:`AttentionCombineEvery` re-arms the counters. Returns the timeline's stamps
        (prologue, first tile, last)."""
        P: cutlass.Constexpr = self.P
        WH: cutlass.Constexpr = self.WH
        DVS: cutlass.Constexpr = self.DVS
        slots = mOP.shape[2]
        ci = b * mK.shape[2] + kvh
        n_tiles = (seq_len + 15) // 16
        stride = slots * WH
        # the warp's tiles own + j * stride, j < rounds, are its own (no atomic): the
        # ramp's two, or DFX quarters of its even share; the counter deals out the rest
        rounds = Int32(2)
        if cutlass.const_expr(self.DFX > 0):
            rounds = cutlass.max(rounds, (n_tiles // stride) * self.DFX // 4)
        fixed = rounds * stride  # tiles dealt out before any is taken
        own = split * WH + warp
        k0 = own
        k1 = k0 + stride
        stamp1 = Int32(0)
        if cutlass.const_expr(self.TL):
            stamp1 = cute.arch.globaltimer_lo()
        stamp2 = stamp1
        if k0 < n_tiles:
            self.issue_page(mK, mV, s_kv, mBT[b, (16 * k0) // P], (16 * k0) % P, 16 * k0,
                            seq_len, kvh, sl, 0, warp, lane)
        cute.arch.cp_async_commit_group()
        # the third tile taken now; the second's page id read while the first flies
        raw2 = Int32(0)
        if lane == 0 and k1 < n_tiles and rounds <= 2:
            raw2 = cute.arch.atomic_add(mCnt.iterator + ci, Int32(1), sem="relaxed",
                                        scope="gpu")
        p1 = Int32(0)
        if k1 < n_tiles:
            p1 = mBT[b, (16 * k1) // P]
        acc_o, run_max, run_sum = _softmax_state(DVS)
        it = Int32(0)
        while k0 < n_tiles:
            cute.arch.cp_async_wait_group(0)
            if cutlass.const_expr(self.KL):
                cute.arch.sync_warp()
            if cutlass.const_expr(self.TL):  # noqa: SIM102
                if it == 0:
                    stamp2 = cute.arch.globaltimer_lo()
            if k1 < n_tiles:
                self.issue_page(mK, mV, s_kv, p1, (16 * k1) % P, 16 * k1, seq_len, kvh, sl,
                                (it + 1) % 2, warp, lane)
            cute.arch.cp_async_commit_group()
            # the tile two ahead (its own, or taken at the end of the last iteration) and
            # its page id in flight during this math; past the tiles (k1 out) no take was
            # made
            k2 = n_tiles
            if k1 < n_tiles:
                if it + 2 < rounds:
                    k2 = cutlass.min(own + (it + 2) * stride, n_tiles)
                else:
                    k2 = fixed + cute.arch.shuffle_sync(raw2, 0)
            p2 = Int32(0)
            if k2 < n_tiles:
                p2 = mBT[b, (16 * k2) // P]
            self.tile(atom, q_lo, q_hi, s_q, s_kv, it % 2, warp, lane, acc_o, run_max,
                      run_sum, 16 * k0, seq_len, qscale)
            # the tile three ahead taken after the math: ptxas turns the one-lane atomic
            # into a warp-aggregated one whose shuffle waits for its return at once, so
            # here that wait overlaps the next tile's (run 13 had it before the math)
            raw3 = Int32(0)
            if lane == 0 and k1 < n_tiles and it + 3 >= rounds:
                raw3 = cute.arch.atomic_add(mCnt.iterator + ci, Int32(1), sem="relaxed",
                                            scope="gpu")
            k0 = k1
            k1 = k2
            p1 = p2
            raw2 = raw3
            it = it + 1
        cute.arch.cp_async_wait_group(0)
        stamp3 = stamp1
        if cutlass.const_expr(self.TL):
            stamp3 = cute.arch.globaltimer_lo()
        self.epilogue(acc_o, run_max, run_sum, s_acc, s_ml, mOP, mLse, mO, b, kvh, sl, split,
                      warp, g, t, tidx)
        return stamp1, stamp2, stamp3

    @cute.jit
    def q_fragments(self, mQ, s_q, b, kvh, warp, g, t, lane):
        """Q as the A operand: this lane's 16 bytes of heads g and g + 8 (zeros past G) at
        each 32-wide chunk; in registers, or (wide keys: MLA) written by warp 0 to shared
        memory, which every warp then reads per chunk."""
        G: cutlass.Constexpr = self.G
        ld_q = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        st = _vec_atom()
        q_lo = []
        q_hi = []
        for c in cutlass.range_constexpr(self.NC):
            lo = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            hi = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            lo.fill(0.0)
            hi.fill(0.0)
            if g < G:
                cute.copy(ld_q, _head_vec(mQ, b, kvh * G + g, c * 4 + t), lo)
            if cutlass.const_expr(self.HI):  # noqa: SIM102
                if g + 8 < G:
                    cute.copy(ld_q, _head_vec(mQ, b, kvh * G + g + 8, c * 4 + t), hi)
            if cutlass.const_expr(self.QS):
                if warp == 0:
                    cute.copy(st, lo, s_q[c, 0, lane, None])
                    cute.copy(st, hi, s_q[c, 1, lane, None])
            else:
                q_lo.append(lo)
                q_hi.append(hi)
        return q_lo, q_hi

    @cute.jit
    def tile(self, atom, q_lo, q_hi, s_q, s_kv, stage, warp, lane, acc_o, run_max, run_sum,
             base, stop, qscale):
        """One tile of 16 tokens: scores, the online softmax, ``O += P V``; each 16-byte
        vector is read from shared memory when its MMA needs it."""
        NC: cutlass.Constexpr = self.NC
        NB: cutlass.Constexpr = self.NB
        NK: cutlass.Constexpr = self.NK
        g = lane // 4
        t = lane - g * 4
        ld_s = _vec_atom()

        def vec(j: int) -> object:
            r = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(ld_s, s_kv[warp, stage, j, lane, None], r)
            return r

        acc_s = []
        for _r in cutlass.range_constexpr(2):  # tokens 8 r + j; lane holds j = 2t, 2t + 1
            a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
            a.fill(0.0)
            acc_s.append(a)
        for c in cutlass.range_constexpr(NC):
            if cutlass.const_expr(self.QS):
                lo = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                hi = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(ld_s, s_q[c, 0, lane, None], lo)
                if cutlass.const_expr(self.HI):
                    cute.copy(ld_s, s_q[c, 1, lane, None], hi)
                else:
                    hi.fill(0.0)
            else:
                lo = q_lo[c]
                hi = q_hi[c]
            for r in cutlass.range_constexpr(2):
                if cutlass.const_expr(self.KL):
                    kv = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    es = self.k_slot(8 * r + g, c * 4 + t)
                    cute.copy(ld_s, s_kv[warp, stage, es // 32, es % 32, None], kv)
                else:
                    kv = vec(r * NC + c)
                for s in cutlass.range_constexpr(2):
                    _mma_k16(atom, acc_s[r], lo, hi, kv, s)
        pa = _online_softmax(acc_s, acc_o, run_max, run_sum, base, stop, qscale, t, self.HI)
        for blk in cutlass.range_constexpr(NB):
            _pv_mma(atom, acc_o, blk, pa, [vec(NK + q * NB + blk) for q in range(4)])

    @cute.jit
    def merge_if_last(self, mOP, mLse, mO, mCnt, s_flag, b, kvh, hkv, seq_len, tidx):
        """The last CTA of this (sequence, KV head) to finish merges every chunk's output
        (all value columns; with several KV heads per CTA, all of them: ``kvh`` is the
        first) and re-arms the counter: no combine launch. As the fused norm's last CTA:
        release fence, count, acquire fence."""
        G: cutlass.Constexpr = self.G
        GH: cutlass.Constexpr = self.G * self.HC  # query heads this CTA merges
        DV: cutlass.Constexpr = self.DV
        # chunks that hold tokens, as many as the grid has (seq_len past max_len: fewer)
        splits = cutlass.min((seq_len + self.C - 1) // self.C, mOP.shape[2])
        ci = b * hkv + kvh
        cute.arch.fence_acq_rel_gpu()  # this CTA's partial outputs, before the count
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + ci, Int32(1), sem="acq_rel", scope="gpu")
            s_flag[0] = Int32(0)
            if old == splits * self.NSL - 1:
                s_flag[0] = Int32(1)
        cute.arch.sync_threads()
        if s_flag[0] == 1:
            cute.arch.fence_acq_rel_gpu()
            # each thread NE columns, all of them advanced a chunk at a time: every load
            # of a step (and of the unrolled steps) in flight together
            NE: cutlass.Constexpr = (GH * DV + self.T - 1) // self.T
            tops = cute.make_rmem_tensor(cute.make_layout((NE,)), Float32)
            dens = cute.make_rmem_tensor(cute.make_layout((NE,)), Float32)
            nums = cute.make_rmem_tensor(cute.make_layout((NE,)), Float32)
            tops.fill(NEG_INIT)
            dens.fill(0.0)
            nums.fill(0.0)
            for s in cutlass.range(splits, unroll=max(1, 16 // NE)):
                for e in cutlass.range_constexpr(NE):
                    idx = cutlass.min(e * self.T + tidx, GH * DV - 1)  # spare lanes: repeat
                    hh = idx // DV
                    h = kvh * G + hh
                    lse = mLse[b, h, s]
                    part = mOP[b, h, s, idx - hh * DV]
                    new_top, corr, w = _lse_weights(tops[e], lse)
                    dens[e] = dens[e] * corr + w
                    nums[e] = nums[e] * corr + w * part
                    tops[e] = new_top
            for e in cutlass.range_constexpr(NE):
                idx = e * self.T + tidx
                if idx < GH * DV:
                    hh = idx // DV
                    mO[b, kvh * G + hh, idx - hh * DV] = (nums[e] / dens[e]).to(BFloat16)
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.atomic_exch(mCnt.iterator + ci, Int32(0), sem="relaxed", scope="gpu")

    @cute.jit
    def epilogue(self, acc_o, run_max, run_sum, s_acc, s_ml, mOP, mLse, mO, b, kvh, sl,
                 split, warp, g, t, tidx):
        """The warps meet in shared memory; each thread then merges whole outputs (``kvh``:
        the CTA's first KV head)."""
        G: cutlass.Constexpr = self.G
        D: cutlass.Constexpr = self.DVS
        W: cutlass.Constexpr = self.W
        for h in cutlass.range_constexpr(2 if self.HI else 1):
            head = g + 8 * h
            tot = cute.arch.warp_reduction(run_sum[h], operator.add, threads_in_group=4)
            if head < G:
                for blk in cutlass.range_constexpr(self.NB):
                    for i in cutlass.range_constexpr(V):
                        for q in cutlass.range_constexpr(2):
                            s_acc[warp, head, blk * 64 + 8 * (2 * t + q) + i] = \
                                acc_o[blk * V + i][2 * h + q]
                if t == 0:
                    s_ml[warp, head, 0] = run_max[h]
                    s_ml[warp, head, 1] = tot
        cute.arch.sync_threads()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        _merge_states(s_acc, s_ml, W, G, D, self.T, tidx, self.direct, mO, mOP, mLse, b, kvh,
                      split, sl, heads=self.HC, maybe_empty=self.DYN)
