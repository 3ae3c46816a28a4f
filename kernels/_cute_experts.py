"""CuTe DSL expert GEMM: MoE experts on tensor cores, rows grouped by expert on the GPU.

The router gives each token ``S`` (expert id, weight) slots, the shared expert last.
:class:`~agentload.kernels._cute.GroupedGemv` runs one CTA per (output tile, slot row),
so an expert chosen by ``n`` tokens has its weights read ``n`` times (from L2 after the
first): the shared expert eight times at batch 8, every expert many times at batch 64.
Here one CTA owns 16 weight rows of one expert. It first gathers the rows routed to its
expert from the router's ids (a ballot per warp, offsets through shared memory: no host
sync, no extra kernel; an expert nobody chose exits at once), then streams its weight
rows once and multiplies them with all of its tokens: ``mma.sync.m16n8k16`` with the
16 weight rows as A and 8 gathered token rows per tile as B, as in
:meth:`~agentload.kernels._cute.Gemv.mma_loop` (see there for the fragment layout), the
tiles past the expert's token count skipped.

With ``silu`` the 16 rows are 8 gate rows and the matching 8 up rows, and the CTA writes
``silu(gate) * up`` for 8 output columns (the expert's gate/up projection and its
activation in one launch); otherwise 16 output columns, scaled by the slot's weight.
Rows are laid out as in :class:`GroupedGemv`: ``y[r]`` for slot row ``r``, whose input is
``x[r // div]``.
"""

# mypy: ignore-errors
# The DSL rewrites these functions' Python AST at trace time (see _cute.py).

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from agentload.kernels._cute import V, _mma_k16, _row_vec, _vec_atom


