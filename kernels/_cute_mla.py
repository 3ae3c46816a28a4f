"""CuTe DSL MLA decode attention, one CTA per chunk sharing each tile (imported only to compile).

MLA with absorbed projections (DeepSeek-V3 / Kimi): every query head attends to one
latent cache whose rows are the latent (``DV`` = 512) then the rope key (64), and the
value is the latent itself. :class:`~agentload.kernels._cute_attention.DecodeAttentionMma`
with ``latent`` gives each 128 value columns a CTA of their own, so every CTA scores
the whole key and streams the whole tile: four times the MMAs and the shared-memory
reads, and 166 KiB of shared memory for two warps.

Here one CTA of ``DV / 128`` warps takes a chunk of the context. Its threads copy each
16-token tile into shared memory once (``cp.async``, ``S - 1`` tiles ahead, one barrier
per tile); each warp scores the tile over its share of the key's 32-wide chunks (its
Q fragments stay in registers), the partial scores meet in shared memory (a second
barrier), and every warp then holds the same scores, runs the same online softmax and
multiplies ``P`` with its own 128 value columns. No warp merge at the end: each warp
writes its columns. The MMA fragments are those of ``DecodeAttentionMma`` (query heads
as the MMA's 16 rows; ``S``'s accumulator is ``P``'s A fragment; ``V`` paired by token).
"""

# mypy: ignore-errors
# The DSL rewrites these functions' Python AST at trace time (see _cute.py).

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentload.kernels._cute import V, _mma_k16, _vec_atom
from agentload.kernels._cute_attention import (
    _cache_vec,
    _head_vec,
    _online_softmax,
    _pv_mma,
    _softmax_state,
)
from agentload.kernels.specs import MLA_ROW_PAD, mla_shared_smem


