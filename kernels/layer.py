"""A scaled-down MoE decoder layer with a ``standard`` (eager torch) and a ``fused`` path.

One decode step of one layer, batch ``M``:

1. input add + RMSNorm: ``h0 = residual + sum_s x_slots[:, s]`` (the previous layer's
   expert outputs, combined here), ``xn = rmsnorm(h0)``;
2. q/k/v projection (GQA: ``heads`` query heads over ``kv_heads`` KV heads), then decode
   attention over a paged KV cache (:class:`KVState`): the step's own key and value are
   appended to the cache and every query head attends to its sequence's whole context.
   No rotary embedding (the toy layer has none; it would be one more elementwise pass);
3. o-projection + residual + post-attention RMSNorm: ``h = h0 + attn @ Wo^T``, ``hn``;
4. router: logits, sigmoid, grouped top-k, normalized weights (+ the shared-expert slot);
5. experts: per (token, slot) gate/up -> SiLU-and-mul -> down, scaled by the weight.

The layer returns ``(x_slots_next [M, S, H], h)``; ``h + x_slots_next.sum(1)`` is the next
residual stream, which :meth:`MoELayer.result` gives for comparisons. Each call is wrapped
in an NVTX range and a ``record_function`` range named ``layer<i>.<path>`` so traces
attribute kernels to layers (the profiler room reads those ranges).

The fused path uses this room's kernels at batch <= 64: seven launches at batch <= 16,
eight when the context is split over CTAs and needs the attention combine. At batch
<= 16 the o-projection carries the residual add and the post-attention RMSNorm (its last
CTA normalizes); above, the norm is its own launch (eight), and the attention's chunks
grow to whole contexts once the sequences fill the GPU, so no combine is needed there
(or, ``attention_chunk``, split finer than the GPU holds, merged by their last CTA).
From batch 2 the experts are grouped by expert on the GPU (``expert_gemm``: each
expert's weights read once); at batch 1, one CTA per slot row (``grouped_gemv``). Above
64 rows the projections and experts use cuBLAS. The standard path appends to the cache
with ``index_copy_``, gathers each sequence's pages and calls SDPA.
Without a :class:`KVState` a step attends to its own token only (context 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from agentload.kernels import ops, reference
from agentload.kernels.presets import ATTN_MMA_LAYER, LayerConfig
from agentload.kernels.specs import GEMV_MAX_ROWS, MMA_MAX_ROWS

_BF16 = torch.bfloat16


@contextmanager
def layer_range(name: str) -> Iterator[None]:
    """NVTX + profiler range around one layer step (both nest per thread)."""
    nvtx = torch.cuda.is_available()
    if nvtx:
        torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]
    try:
        with torch.autograd.profiler.record_function(name):
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@dataclass
class KVState:
    """One layer's paged KV cache for a batch of sequences at one context length.

    ``seq_lens`` counts the step's own token, whose slot (``slots``, a flat index into
    ``[pages * page]``) the step writes; earlier tokens are random. Pages are handed out
    in a shuffled order, as a serving engine's allocator would after a while.
    """

    k_cache: torch.Tensor  #: [pages, page, kv_heads, head_dim] bf16
    v_cache: torch.Tensor
    block_table: torch.Tensor  #: [batch, pages per sequence] int32
    seq_lens: torch.Tensor  #: [batch] int32, all equal to ``context``
    slots: torch.Tensor  #: [batch] int64: flat cache slot of each step's own token
    context: int

    @classmethod
    def random(cls, cfg: LayerConfig, batch: int, context: int,
               device: torch.device | str, *, seed: int = 0) -> KVState:
        g = torch.Generator(device="cpu").manual_seed(seed)
        per_seq = -(-context // cfg.page)
        pages = batch * per_seq
        shape = (pages, cfg.page, cfg.kv_heads, cfg.head_dim)
        # random on the device: 32k contexts at batch 64 are GBs
        dg = torch.Generator(device=device).manual_seed(seed)
        k = torch.randn(shape, generator=dg, device=device).to(_BF16)
        v = torch.randn(shape, generator=dg, device=device).to(_BF16)
        table = torch.randperm(pages, generator=g).to(torch.int32).view(batch, per_seq)
        last = context - 1
        slots = table[:, last // cfg.page].long() * cfg.page + last % cfg.page
        lens = torch.full((batch,), context, dtype=torch.int32)
        return cls(k, v, table.to(device), lens.to(device), slots.to(device), context)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.slots)


class MoELayer:
    """Weights of one layer (random, seeded) and its two paths."""

    #: the fused path's options (attributes set after construction) the benchmark tries
    KNOBS = ("attention_mma", "attention_merge", "attention_lines", "attention_stages",
             "expert_pass_tiles", "attention_chunk", "gemv_threads", "expert_threads")

    def __init__(self, cfg: LayerConfig, device: torch.device | str, *, seed: int = 0,
                 index: int = 0, dtype: torch.dtype = _BF16) -> None:
        self.cfg, self.index = cfg, index
        self.last_ids: torch.Tensor | None = None  #: routed ids of the last call (checks)
        self.pdl = True  #: fused path at <= 64 rows: programmatic dependent launches
        #: from this batch the experts run on :func:`ops.expert_gemm` (grouped by expert,
        #: tensor cores); below it on :func:`ops.grouped_gemv` (one CTA per slot row)
        self.expert_gemm_from = 2
        #: token tiles per pass of the expert GEMM (0: one pass; see ops.expert_gemm)
        self.expert_pass_tiles = 0
        #: attention on the tensor-core kernel (presets.ATTN_MMA_LAYER's tile)
        self.attention_mma = False
        #: with attention_mma: its last CTA merges a split context (no combine launch)
        self.attention_merge = False
        #: with attention_mma: keys copied in whole 128-byte lines (ops.decode_attention)
        self.attention_lines = False
        #: with attention_mma: stages of its tile (one of presets.ATTN_LAYER_STAGES)
        self.attention_stages = ATTN_MMA_LAYER[1]
        #: with attention_mma and attention_merge: the chunk length (0: ops' automatic
        #: one); shorter than the context when the sequences already fill the GPU, the
        #: chunks outnumber the CTAs it holds and the block scheduler hands the next one
        #: to whichever SM frees first (one CTA a sequence leaves the faster SMs idle)
        self.attention_chunk = 0
        #: above GEMV_MAX_ROWS rows: the q/k/v and o-projection GEMVs' threads (0: the
        #: op's 128); more warps split K finer, so more weight loads are in flight
        self.gemv_threads = 0
        #: threads of the expert GEMM's CTAs (each owns 16 weight rows; warps split K)
        self.expert_threads = 128
        self._first_kv: dict[int, KVState] = {}
        g = torch.Generator(device="cpu").manual_seed(seed)
        h, i, e = cfg.hidden, cfg.inter, cfg.experts

        def rnd(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        self.w_in = (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(device)
        self.w_post = (1.0 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(device)
        self.wqkv = rnd(cfg.qkv_out, h, scale=h ** -0.5)
        self.wo = rnd(h, h, scale=h ** -0.5)
        self.wr = rnd(e, h, scale=h ** -0.5)
        self.bias = (0.1 * torch.randn(e, generator=g)).float().to(device)
        # Expert e < E is routed; index E is the shared expert (the router's last slot).
        self.w_gu = rnd(e + 1, 2 * i, h, scale=h ** -0.5)
        self.w_down = rnd(e + 1, h, i, scale=i ** -0.5)

    # -- standard: eager torch, graph-capturable (no host syncs) -------------------------
    def weights(self) -> tuple[torch.Tensor, ...]:
        return (self.w_in, self.w_post, self.wqkv, self.wo, self.wr, self.bias, self.w_gu,
                self.w_down)

    def standard(self, x_slots: torch.Tensor, residual: torch.Tensor,
                 kv: KVState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with layer_range(f"layer{self.index}.standard"):
            y, h, self.last_ids = standard_step(
                self.cfg, self.weights(), x_slots, residual,
                None if kv is None else kv.tensors(), 1 if kv is None else kv.context)
            return y, h

    def _first_token(self, batch: int, device: torch.device) -> KVState:
        """Context 1 (the step's own token only): the state used when none is given."""
        st = self._first_kv.get(batch)
        if st is None:
            st = KVState.random(self.cfg, batch, 1, device)
            self._first_kv[batch] = st
        return st

    def _select_torch(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_torch(self.cfg, self.bias, logits)

    # -- fused: this room's kernels ------------------------------------------------------
    def _attention(self, qkv: torch.Tensor, kv: KVState, pdl: bool) -> torch.Tensor:
        cfg = self.cfg
        q, kn, vn = split_qkv(cfg, qkv)
        threads, stages = ((ATTN_MMA_LAYER[0], self.attention_stages) if self.attention_mma
                           else (128, 3))
        out = ops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens,
                                   max_len=kv.context, k_new=kn, v_new=vn, pdl=pdl,
                                   mma=self.attention_mma, threads=threads, stages=stages,
                                   merge=self.attention_merge,
                                   lines=self.attention_mma and self.attention_lines,
                                   chunk=(self.attention_chunk or None) if self.attention_mma
                                   else None)
        return out.view(qkv.shape[0], cfg.heads * cfg.head_dim)

    def fused(self, x_slots: torch.Tensor, residual: torch.Tensor,
              kv: KVState | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        m = residual.shape[0]
        kv = kv or self._first_token(m, residual.device)
        with layer_range(f"layer{self.index}.fused"):
            if m > MMA_MAX_ROWS:
                return self._fused_cublas(x_slots, residual, kv)
            # Seven to nine launches, each a PDL dependent of the one before (see ops).
            p = self.pdl
            xn, h0 = ops.add_rmsnorm(x_slots, residual, self.w_in, cfg.eps, pdl=p)
            gt = (self.gemv_threads or None) if m > GEMV_MAX_ROWS else None
            qkv = ops.gemv(xn, self.wqkv, pdl=p, threads=gt)
            attn = self._attention(qkv, kv, p)
            if m <= GEMV_MAX_ROWS:
                h, hn = ops.oproj_residual_rmsnorm(attn, self.wo, h0, self.w_post, cfg.eps,
                                                   pdl=p)
            else:
                # the fused norm's last CTA would re-read every row alone: its own launch
                o = ops.gemv(attn, self.wo, pdl=p, threads=gt)
                hn, h = ops.add_rmsnorm(o, h0, self.w_post, cfg.eps, pdl=p)
            _, ids, wts = ops.moe_router(hn, self.wr, self.bias, topk=cfg.topk,
                                         groups=cfg.groups, topk_group=cfg.topk_group,
                                         scale=cfg.routed_scale, shared=True, pdl=p)
            self.last_ids = ids
            flat_ids, flat_w = ids.view(-1), wts.view(-1)
            if m < self.expert_gemm_from:
                act = ops.grouped_gemv(hn, self.w_gu, flat_ids, flat_w, silu=True,
                                       div=cfg.slots, pdl=p)
                y = ops.grouped_gemv(act, self.w_down, flat_ids, flat_w, silu=False, div=1,
                                     pdl=p)
            else:
                pt = self.expert_pass_tiles
                act = ops.expert_gemm(hn, self.w_gu, flat_ids, flat_w, silu=True,
                                      div=cfg.slots, tokens=m, slots=cfg.slots, pdl=p,
                                      pass_tiles=pt, threads=self.expert_threads)
                y = ops.expert_gemm(act, self.w_down, flat_ids, flat_w, silu=False, div=1,
                                    tokens=m, slots=cfg.slots, pdl=p, pass_tiles=pt,
                                    threads=self.expert_threads)
            return y.view(m, cfg.slots, cfg.hidden), h

    def _fused_cublas(self, x_slots: torch.Tensor, residual: torch.Tensor, kv: KVState
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Above 64 rows: cuBLAS projections and experts around this room's norm,
        attention and router kernels."""
        cfg = self.cfg
        xn, h0 = ops.add_rmsnorm(x_slots, residual, self.w_in, cfg.eps)
        qkv = xn @ self.wqkv.T
        o = self._attention(qkv, kv, False) @ self.wo.T
        hn, h = ops.add_rmsnorm(o, h0, self.w_post, cfg.eps)
        _, ids, wts = ops.moe_router(hn, self.wr, self.bias, topk=cfg.topk,
                                     groups=cfg.groups, topk_group=cfg.topk_group,
                                     scale=cfg.routed_scale, shared=True)
        self.last_ids = ids
        return self._experts_dense_fused(hn, ids, wts), h

    def _experts_dense_fused(self, hn: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor
                             ) -> torch.Tensor:
        cfg = self.cfg
        coef = torch.zeros(hn.shape[0], cfg.experts + 1, dtype=torch.float32,
                           device=hn.device)
        coef.scatter_add_(1, ids.long(), wts)
        out = torch.zeros_like(hn, dtype=torch.float32)
        for e in range(cfg.experts + 1):
            act = ops.silu_mul(hn @ self.w_gu[e].T)
            out += (act @ self.w_down[e].T).float() * coef[:, e:e + 1]
        return out.to(hn.dtype).unsqueeze(1)

    # -- reference and helpers -----------------------------------------------------------
    def _attention_reference(self, xn: torch.Tensor, kv: KVState | None) -> torch.Tensor:
        qkv = xn @ self.wqkv.float().T
        return attention_torch(self.cfg, qkv, None if kv is None else kv.tensors(),
                               1 if kv is None else kv.context, write=False)

    def reference(self, x_slots: torch.Tensor, residual: torch.Tensor,
                  ids: torch.Tensor | None = None, kv: KVState | None = None) -> torch.Tensor:
        """The next residual stream in float32 (weights upcast), for the tolerance check.

        With ``ids`` (``[M, >= k]``, a path's routed experts) the reference uses those
        experts, weighted by its own scores, so a near-tie the path resolved the other
        way does not count as a numerical error (:meth:`routing_check` judges the ties).
        """
        cfg = self.cfg
        f = torch.float32
        xn, h0 = reference.add_rmsnorm(x_slots, residual, self.w_in, cfg.eps, dtype=f)
        attn = self._attention_reference(xn, kv)
        hn, h = reference.add_rmsnorm(attn @ self.wo.to(f).T, h0, self.w_post, cfg.eps,
                                      dtype=f)
        logits = hn @ self.wr.to(f).T
        ref_ids, w = reference.router_select(logits, self.bias, cfg.topk, cfg.groups,
                                             cfg.topk_group, cfg.routed_scale)
        if ids is not None:
            ref_ids = ids[:, :cfg.topk].long()
            sc = torch.sigmoid(logits.double()).gather(1, ref_ids)
            w = sc / sc.sum(-1, keepdim=True) * cfg.routed_scale
        out = h.clone()
        i = cfg.inter
        for t in range(hn.shape[0]):
            pairs = [(int(e), float(wt)) for e, wt in zip(ref_ids[t], w[t], strict=True)]
            for e, wt in [*pairs, (cfg.experts, 1.0)]:
                gu = hn[t] @ self.w_gu[e].to(f).T
                act = torch.nn.functional.silu(gu[:i]) * gu[i:]
                out[t] += wt * (act @ self.w_down[e].to(f).T)
        return out

    def routing_check(self, x_slots: torch.Tensor, residual: torch.Tensor,
                      ids: torch.Tensor, tie: float = 2e-2, kv: KVState | None = None
                      ) -> tuple[int, int]:
        """``(tokens routed differently from the float reference, of those not at a tie)``.

        A token is at a tie when the reference's k-th and (k+1)-th biased expert scores,
        or its topk_group-th and next group scores, are closer than ``tie``.
        """
        cfg = self.cfg
        f = torch.float32
        xn, h0 = reference.add_rmsnorm(x_slots, residual, self.w_in, cfg.eps, dtype=f)
        attn = self._attention_reference(xn, kv)
        hn, _ = reference.add_rmsnorm(attn @ self.wo.to(f).T, h0, self.w_post, cfg.eps,
                                      dtype=f)
        logits = (hn @ self.wr.to(f).T).double()
        ref_ids, _ = reference.router_select(logits, self.bias, cfg.topk, cfg.groups,
                                             cfg.topk_group, cfg.routed_scale)
        g_margin, e_margin = selection_margins(cfg, torch.sigmoid(logits) + self.bias.double())
        differ = (ids[:, :cfg.topk].long().sort(1).values != ref_ids.sort(1).values).any(1)
        not_tie = differ & (g_margin >= tie) & (e_margin >= tie)
        return int(differ.sum()), int(not_tie.sum())

    @staticmethod
    def result(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``h + sum_s x_slots_next``: the residual stream after this layer."""
        y, h = out
        return h.float() + y.float().sum(1)

    def inputs(self, batch: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(x_slots [M, S, H], residual [M, H])`` bf16 on the layer's device."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        dev = self.wo.device
        x = torch.randn(batch, self.cfg.slots, self.cfg.hidden, generator=g) * 0.5
        r = torch.randn(batch, self.cfg.hidden, generator=g)
        return x.to(_BF16).to(dev), r.to(_BF16).to(dev)


def select_torch(cfg: LayerConfig, bias: torch.Tensor, logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid + grouped top-k in torch; returns ``[M, k + 1]`` ids/weights (+ shared)."""
    m = logits.shape[0]
    scores = torch.sigmoid(logits)
    sel = scores + bias
    grp = sel.view(m, cfg.groups, -1).topk(2, dim=-1).values.sum(-1)
    keep = grp.topk(cfg.topk_group, dim=-1).indices
    mask = torch.zeros_like(grp, dtype=torch.bool).scatter_(1, keep, True)
    sel = sel.masked_fill(~mask.repeat_interleave(cfg.experts // cfg.groups, 1),
                          float("-inf"))
    ids = sel.topk(cfg.topk, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scale
    shared_id = torch.full((m, 1), cfg.experts, dtype=ids.dtype, device=ids.device)
    return torch.cat([ids, shared_id], 1), torch.cat([w, torch.ones_like(w[:, :1])], 1)


def selection_margins(cfg: LayerConfig, sel: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, how far grouped top-k selection was from choosing otherwise: the gap
    between the ``topk_group``-th and next group score, and between the ``topk``-th and
    next expert score among the experts of the chosen groups (an expert of a group left
    out never competes, so a gap to it is no tie)."""
    eligible, gscore = reference.keep_top_groups(sel, cfg.groups, cfg.topk_group)
    gs = gscore.sort(1, True).values
    g_margin = (gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]
                if cfg.topk_group < cfg.groups else torch.full_like(gs[:, 0], 1e9))
    es = eligible.sort(1, True).values
    e_margin = es[:, cfg.topk - 1] - es[:, cfg.topk]
    return g_margin, e_margin


def split_qkv(cfg: LayerConfig, qkv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [M, heads, D]``, ``k [M, kv_heads, D]``, ``v [M, kv_heads, D]`` of the
    projection output (no copies)."""
    m, d = qkv.shape[0], cfg.head_dim
    qw, kw = cfg.heads * d, cfg.kv_heads * d
    return (qkv[:, :qw].view(m, cfg.heads, d), qkv[:, qw:qw + kw].view(m, cfg.kv_heads, d),
            qkv[:, qw + kw:].view(m, cfg.kv_heads, d))


def attention_torch(cfg: LayerConfig, qkv: torch.Tensor, kv: tuple[torch.Tensor, ...] | None,
                    context: int, *, write: bool = True) -> torch.Tensor:
    """Decode attention in torch: append the step's key and value to the cache
    (``index_copy_``; or, with ``write=False``, only in a gathered copy), gather each
    sequence's pages, SDPA with GQA. Every sequence has ``context`` tokens. ``[M, heads*D]``."""
    m, d = qkv.shape[0], cfg.head_dim
    q, kn, vn = split_qkv(cfg, qkv)
    if kv is None:  # context 1: the softmax is over one key, the output its value
        return vn.repeat_interleave(cfg.group, 1).reshape(m, cfg.heads * d)
    k_cache, v_cache, table, _, slots = kv
    if write:
        k_cache.view(-1, cfg.kv_heads, d).index_copy_(0, slots, kn)
        v_cache.view(-1, cfg.kv_heads, d).index_copy_(0, slots, vn)
    if not write:  # the reference, in qkv's wide dtype: a sequence at a time (memory)
        return torch.cat([_sdpa_pages(cfg, q[i:i + 1], k_cache, v_cache, table[i:i + 1],
                                      context, kn[i:i + 1], vn[i:i + 1])
                          for i in range(m)])
    return _sdpa_pages(cfg, q, k_cache, v_cache, table, context)


def _sdpa_pages(cfg: LayerConfig, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, table: torch.Tensor, context: int,
                kn: torch.Tensor | None = None, vn: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Gather the sequences' pages and SDPA (GQA); ``kn``/``vn``: the last key and value,
    put in a copy of the gathered cache in q's dtype (the cache itself is not written)."""
    m, d = q.shape[0], cfg.head_dim
    flat = table.reshape(-1)
    k = k_cache.index_select(0, flat).view(m, -1, cfg.kv_heads, d)[:, :context]
    v = v_cache.index_select(0, flat).view(m, -1, cfg.kv_heads, d)[:, :context]
    if kn is not None and vn is not None:
        k, v = k.to(q.dtype).clone(), v.to(q.dtype).clone()
        k[:, context - 1], v[:, context - 1] = kn, vn
    o = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    return o.reshape(m, cfg.heads * d)


def standard_step(cfg: LayerConfig, weights: tuple[torch.Tensor, ...], x_slots: torch.Tensor,
                  residual: torch.Tensor, kv: tuple[torch.Tensor, ...] | None = None,
                  context: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The standard path as a pure function of the weights and the cache (one
    torch.compile serves every layer); returns ``(x_slots_next, h, ids)``."""
    w_in, w_post, wqkv, wo, wr, bias, w_gu, w_down = weights
    h0 = residual + x_slots.sum(1)
    xn = _rms(h0, w_in, cfg.eps)
    qkv = xn @ wqkv.T
    h = h0 + attention_torch(cfg, qkv, kv, context) @ wo.T
    hn = _rms(h, w_post, cfg.eps)
    logits = (hn @ wr.T).float()
    ids, wts = select_torch(cfg, bias, logits)
    return experts_torch(cfg, w_gu, w_down, hn, ids, wts), h, ids


def experts_torch(cfg: LayerConfig, w_gu: torch.Tensor, w_down: torch.Tensor,
                  hn: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    m, s = ids.shape
    i = cfg.inter
    if m * s <= cfg.experts + 1:
        # Few rows: gather each row's expert weights (touches only chosen experts).
        flat = ids.reshape(-1)
        x = hn.repeat_interleave(s, 0).unsqueeze(1)  # [M*S, 1, H]
        gu = torch.bmm(x, w_gu.index_select(0, flat).transpose(1, 2))
        act = torch.nn.functional.silu(gu[..., :i]) * gu[..., i:]
        y = torch.bmm(act, w_down.index_select(0, flat).transpose(1, 2))
        return (y.squeeze(1) * wts.reshape(-1, 1).to(y.dtype)).view(m, s, -1)
    # Many rows: every expert is busy; run each once over all tokens, masked.
    coef = torch.zeros(m, cfg.experts + 1, dtype=torch.float32, device=hn.device)
    coef.scatter_add_(1, ids, wts)
    out = torch.zeros_like(hn, dtype=torch.float32)
    for e in range(cfg.experts + 1):
        gu = hn @ w_gu[e].T
        act = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        out += (act @ w_down[e].T).float() * coef[:, e:e + 1]
    return out.to(hn.dtype).unsqueeze(1)