class ExpertGemm:
    """``y[r] = scale[r] * x[r // div] @ W[ids[r]]^T`` (or ``silu(gate) * up``), grouped.

    Tensors: ``x [Rx, K]`` bf16, ``W [E, N, K]`` bf16, ``ids [R]`` int32 and ``scale [R]``
    float32 (the router's flattened slots), ``y [R, N or N / 2]`` bf16. ``tokens`` bounds
    the rows one expert may receive (the batch: a token picks an expert at most once),
    ``rows`` bounds ``R``. Grid: (output tiles, experts).
    """

    def __init__(self, k: int, tokens: int, rows: int, threads: int, div: int, silu: bool,
                 pdl: bool = False, pass_tiles: int = 0) -> None:
        self.K, self.M, self.R, self.T = k, tokens, rows, threads
        self.DIV, self.SILU, self.pdl = div, silu, pdl
        self.W = threads // 32
        # Token tiles of 8 (the MMA's n) per pass over K: all of them (one pass, each weight
        # read once), or ``pass_tiles`` with as many passes as the expert's count needs
        # (fewer registers, so more loads in flight; a busy expert re-reads from L2).
        self.PASSES = pass_tiles > 0
        self.NT = pass_tiles or (tokens + 7) // 8
        self.RPT = (rows + threads - 1) // threads  # router slots each thread inspects
        self.OUT = 8 if silu else 16  # output columns per CTA

    @cute.jit
    def __call__(self, mX, mW, mIds, mScale, mY, stream):
        n_out = mY.shape[1]
        experts = mW.shape[0]
        smem = self.M * 16 * self.W * 4 + self.M * 4 + self.RPT * self.W * 4 + 64
        self.kernel(mX, mW, mIds, mScale, mY).launch(
            grid=[n_out // self.OUT, experts, 1], block=[self.T, 1, 1], smem=smem,
            stream=stream, min_blocks_per_mp=1, use_pdl=self.pdl)

    @cute.jit
    def gather(self, mIds, rows, counts, e, tidx, warp, lane):
        """``rows[0:n]`` = the slot rows routed to expert ``e``; returns ``n``."""
        T: cutlass.Constexpr = self.T
        NW: cutlass.Constexpr = self.W
        RPT: cutlass.Constexpr = self.RPT
        total_rows = mIds.shape[0]
        below = (Int32(1) << lane) - Int32(1)  # lanes before this one
        hits = []
        ballots = []
        for j in cutlass.range_constexpr(RPT):
            r = j * T + tidx
            key = Int32(-1)
            if r < total_rows:
                key = mIds[r]
            hit = key == e
            ballot = cute.arch.vote_ballot_sync(hit)
            if lane == 0:
                counts[j * NW + warp] = cute.arch.popc(ballot)
            hits.append(hit)
            ballots.append(ballot)
        cute.arch.sync_threads()
        # Slot order (j, warp, lane): each thread's position is the hits before it.
        total = Int32(0)
        for idx in cutlass.range_constexpr(RPT * NW):
            total = total + counts[idx]
        for j in cutlass.range_constexpr(RPT):
            before = Int32(0)
            for idx in cutlass.range_constexpr((j + 1) * NW):
                c = counts[idx]
                if idx < j * NW + warp:
                    before = before + c
            pos = before + cute.arch.popc(ballots[j] & below)
            if hits[j] and pos < self.M:  # more than M rows: ids repeat an expert in a token
                rows[pos] = j * T + tidx
        cute.arch.sync_threads()
        return cutlass.min(total, self.M)

    @cute.jit
    def mma_loop(self, mX, mW, rows, part, count, e, n0, warp, lane, t0=0):
        """Leaves ``part[i * 16 + row, warp]``: the warp's K-partials for token ``i``
        (tokens ``t0`` to ``t0 + 8 * NT``)."""
        NW: cutlass.Constexpr = self.W
        NT: cutlass.Constexpr = self.NT
        NC: cutlass.Constexpr = self.K // (32 * self.W)  # 32-wide K chunks per warp
        U: cutlass.Constexpr = 4 if self.NT <= 2 else 2  # chunks loaded together
        ld_x = _vec_atom(cute.nvgpu.LoadCacheMode.ALWAYS)
        ld_w = _vec_atom(cute.nvgpu.LoadCacheMode.STREAMING)
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        g = lane // 4
        t = lane - g * 4
        half = mW.shape[1] // 2
        wE = mW[e, None, None]
        # weight row of A rows g (h = 0) and g + 8 (h = 1): gate and up rows with silu
        wrow = []
        for h in cutlass.range_constexpr(2):
            if cutlass.const_expr(self.SILU):
                wrow.append(n0 + g if h == 0 else half + n0 + g)
            else:
                wrow.append(n0 + h * 8 + g)
        # the x row of this lane's token in each tile (clamped: loads past count are masked)
        src = []
        for nt in cutlass.range_constexpr(NT):
            i = cutlass.min(t0 + nt * 8 + g, count - 1)
            src.append(rows[i] // self.DIV)
        accs = []
        for _i in cutlass.range_constexpr(NT):
            acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
            acc.fill(0.0)
            accs.append(acc)

        def load_w(c0: int) -> list:
            out = []
            for c in cutlass.range_constexpr(c0, min(c0 + U, NC)):
                col = (c * NW + warp) * 4 + t
                for h in cutlass.range_constexpr(2):
                    wr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    cute.copy(ld_w, _row_vec(wE, wrow[h], col), wr)
                    out.append(wr)
            return out

        wnext = load_w(0)
        for c0 in cutlass.range_constexpr(0, NC, U):
            wv = wnext
            if cutlass.const_expr(c0 + U < NC):
                wnext = load_w(c0 + U)
            xv = []
            for c in cutlass.range_constexpr(c0, min(c0 + U, NC)):
                for nt in cutlass.range_constexpr(NT):
                    xr = cute.make_rmem_tensor(cute.make_layout((V,)), BFloat16)
                    xr.fill(0.0)  # a token past the expert's count: a zero column of B
                    if t0 + nt * 8 + g < count:
                        cute.copy(ld_x, _row_vec(mX, src[nt], (c * NW + warp) * 4 + t), xr)
                    xv.append(xr)
            for ci in cutlass.range_constexpr(min(U, NC - c0)):
                for nt in cutlass.range_constexpr(NT):
                    if t0 + nt * 8 < count:  # whole tiles past the count: no MMA at all
                        for s in cutlass.range_constexpr(2):
                            _mma_k16(atom, accs[nt], wv[ci * 2], wv[ci * 2 + 1],
                                     xv[ci * NT + nt], s)
        if cutlass.const_expr(self.pdl and not self.PASSES):
            cute.arch.griddepcontrol_launch_dependents()
        # c0, c1 = C[g, 2t], C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1]
        for nt in cutlass.range_constexpr(NT):
            for h in cutlass.range_constexpr(2):
                for q in cutlass.range_constexpr(2):
                    i = t0 + nt * 8 + 2 * t + q
                    if i < count:
                        part[i * 16 + h * 8 + g, warp] = accs[nt][h * 2 + q]

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mIds: cute.Tensor, mScale: cute.Tensor,
               mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bid, e, _ = cute.arch.block_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        M: cutlass.Constexpr = self.M
        T: cutlass.Constexpr = self.T
        NW: cutlass.Constexpr = self.W
        OUT: cutlass.Constexpr = self.OUT
        smem = cutlass.utils.SmemAllocator()
        part = smem.allocate_tensor(
            Float32, cute.make_layout((M * 16, NW), stride=(NW, 1)), byte_alignment=16)
        rows = smem.allocate_tensor(Int32, cute.make_layout((M,)), byte_alignment=16)
        counts = smem.allocate_tensor(Int32, cute.make_layout((self.RPT * NW,)),
                                      byte_alignment=16)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # ids and x come from the kernels before
        count = self.gather(mIds, rows, counts, e, tidx, warp, lane)
        if count > 0:
            n0 = bid * OUT
            if cutlass.const_expr(self.PASSES):
                per_pass = 8 * self.NT
                for tp in cutlass.range((count + per_pass - 1) // per_pass):
                    self.mma_loop(mX, mW, rows, part, count, e, n0, warp, lane,
                                  t0=tp * per_pass)
                if cutlass.const_expr(self.pdl):
                    cute.arch.griddepcontrol_launch_dependents()
            else:
                self.mma_loop(mX, mW, rows, part, count, e, n0, warp, lane)
            cute.arch.sync_threads()
            for p in cutlass.range_constexpr((M * OUT + T - 1) // T):
                idx = p * T + tidx
                i = idx // OUT
                j = idx - i * OUT
                if i < count:
                    r = rows[i]
                    tot = part[i * 16 + j, None].load().reduce(
                        cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
                    if cutlass.const_expr(self.SILU):
                        up = part[i * 16 + 8 + j, None].load().reduce(
                            cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
                        tot = tot / (1.0 + cute.math.exp(-tot)) * up
                    else:
                        tot = tot * mScale[r]
                    mY[r, n0 + j] = Float32(tot).to(BFloat16)