class DecodeAttentionMla:
    """Split-KV MLA decode attention, one CTA per (chunk, sequence), ``DV / 128`` warps.

    Tensors as :class:`DecodeAttentionMma` with ``latent``: ``q [B, H, DK]``,
    ``cache [pages, P, 1, DK]`` (``v_cache``, ``k_new``, ``v_new`` and the counters
    unread), ``o_part [B, H, S, DV]``, ``lse [B, H, S]``, ``out [B, H, DV]``. H <= 16,
    P a multiple of 16.
    """

    def __init__(self, head_dim: int, value_dim: int, group: int, page: int, chunk: int,
                 stages: int, direct: bool, pdl: bool = False) -> None:
        self.D, self.DV, self.G, self.P, self.C = head_dim, value_dim, group, page, chunk
        self.S, self.direct, self.pdl = stages, direct, pdl
        self.W = value_dim // 128  # warps: 128 value columns each
        self.T = self.W * 32
        self.NC = head_dim // 32  # 32-wide key chunks; warp w scores chunks w, w + W, ...
        self.CPW = (self.NC + self.W - 1) // self.W  # chunks per warp (the last may lack one)
        self.VR = head_dim // V  # 16-byte vectors per key row
        self.ROW = head_dim + MLA_ROW_PAD  # shared-memory row, in bf16
        self.HI = group > 8

    def smem_bytes(self) -> int:
        return mla_shared_smem(self.D, self.DV, self.P, self.C, self.S)

    @cute.jit
    def __call__(self, mQ, mK, mV, mBT, mLen, mOP, mLse, mO, mKN, mVN, mCnt,
                 qscale: Float32, stream):
        b = mQ.shape[0]
        splits = mOP.shape[2]
        self.kernel(mQ, mK, mBT, mLen, mOP, mLse, mO, qscale).launch(
            grid=[splits, 1, b], block=[self.T, 1, 1], smem=self.smem_bytes(),
            stream=stream, use_pdl=self.pdl)

    @cute.jit
    def issue(self, mK, s_tile, s_bt, t0, stop, k, stage, tidx):
        """Every thread's share of tile ``k``'s rows (``cp.async``, 16 bytes each) into
        ``stage``; tokens past ``stop`` copy the last valid one (finite, weighted 0)."""
        cp = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
            num_bits_per_copy=128)
        base = t0 + 16 * k
        if base < stop:
            page = s_bt[(16 * k) // self.P]
            slot0 = (16 * k) % self.P
            last = stop - 1 - base
            for j in cutlass.range_constexpr((16 * self.VR + self.T - 1) // self.T):
                vi = j * self.T + tidx
                if vi < 16 * self.VR:
                    row = vi // self.VR
                    col = vi - row * self.VR
                    off = slot0 + cutlass.min(row, last)
                    cute.copy(cp, _cache_vec(mK, page, off, 0, col),
                              cute.local_tile(s_tile, (1, 1, V), (stage, row, col))[0, 0, None])

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mBT: cute.Tensor, mLen: cute.Tensor,
               mOP: cute.Tensor, mLse: cute.Tensor, mO: cute.Tensor, qscale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        split, _, b = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        G: cutlass.Constexpr = self.G
        P: cutlass.Constexpr = self.P
        S: cutlass.Constexpr = self.S
        W: cutlass.Constexpr = self.W
        g = lane // 4
        t = lane - g * 4
        ld_q = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_s = _vec_atom()
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        smem = cutlass.utils.SmemAllocator()
        s_tile = smem.allocate_tensor(
            BFloat16, cute.make_layout((S, 16, self.ROW), stride=(16 * self.ROW, self.ROW, 1)),
            byte_alignment=128)
        s_part = smem.allocate_tensor(
            Float32, cute.make_layout((W, 32, 8), stride=(256, 8, 1)), byte_alignment=16)
        s_bt = smem.allocate_tensor(Int32, cute.make_layout((self.C // P,)), byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        seq_len = mLen[b]
        t0 = split * self.C
        if t0 < seq_len:
            stop = cutlass.min(seq_len, t0 + self.C)
            for i in cutlass.range(tidx, (stop - t0 + P - 1) // P, self.T):
                s_bt[i] = mBT[b, t0 // P + i]
            # this warp's Q fragments (heads g, g + 8; zeros past G) of its key chunks
            q_lo = []
            q_hi = []
            for j in cutlass.range_constexpr(self.CPW):
                lo = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                hi = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                lo.fill(0.0)
                hi.fill(0.0)
                c = j * W + warp
                if c < self.NC:
                    if g < G:
                        cute.copy(ld_q, _head_vec(mQ, b, g, c * 4 + t), lo)
                    if cutlass.const_expr(self.HI):  # noqa: SIM102
                        if g + 8 < G:
                            cute.copy(ld_q, _head_vec(mQ, b, g + 8, c * 4 + t), hi)
                q_lo.append(lo)
                q_hi.append(hi)
            cute.arch.sync_threads()  # the page ids
            acc_o, run_max, run_sum = _softmax_state(128)
            for k in cutlass.range_constexpr(S - 1):
                self.issue(mK, s_tile, s_bt, t0, stop, k, k, tidx)
                cute.arch.cp_async_commit_group()
            for it in cutlass.range((stop - t0 + 15) // 16):  # the live tiles only
                cute.arch.cp_async_wait_group(S - 2)
                # tile it landed for every thread; every warp is done with tile it - 1
                cute.arch.sync_threads()
                self.issue(mK, s_tile, s_bt, t0, stop, it + S - 1, (it + S - 1) % S, tidx)
                cute.arch.cp_async_commit_group()
                base = t0 + 16 * it
                if base < stop:
                    self.tile(atom, ld_s, q_lo, q_hi, s_tile, s_part, it % S, warp, lane,
                              acc_o, run_max, run_sum, base, stop, qscale)
            cute.arch.cp_async_wait_group(0)
            self.epilogue(acc_o, run_max, run_sum, mOP, mLse, mO, b, split, warp, g, t)

    @cute.jit
    def vec(self, ld_s, s_tile, stage, row, col):
        """The 16-byte vector ``col`` of row ``row`` of the tile in ``stage``."""
        r = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
        cute.copy(ld_s, cute.local_tile(s_tile, (1, 1, V), (stage, row, col))[0, 0, None], r)
        return r

    @cute.jit
    def tile(self, atom, ld_s, q_lo, q_hi, s_tile, s_part, stage, warp, lane, acc_o, run_max,
             run_sum, base, stop, qscale):
        """Partial scores over this warp's key chunks, summed across warps through shared
        memory; the online softmax; ``O += P V`` for this warp's 128 value columns."""
        W: cutlass.Constexpr = self.W
        g = lane // 4
        t = lane - g * 4

        acc_s = []
        for _r in cutlass.range_constexpr(2):
            a = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
            a.fill(0.0)
            acc_s.append(a)
        for j in cutlass.range_constexpr(self.CPW):
            c = j * W + warp
            if c < self.NC:
                for r in cutlass.range_constexpr(2):  # tokens 8 r + g as B's column g
                    kv = self.vec(ld_s, s_tile, stage, 8 * r + g, c * 4 + t)
                    for s in cutlass.range_constexpr(2):
                        _mma_k16(atom, acc_s[r], q_lo[j], q_hi[j], kv, s)
        for r in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(4):
                s_part[warp, lane, r * 4 + e] = acc_s[r][e]
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(4):
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(W):
                    tot = tot + s_part[w, lane, r * 4 + e]
                acc_s[r][e] = tot
        pa = _online_softmax(acc_s, acc_o, run_max, run_sum, base, stop, qscale, t, self.HI)
        for blk in cutlass.range_constexpr(2):  # this warp's columns 128 w + 64 blk + 8 j + i
            col = warp * 16 + blk * 8 + g  # in 16-byte vectors
            _pv_mma(atom, acc_o, blk, pa,
                    [self.vec(ld_s, s_tile, stage, (q // 2) * 8 + 2 * t + q % 2, col)
                     for q in range(4)])

    @cute.jit
    def epilogue(self, acc_o, run_max, run_sum, mOP, mLse, mO, b, split, warp, g, t):
        """Every warp holds the same softmax state: each writes its own columns."""
        G: cutlass.Constexpr = self.G
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        for h in cutlass.range_constexpr(2 if self.HI else 1):
            head = g + 8 * h
            tot = cute.arch.warp_reduction(run_sum[h], operator.add, threads_in_group=4)
            if head < G:
                for blk in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(V):
                        for q in cutlass.range_constexpr(2):
                            d = warp * 128 + blk * 64 + 8 * (2 * t + q) + i
                            o = acc_o[blk * V + i][2 * h + q] / tot
                            if cutlass.const_expr(self.direct):
                                mO[b, head, d] = o.to(BFloat16)
                            else:
                                mOP[b, head, split, d] = o
                if cutlass.const_expr(not self.direct):  # noqa: SIM102
                    if warp == 0 and t == 0:
                        mLse[b, head, split] = run_max[h] + cute.math.log2(tot, fastmath=True)

