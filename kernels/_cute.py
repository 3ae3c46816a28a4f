"""CuTe DSL kernel definitions (imported only to compile; needs ``nvidia-cutlass-dsl``).

Every kernel is a class: its configuration (hidden size, rows, threads, ...) is plain
Python on ``self`` and therefore compile-time; ``__call__`` is the ``@cute.jit`` host
launcher and ``kernel`` the ``@cute.kernel`` device code. Each thread moves 16 bytes per
access (8 bf16); sums are float32; weights are read with the streaming cache policy
(``ld.global.cs``) because a decode step reads each weight once. No mixed bf16->f32 FMA is
used (that instruction is SM100-only): operands are converted to float32 first.

The torch-facing wrappers, shape checks and the compile cache live in ``ops.py`` and
``_cache.py``; this module has no torch dependency.
"""

# mypy: ignore-errors
# The DSL rewrites these functions' Python AST at trace time; its dynamic types are not
# expressible for mypy, so this one module is excluded from strict typing.

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

V = 8  # bf16 values per 16-byte access


def _vec_atom(cache: object | None = None) -> object:
    if cache is None:
        return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
    return cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), BFloat16, num_bits_per_copy=128,
                               load_cache_mode=cache)


def _row_vec(t: object, row: object, col: object) -> object:
    """The 8-element vector ``col`` of row ``row`` of a 2-D row-major tensor."""
    return cute.local_tile(t, (1, V), (row, col))[0, None]


@dsl_user_op
def _store_cluster_f32(smem_ptr: object, rank: Int32, val: Float32, *, loc: object = None,
                       ip: object = None) -> None:
    """``st.shared::cluster.f32``: store ``val`` at ``smem_ptr``'s offset in CTA ``rank``'s
    shared memory (the DSL's own store takes no distributed-shared pointer)."""
    addr = llvm.ptrtoint(T.i32(), smem_ptr.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    llvm.inline_asm(
        res=None,
        operands_=[addr, Int32(rank).ir_value(loc=loc, ip=ip),
                   Float32(val).ir_value(loc=loc, ip=ip)],
        asm_string="{ .reg .b32 ra; mapa.shared::cluster.u32 ra, $0, $1; "
                   "st.shared::cluster.f32 [ra], $2; }",
        constraints="r,r,f,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@cute.jit
def _mma_k16(atom: object, acc: object, w_lo: object, w_hi: object, x: object,
             s: int) -> None:
    """``acc += A @ B`` for half ``s`` (0 or 1) of a 32-wide K chunk: one
    ``mma.sync.m16n8k16``. ``w_lo`` / ``w_hi`` are this lane's 16-byte loads of weight rows
    ``g`` and ``g + 8``, ``x`` its load of token ``g``'s row, at K offset ``t * 8`` (see
    :meth:`Gemv.mma_loop` for why words ``2s`` and ``2s + 1`` are the fragments)."""
    lo = cute.recast_tensor(w_lo, Int32)
    hi = cute.recast_tensor(w_hi, Int32)
    x32 = cute.recast_tensor(x, Int32)
    b = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), BFloat16)
    b32 = cute.recast_tensor(b, Int32)
    b32[0] = x32[2 * s]
    b32[1] = x32[2 * s + 1]
    a = cute.make_rmem_tensor(cute.make_layout((8, 1, 1)), BFloat16)
    a32 = cute.recast_tensor(a, Int32)
    a32[0] = lo[2 * s]
    a32[1] = hi[2 * s]
    a32[2] = lo[2 * s + 1]
    a32[3] = hi[2 * s + 1]
    cute.gemm(atom, acc, a, b, acc)


@cute.jit
def _block_sum(val: Float32, warps: int, scratch: object) -> Float32:
    """Sum one float over the block: warp shuffle, then ``warps`` partials in smem."""
    warp = cute.arch.warp_idx()
    lane = cute.arch.lane_idx()
    val = cute.arch.warp_reduction_sum(val)
    if lane == 0:
        scratch[warp] = val
    cute.arch.sync_threads()
    return scratch.load().reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)


class AddRMSNorm:
    """``h = residual + sum_s x[:, s]``; ``out = h * rsqrt(mean(h^2) + eps) * w``.

    One CTA per row, or with ``cluster`` > 1 a thread-block cluster of that many CTAs per
    row, each taking ``hidden / cluster`` columns (more SMs, so more bytes in flight at
    small batch); their partial sums of squares meet through distributed shared memory
    and one cluster barrier. Writes ``h`` (the new residual) and ``out``. ``slots`` > 1
    folds the MoE combine (sum of routed + shared expert outputs) into the same pass.
    """

    def __init__(self, hidden: int, slots: int, threads: int, pdl: bool = False,
                 cluster: int = 1) -> None:
        self.H, self.S, self.T, self.pdl, self.C = hidden, slots, threads, pdl, cluster
        self.NV = hidden // (cluster * threads * V)
        self.W = threads // 32

    @cute.jit
    def __call__(self, mX, mR, mW, mO, mRO, eps: Float32, stream):
        m = mR.shape[0]
        if cutlass.const_expr(self.C > 1):
            self.kernel(mX, mR, mW, mO, mRO, eps).launch(
                grid=[m * self.C, 1, 1], block=[self.T, 1, 1], cluster=[self.C, 1, 1],
                stream=stream, use_pdl=self.pdl)
        else:
            self.kernel(mX, mR, mW, mO, mRO, eps).launch(
                grid=[m, 1, 1], block=[self.T, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor,
               mRO: cute.Tensor, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        T: cutlass.Constexpr = self.T
        C: cutlass.Constexpr = self.C
        row = bid // C
        rank = bid - row * C  # CTA rank in the cluster (clusters tile the grid along x)
        c0 = rank * (self.NV * T)  # this CTA's first column vector
        atom = _vec_atom()
        # Every load is issued before any store: the compiler cannot move loads past
        # stores to possibly-aliasing outputs, and one round trip beats NV of them.
        rrs = []
        xrs = []
        wrs = []
        for i in cutlass.range_constexpr(self.NV):
            wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(atom, _row_vec(mW, 0, c0 + i * T + tidx), wr)
            wrs.append(wr)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # weights above; activations after this line
        for i in cutlass.range_constexpr(self.NV):
            col = c0 + i * T + tidx
            rr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(atom, _row_vec(mR, row, col), rr)
            rrs.append(rr)
            for s in cutlass.range_constexpr(self.S):
                xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(atom, cute.local_tile(mX, (1, 1, V), (row, s, col))[0, 0, None], xr)
                xrs.append(xr)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        vals = []
        hbs = []
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(self.NV):
            acc = rrs[i].load().to(Float32)
            for s in cutlass.range_constexpr(self.S):
                acc = acc + xrs[i * self.S + s].load().to(Float32)
            hb = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            hb.store(acc.to(BFloat16))
            hf = hb.load().to(Float32)
            ss = ss + (hf * hf).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0),
                                       reduction_profile=0)
            vals.append(hf)
            hbs.append(hb)
        smem = cutlass.utils.SmemAllocator()
        scratch = smem.allocate_tensor(Float32, cute.make_layout((self.W,)), byte_alignment=16)
        tot = _block_sum(ss, self.W, scratch)
        if cutlass.const_expr(C > 1):
            # Thread 0 writes this CTA's sum into slot ``rank`` of every CTA of the
            # cluster (itself included); the barrier (release/acquire) makes them visible.
            peers = smem.allocate_tensor(Float32, cute.make_layout((C,)), byte_alignment=16)
            if tidx == 0:
                for r in cutlass.range_constexpr(C):
                    _store_cluster_f32(peers.iterator + rank, Int32(r), tot)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            tot = peers.load().reduce(cute.ReductionOp.ADD, init_val=Float32(0.0),
                                      reduction_profile=0)
        rstd = cute.math.rsqrt(tot / Float32(self.H) + eps)
        for i in cutlass.range_constexpr(self.NV):
            col = c0 + i * T + tidx
            cute.copy(atom, hbs[i], _row_vec(mRO, row, col))
            ob = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            ob.store((vals[i] * rstd * wrs[i].load().to(Float32)).to(BFloat16))
            cute.copy(atom, ob, _row_vec(mO, row, col))


class SiluMul:
    """``out[m, j] = silu(x[m, j]) * x[m, I + j]`` for ``x`` of shape ``[M, 2I]``."""

    def __init__(self, inter: int, threads: int) -> None:
        self.I, self.T = inter, threads

    @cute.jit
    def __call__(self, mX, mO, stream):
        m = mO.shape[0]
        cols = self.I // V
        self.kernel(mX, mO).launch(grid=[(cols + self.T - 1) // self.T, m, 1],
                                   block=[self.T, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, row, _ = cute.arch.block_idx()
        col = bx * self.T + tidx
        atom = _vec_atom()
        if col < self.I // V:
            g = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            u = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(atom, _row_vec(mX, row, col), g)
            cute.copy(atom, _row_vec(mX, row, col + self.I // V), u)
            gf = g.load().to(Float32)
            o = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            o.store((gf / (1.0 + cute.math.exp(-gf)) * u.load().to(Float32)).to(BFloat16))
            cute.copy(atom, o, _row_vec(mO, row, col))


class Gemv:
    """Small-batch ``y[M, N] = x[M, K] @ W[N, K]^T`` (+ ``residual``), M unrolled (<= 64).

    One CTA owns ``opb`` output rows over the whole K. Two main loops:

    * FMA (any M): each thread takes 8 bf16 of K per tile (``threads * 8`` per tile),
      float32 FMAs on CUDA cores; warp shuffle, then smem across warps.
    * ``mma`` (any M <= 64): tensor cores, ``mma.sync.m16n8k16`` bf16 -> f32 with 16
      weight rows as A and 8 activation rows as B (fewer rows: the missing columns are
      zeros; more: one tile per 8 rows), so neither side is converted to float32
      and one 16-byte x load serves 16 outputs. Each warp takes every ``warps``-th
      32-wide K chunk (the CTA's warps split K); the partial 16x8 tiles are summed in smem.

    With ``fuse_norm`` the epilogue also accumulates each row's sum of squares and
    the last CTA to finish (a global counter) writes ``rmsnorm(y) * w`` for all rows: the
    o-projection + residual + next RMSNorm chain in one launch.
    """

    def __init__(self, k: int, rows: int, threads: int, opb: int, residual: bool,
                 fuse_norm: bool = False, pdl: bool = False, mma: bool = False) -> None:
        self.K, self.M, self.T, self.OPB, self.pdl = k, rows, threads, opb, pdl
        self.residual, self.fuse_norm, self.mma = residual, fuse_norm, mma
        self.NKT = k // (threads * V)
        self.W = threads // 32
        self.NE = (rows * opb + threads - 1) // threads  # epilogue passes over outputs

    @cute.jit
    def __call__(self, mX, mW, mR, mY, mNW, mNO, mWs, mCnt, eps: Float32, stream):
        n = mW.shape[0]
        smem = self.M * self.OPB * self.W * 4 + 64
        self.kernel(mX, mW, mR, mY, mNW, mNO, mWs, mCnt, eps).launch(
            grid=[n // self.OPB, 1, 1], block=[self.T, 1, 1], smem=smem, stream=stream,
            min_blocks_per_mp=1, use_pdl=self.pdl)

    @cute.jit
    def fma_loop(self, mX, mW, part, n0, tidx, warp, lane):
        """CUDA-core main loop; leaves ``part[m * OPB + j, warp]`` = the warp's partials."""
        M: cutlass.Constexpr = self.M
        OPB: cutlass.Constexpr = self.OPB
        T: cutlass.Constexpr = self.T
        ld_x = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_w = _vec_atom(cute.nvgpu.LoadCacheMode.STREAMING)
        acc = cute.make_rmem_tensor(cute.make_layout((M, OPB), stride=(OPB, 1)), Float32)
        acc.fill(0.0)

        def load_w(kt: int) -> list:
            tiles = []
            for j in cutlass.range_constexpr(OPB):
                wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(ld_w, _row_vec(mW, n0 + j, kt * T + tidx), wr)
                tiles.append(wr)
            return tiles

        # Software pipeline: tile kt+1's weight loads are issued before tile kt's FMAs.
        # With PDL, tile 0 streams while the previous kernel drains.
        wnext = load_w(0)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for kt in cutlass.range_constexpr(self.NKT):
            col = kt * T + tidx
            wv = wnext
            if cutlass.const_expr(kt + 1 < self.NKT):
                wnext = load_w(kt + 1)
            xv = []
            for m in cutlass.range_constexpr(M):
                xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(ld_x, _row_vec(mX, m, col), xr)
                xv.append(xr)
            # float32 operands, one FMA chain per (row, output): no mixed bf16 FMA (SM100-only)
            xf = []
            for m in cutlass.range_constexpr(M):
                xt = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
                xt.store(xv[m].load().to(Float32))
                xf.append(xt)
            for j in cutlass.range_constexpr(OPB):
                wf = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
                wf.store(wv[j].load().to(Float32))
                for m in cutlass.range_constexpr(M):
                    a = acc[m, j]
                    for v in cutlass.range_constexpr(V):
                        a = a + wf[v] * xf[m][v]
                    acc[m, j] = a
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        for m in cutlass.range_constexpr(M):
            for j in cutlass.range_constexpr(OPB):
                acc[m, j] = cute.arch.warp_reduction_sum(acc[m, j])
        if lane == 0:
            for m in cutlass.range_constexpr(M):
                for j in cutlass.range_constexpr(OPB):
                    part[m * OPB + j, warp] = acc[m, j]

    @cute.jit
    def mma_loop(self, mX, mW, part, n0, warp, lane):
        """Tensor-core main loop (M <= 16); leaves ``part[m * OPB + j, warp]``.

        K is a sum, so any permutation of it used for both A and B gives the same
        product. Lane (g = lane / 4, t = lane % 4) loads 16 bytes at K offset
        ``chunk * 32 + t * 8`` of weight rows g and g + 8 and of token g; the fragment
        order of ``m16n8k16`` (a0a1 = A[g, 2t..], a2a3 = A[g+8, 2t..], a4a5 = A[g, 2t+8..],
        a6a7 = A[g+8, 2t+8..]; b0b1 = B[2t.., g], b2b3 = B[2t+8.., g]) then takes words
        0-1 of each load for the first MMA and words 2-3 for the second: plain register
        moves, no conversion, no shuffle.
        """
        OPB: cutlass.Constexpr = self.OPB
        NW: cutlass.Constexpr = self.W
        M: cutlass.Constexpr = self.M
        MT: cutlass.Constexpr = self.OPB // 16
        NT: cutlass.Constexpr = (self.M + 7) // 8  # token tiles of 8 (the MMA's n)
        NC: cutlass.Constexpr = self.K // (32 * self.W)  # chunks per warp
        # chunks whose loads are issued together (fewer with many token tiles: registers)
        U: cutlass.Constexpr = 4 if NT <= 2 else 2
        ld_x = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_w = _vec_atom(cute.nvgpu.LoadCacheMode.STREAMING)
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        g = lane // 4
        t = lane - g * 4
        accs = []
        for _i in cutlass.range_constexpr(MT * NT):
            acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)  # (V, M, N)
            acc.fill(0.0)
            accs.append(acc)

        def load_w(c0: int) -> list:
            out = []
            for c in cutlass.range_constexpr(c0, min(c0 + U, NC)):
                col = (c * NW + warp) * 4 + t
                for mt in cutlass.range_constexpr(MT):
                    for h in cutlass.range_constexpr(2):
                        wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                        cute.copy(ld_w, _row_vec(mW, n0 + mt * 16 + h * 8 + g, col), wr)
                        out.append(wr)
            return out

        wnext = load_w(0)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for c0 in cutlass.range_constexpr(0, NC, U):
            wv = wnext
            if cutlass.const_expr(c0 + U < NC):
                wnext = load_w(c0 + U)
            xv = []
            for c in cutlass.range_constexpr(c0, min(c0 + U, NC)):
                for nt in cutlass.range_constexpr(NT):
                    xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    if cutlass.const_expr((nt + 1) * 8 <= M):
                        cute.copy(ld_x, _row_vec(mX, nt * 8 + g, (c * NW + warp) * 4 + t), xr)
                    else:
                        # fewer than 8 tokens in this tile: the missing columns of B are 0
                        xr.fill(0.0)
                        if nt * 8 + g < M:
                            cute.copy(ld_x, _row_vec(mX, nt * 8 + g, (c * NW + warp) * 4 + t),
                                      xr)
                    xv.append(xr)
            for ci in cutlass.range_constexpr(min(U, NC - c0)):
                for nt in cutlass.range_constexpr(NT):
                    for s in cutlass.range_constexpr(2):
                        for mt in cutlass.range_constexpr(MT):
                            _mma_k16(atom, accs[mt * NT + nt], wv[(ci * MT + mt) * 2],
                                     wv[(ci * MT + mt) * 2 + 1], xv[ci * NT + nt], s)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        # c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1] (row = output,
        # column = token of the tile).
        for mt in cutlass.range_constexpr(MT):
            for nt in cutlass.range_constexpr(NT):
                for h in cutlass.range_constexpr(2):
                    for q in cutlass.range_constexpr(2):
                        j = mt * 16 + h * 8 + g
                        m = nt * 8 + 2 * t + q
                        if cutlass.const_expr((nt + 1) * 8 <= M):
                            part[m * OPB + j, warp] = accs[mt * NT + nt][h * 2 + q]
                        else:
                            if m < M:
                                part[m * OPB + j, warp] = accs[mt * NT + nt][h * 2 + q]

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mR: cute.Tensor, mY: cute.Tensor,
               mNW: cute.Tensor, mNO: cute.Tensor, mWs: cute.Tensor, mCnt: cute.Tensor,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nblocks, _, _ = cute.arch.grid_dim()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        M: cutlass.Constexpr = self.M
        OPB: cutlass.Constexpr = self.OPB
        T: cutlass.Constexpr = self.T
        NW: cutlass.Constexpr = self.W
        n0 = bid * OPB
        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(
            Float32, cute.make_layout((M * OPB, NW), stride=(NW, 1)), byte_alignment=16)
        flag = smem.allocate_tensor(Int32, cute.make_layout((4,)), byte_alignment=16)
        if cutlass.const_expr(self.mma):
            self.mma_loop(mX, mW, part, n0, warp, lane)
        else:
            self.fma_loop(mX, mW, part, n0, tidx, warp, lane)
        cute.arch.sync_threads()
        sq = Float32(0.0)
        for e in cutlass.range_constexpr(self.NE):
            idx = e * T + tidx
            if idx < M * OPB:
                m = idx // OPB
                j = idx - m * OPB
                tot = part[idx, None].load().reduce(cute.ReductionOp.ADD,
                                                    init_val=Float32(0.0), reduction_profile=0)
                if cutlass.const_expr(self.residual):
                    tot = tot + mR[m, n0 + j].to(Float32)
                yb = Float32(tot).to(BFloat16)
                mY[m, n0 + j] = yb
                yf = yb.to(Float32)
                sq = yf * yf
        if cutlass.const_expr(self.fuse_norm):
            # One atomic per row per CTA (specs: M * OPB <= threads, one pass): the OPB
            # squares of a row sit in OPB adjacent lanes (OPB divides 32), summed by
            # shuffles first.
            sq = cute.arch.warp_reduction(sq, operator.add, threads_in_group=OPB)
            if tidx < M * OPB and tidx % OPB == 0:
                cute.arch.atomic_add(mWs.iterator + tidx // OPB, sq, sem="relaxed",
                                     scope="gpu")
            cute.arch.fence_acq_rel_gpu()  # the y stores and sums, before the count
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator, Int32(1), sem="acq_rel", scope="gpu")
                flag[0] = Int32(0)
                if old == nblocks - 1:
                    flag[0] = Int32(1)
            cute.arch.sync_threads()
            if flag[0] == 1:
                self.normalize(mY, mNW, mNO, mWs, mCnt, eps, tidx)

    @cute.jit
    def normalize(self, mY, mNW, mNO, mWs, mCnt, eps: Float32, tidx):
        """Last CTA: every row of ``y`` is complete; write ``rmsnorm(y) * w``, re-arm.

        Fully unrolled with every load issued before the first use (one L2 round trip).
        """
        cute.arch.fence_acq_rel_gpu()
        n: cutlass.Constexpr = mY.shape[1]
        nv: cutlass.Constexpr = (n // V + self.T - 1) // self.T
        ld_l2 = _vec_atom(cute.nvgpu.LoadCacheMode.GLOBAL)
        st = _vec_atom()
        rstd = []
        for m in cutlass.range_constexpr(self.M):
            ss = cute.arch.atomic_add(mWs.iterator + m, Float32(0.0), sem="acq_rel", scope="gpu")
            rstd.append(cute.math.rsqrt(ss / Float32(n) + eps))
        for i in cutlass.range_constexpr(nv):
            c = i * self.T + tidx
            if c < n // V:
                wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                cute.copy(ld_l2, _row_vec(mNW, 0, c), wr)
                yrs = []
                for m in cutlass.range_constexpr(self.M):
                    yr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    cute.copy(ld_l2, _row_vec(mY, m, c), yr)
                    yrs.append(yr)
                wf = wr.load().to(Float32)
                for m in cutlass.range_constexpr(self.M):
                    ob = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    ob.store((yrs[m].load().to(Float32) * rstd[m] * wf).to(BFloat16))
                    cute.copy(st, ob, _row_vec(mNO, m, c))
        cute.arch.sync_threads()
        if tidx < self.M:
            cute.arch.atomic_exch(mWs.iterator + tidx, Float32(0.0), sem="relaxed", scope="gpu")
        if tidx == 0:
            cute.arch.atomic_exch(mCnt.iterator, Int32(0), sem="relaxed", scope="gpu")


class GroupedGemv:
    """MoE expert GEMV over (token, slot) rows: ``y[r] = scale[r] * x[r // div] @ W[id[r]]^T``.

    ``W`` is ``[E, N, K]``; ``ids``/``scale`` come from the router (one entry per slot,
    the shared expert as the last slot). With ``silu`` the CTA computes gate rows
    ``n`` and up rows ``N/2 + n`` and writes ``silu(gate) * up`` (``[R, N/2]``): the expert
    gate/up projection and its activation in one launch.
    """

    def __init__(self, k: int, threads: int, opb: int, div: int, silu: bool,
                 pdl: bool = False) -> None:
        self.K, self.T, self.OPB, self.DIV, self.SILU = k, threads, opb, div, silu
        self.pdl = pdl
        self.NKT = k // (threads * V)
        self.W = threads // 32

    @cute.jit
    def __call__(self, mX, mW, mIds, mScale, mY, stream):
        n_out = mY.shape[1]
        r = mY.shape[0]
        smem = 2 * self.OPB * self.W * 4 + 64
        self.kernel(mX, mW, mIds, mScale, mY).launch(
            grid=[n_out // self.OPB, r, 1], block=[self.T, 1, 1], smem=smem, stream=stream,
            min_blocks_per_mp=1, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor, mScale: cute.Tensor,
               mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, r, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        OPB: cutlass.Constexpr = self.OPB
        T: cutlass.Constexpr = self.T
        NW: cutlass.Constexpr = self.W
        NR: cutlass.Constexpr = 2 * self.OPB if self.SILU else self.OPB
        ld_x = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_w = _vec_atom(cute.nvgpu.LoadCacheMode.STREAMING)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # ids and x come from the kernels before
        e = mIds[r]
        src = r // self.DIV
        half = mW.shape[1] // 2
        n0 = bid * OPB
        wE = mW[e, None, None]
        acc = cute.make_rmem_tensor(cute.make_layout((NR,)), Float32)
        acc.fill(0.0)
        for kt in cutlass.range_constexpr(self.NKT):
            col = kt * T + tidx
            xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(ld_x, _row_vec(mX, src, col), xr)
            wv = []
            for j in cutlass.range_constexpr(NR):
                wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                nrow = n0 + j
                if cutlass.const_expr(self.SILU and j >= OPB):
                    nrow = half + n0 + (j - OPB)
                cute.copy(ld_w, _row_vec(wE, nrow, col), wr)
                wv.append(wr)
            xf = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
            xf.store(xr.load().to(Float32))
            for j in cutlass.range_constexpr(NR):
                wf = cute.make_rmem_tensor(cute.make_layout((V,)), Float32)
                wf.store(wv[j].load().to(Float32))
                a = acc[j]
                for v in cutlass.range_constexpr(V):
                    a = a + wf[v] * xf[v]
                acc[j] = a
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        for j in cutlass.range_constexpr(NR):
            acc[j] = cute.arch.warp_reduction_sum(acc[j])
        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(Float32, cute.make_layout((NR, NW), stride=(NW, 1)),
                                    byte_alignment=16)
        if lane == 0:
            for j in cutlass.range_constexpr(NR):
                part[j, warp] = acc[j]
        cute.arch.sync_threads()
        if tidx < OPB:
            tot = part[tidx, None].load().reduce(cute.ReductionOp.ADD, init_val=Float32(0.0),
                                                 reduction_profile=0)
            if cutlass.const_expr(self.SILU):
                up = part[tidx + OPB, None].load().reduce(
                    cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
                tot = tot / (1.0 + cute.math.exp(-tot)) * up
            else:
                tot = tot * mScale[r]
            mY[r, n0 + tidx] = Float32(tot).to(BFloat16)


class Router:
    """MoE router for one token per CTA: logits, sigmoid scoring, grouped top-k, weights.

    ``logits[e] = x . Wr[e]``; ``score = sigmoid(logit)``; selection uses ``score + bias``;
    groups are ranked by the sum of their two best biased scores, the best ``topk_group``
    groups kept, then the ``k`` best experts inside them; weights are the unbiased scores,
    normalized to sum 1 and multiplied by ``scale``. With ``shared`` a last slot
    (id ``E``, weight 1) is appended for the shared expert. ``E`` <= 64 (fully unrolled).
    """

    def __init__(self, hidden: int, experts: int, k: int, groups: int, topk_group: int,
                 scale: float, shared: bool, pdl: bool = False) -> None:
        self.H, self.E, self.K, self.G, self.TG = hidden, experts, k, groups, topk_group
        self.pdl = pdl
        self.scale, self.shared = scale, shared
        self.T = 256
        self.NW = self.T // 32
        self.NH = hidden // (32 * V)

    @cute.jit
    def __call__(self, mX, mWr, mBias, mLogits, mIds, mWts, stream):
        m = mX.shape[0]
        self.kernel(mX, mWr, mBias, mLogits, mIds, mWts).launch(
            grid=[m, 1, 1], block=[self.T, 1, 1], smem=4 * (2 * self.E + 64), stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mWr: cute.Tensor, mBias: cute.Tensor,
               mLogits: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        E: cutlass.Constexpr = self.E
        NW: cutlass.Constexpr = self.NW
        ld = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        smem = cutlass.utils.SmemAllocator()
        score = smem.allocate_tensor(Float32, cute.make_layout((E,)), byte_alignment=16)
        sel = smem.allocate_tensor(Float32, cute.make_layout((E,)), byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        xv = []
        for h in cutlass.range_constexpr(self.NH):
            xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
            cute.copy(ld, _row_vec(mX, row, h * 32 + lane), xr)
            xv.append(xr.load().to(Float32))
        for eb in cutlass.range_constexpr((E + NW - 1) // NW):
            e = eb * NW + warp
            if e < E:
                d = Float32(0.0)
                for h in cutlass.range_constexpr(self.NH):
                    wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    cute.copy(ld, _row_vec(mWr, e, h * 32 + lane), wr)
                    d = d + (wr.load().to(Float32) * xv[h]).reduce(
                        cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
                d = cute.arch.warp_reduction_sum(d)
                if lane == 0:
                    mLogits[row, e] = d
                    s = 1.0 / (1.0 + cute.math.exp(-d))
                    score[e] = s
                    sel[e] = s + mBias[e]
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        cute.arch.sync_threads()
        if tidx == 0:
            self.select(score, sel, mIds, mWts, row)

    @cute.jit
    def select(self, score, sel, mIds, mWts, row):
        E: cutlass.Constexpr = self.E
        G: cutlass.Constexpr = self.G
        EG: cutlass.Constexpr = self.E // self.G
        neg = Float32(-3.0e38)
        if cutlass.const_expr(self.TG < G):
            # Group score: the sum of the two best biased scores of each group.
            gs = cute.make_rmem_tensor(cute.make_layout((G,)), Float32)
            for g in cutlass.range_constexpr(G):
                b1 = neg
                b2 = neg
                for i in cutlass.range_constexpr(EG):
                    v = sel[g * EG + i]
                    if v > b1:
                        b2 = b1
                        b1 = v
                    elif v > b2:
                        b2 = v
                gs[g] = b1 + b2
            for _t in cutlass.range_constexpr(self.TG):
                best = neg
                bi = Int32(0)
                for g in cutlass.range_constexpr(G):
                    if gs[g] > best:
                        best = gs[g]
                        bi = Int32(g)
                gs[bi] = Float32(-2.0e38)  # taken (kept apart from never-chosen groups)
            for g in cutlass.range_constexpr(G):
                if gs[g] > Float32(-1.0e38):
                    for i in cutlass.range_constexpr(EG):
                        sel[g * EG + i] = neg
        total = Float32(0.0)
        ids = cute.make_rmem_tensor(cute.make_layout((self.K,)), Int32)
        wts = cute.make_rmem_tensor(cute.make_layout((self.K,)), Float32)
        for t in cutlass.range_constexpr(self.K):
            best = neg
            bi = Int32(0)
            for e in cutlass.range_constexpr(E):
                if sel[e] > best:
                    best = sel[e]
                    bi = Int32(e)
            sel[bi] = Float32(-3.3e38)
            ids[t] = bi
            wts[t] = score[bi]
            total = total + score[bi]
        inv = Float32(self.scale) / total
        for t in cutlass.range_constexpr(self.K):
            mIds[row, t] = ids[t]
            mWts[row, t] = wts[t] * inv
        if cutlass.const_expr(self.shared):
            mIds[row, self.K] = Int32(self.E)
            mWts[row, self.K] = Float32(1.0)

