"""Torch-facing kernel calls: check shapes and dtypes, allocate outputs, launch.

Every function checks its inputs first and raises :class:`KernelsError` naming the
argument (so a wrong shape never reaches the GPU), then looks up the compiled variant in
the cache (``_cache.get``: compiled once per process, loaded from disk when exported
before) and launches it on torch's current stream, CUDA-graph capture included.
Outputs may be passed in (``out=``) so the benchmarks and graphs reuse buffers.
``pdl=True`` picks the programmatic-dependent-launch variant: it starts while the previous
kernel drains, streams its first weights, and waits (``griddepcontrol.wait``) only before
reading activations; use it when the previous kernel on the stream is one of these.
"""

from __future__ import annotations

import torch

from agentload.kernels import _cache
from agentload.kernels._cache import loaded_count as loaded_count  # re-exported: tests count loads
from agentload.kernels.errors import KernelsError
from agentload.kernels.specs import (
    add_rmsnorm_spec,
    attention_chunk,
    attention_combine_spec,
    check_dims,
    decode_attention_spec,
    dynamic_fill_ctas,
    expert_gemm_spec,
    gemv_spec,
    grouped_gemv_spec,
    mma_chunk_rules,
    router_spec,
    silu_mul_spec,
)

_BF16 = torch.bfloat16
_SCRATCH: dict[tuple[str, str], torch.Tensor] = {}
_SMS: dict[str, int] = {}


def _check(t: object, name: str, dtype: torch.dtype, want: tuple[int | None, ...],
           *, row_stride_ok: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelsError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise KernelsError(f"{name} must be {dtype}, got {t.dtype}")
    check_dims(name, tuple(t.shape), want)
    if t.device.type != "cuda":
        raise KernelsError(f"{name} must be on a CUDA device, got {t.device}")
    if row_stride_ok and t.dim() == 2:
        if t.stride(1) != 1 or t.stride(0) % 8:
            raise KernelsError(f"{name} needs unit column stride and a row stride "
                               f"divisible by 8, got {tuple(t.stride())}")
    elif not t.is_contiguous():
        raise KernelsError(f"{name} must be contiguous (row-major)")
    if t.data_ptr() % 16:
        raise KernelsError(f"{name} must be 16-byte aligned")
    return t


def _out(out: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple[int, ...],
         like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return _check(out, name, dtype, shape)


def _sms(device: torch.device) -> int:
    """The device's SM count (cached: a property query per call would cost µs)."""
    n = _SMS.get(str(device))
    if n is None:
        n = _SMS[str(device)] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _scratch(kind: str, device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    key = (kind, f"{device}-{n}")
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.zeros(n, dtype=dtype, device=device)
        _SCRATCH[key] = t
    return t


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-6, *, out: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None, pdl: bool = False,
                cluster: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (``x`` ``[M, H]``, or ``[M, S, H]`` summed over S), then
    ``rmsnorm(h) * weight``. One kernel (``cluster`` CTAs per row). Returns
    ``(normed, h)``, both ``[M, H]`` bf16."""
    _check(residual, "residual", _BF16, (None, None))
    m, h = residual.shape
    x3 = x.unsqueeze(1) if isinstance(x, torch.Tensor) and x.dim() == 2 else x
    _check(x3, "x", _BF16, (m, None, h))
    _check(weight, "weight", _BF16, (h,))
    spec = add_rmsnorm_spec(h, x3.shape[1], pdl=pdl, cluster=cluster)
    o = _out(out, "out", _BF16, (m, h), residual)
    ro = _out(residual_out, "residual_out", _BF16, (m, h), residual)
    _cache.get(spec)(x3, residual, weight.view(1, h), o, ro, float(eps))
    return o, ro


def silu_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[M, 2I]`` bf16; returns ``[M, I]``."""
    _check(x, "x", _BF16, (None, None))
    m, two_i = x.shape
    if two_i % 2:
        raise KernelsError(f"x has {two_i} columns; expected an even 2 * I")
    spec = silu_mul_spec(two_i // 2)
    o = _out(out, "out", _BF16, (m, two_i // 2), x)
    _cache.get(spec)(x, o)
    return o


def _dummies(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (_scratch("bf16x8", device, _BF16, 8).view(1, 8),
            _scratch("f32x1", device, torch.float32, 1))


def gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, *,
         out: torch.Tensor | None = None, opb: int | None = None,
         threads: int | None = None, pdl: bool = False, mma: bool | None = None
         ) -> torch.Tensor:
    """``x @ w.T (+ residual)`` for ``x`` ``[M <= 64, K]`` (rows may be strided) and ``w``
    ``[N, K]`` bf16; one kernel, weights streamed once. Returns ``[M, N]`` bf16.
    ``mma`` forces the tensor-core or the FMA loop (<= 16 rows); None picks
    (specs.gemv_spec: tensor cores at 8 and above 16 rows)."""
    _check(x, "x", _BF16, (None, None), row_stride_ok=True)
    m, k = x.shape
    _check(w, "w", _BF16, (None, k))
    n = w.shape[0]
    if residual is not None:
        _check(residual, "residual", _BF16, (m, n))
    spec = gemv_spec(k, n, m, residual=residual is not None, opb=opb, threads=threads,
                     pdl=pdl, mma=mma)
    y = _out(out, "out", _BF16, (m, n), x)
    small, f1 = _dummies(x.device)
    cnt = _scratch("cnt", x.device, torch.int32, 1)
    _cache.get(spec)(x, w, small if residual is None else residual, y, small, small, f1, cnt,
                     1e-6)
    return y


def oproj_residual_rmsnorm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float = 1e-6, *,
                           h_out: torch.Tensor | None = None,
                           normed_out: torch.Tensor | None = None, pdl: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op-boundary chain in one kernel: ``h = residual + x @ w.T``, then
    ``rmsnorm(h) * norm_weight``. Returns ``(h, normed)``.

    The GEMV's CTAs each add their rows' sums of squares to a float32 scratch and bump a
    counter; the last CTA to finish normalizes every row and re-arms the scratch, so the
    norm needs no second launch.
    """
    _check(x, "x", _BF16, (None, None), row_stride_ok=True)
    m, k = x.shape
    _check(w, "w", _BF16, (None, k))
    n = w.shape[0]
    _check(residual, "residual", _BF16, (m, n))
    _check(norm_weight, "norm_weight", _BF16, (n,))
    spec = gemv_spec(k, n, m, residual=True, fuse_norm=True, pdl=pdl)
    h = _out(h_out, "h_out", _BF16, (m, n), x)
    normed = _out(normed_out, "normed_out", _BF16, (m, n), x)
    ws = _scratch(f"sumsq{m}", x.device, torch.float32, m)
    cnt = _scratch("cnt-norm", x.device, torch.int32, 1)
    _cache.get(spec)(x, w, residual, h, norm_weight.view(1, n), normed, ws, cnt, float(eps))
    return h, normed


def _check_slot_rows(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                     scale: torch.Tensor, div: int) -> tuple[int, int, int, int]:
    """The expert kernels' inputs: ``x [Rx, K]``, ``w [E, N, K]``, ``ids [R]`` int32,
    ``scale [R]`` float32, with ``R <= Rx * div``. Returns ``(K, N, E, R)``."""
    _check(x, "x", _BF16, (None, None))
    k = x.shape[1]
    _check(w, "w", _BF16, (None, None, k))
    e, n, _ = w.shape
    _check(ids, "ids", torch.int32, (None,))
    r = ids.shape[0]
    _check(scale, "scale", torch.float32, (r,))
    if x.shape[0] * div < r:
        raise KernelsError(f"{r} rows need x with >= {-(-r // div)} rows, got {x.shape[0]}")
    return k, n, e, r


def grouped_gemv(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor,
                 *, silu: bool, div: int, out: torch.Tensor | None = None,
                 pdl: bool = False) -> torch.Tensor:
    """Expert rows: ``y[r] = x[r // div] @ w[ids[r]].T``; with ``silu`` (``w`` ``[E, 2I, K]``)
    ``y[r] = silu(gate) * up`` (``[R, I]``), else ``y[r] *= scale[r]`` (``[R, N]``)."""
    k, n, e, r = _check_slot_rows(x, w, ids, scale, div)
    spec = grouped_gemv_spec(k, n, e, div=div, silu=silu, pdl=pdl)
    y = _out(out, "out", _BF16, (r, n // 2 if silu else n), x)
    _cache.get(spec)(x, w, ids, scale, y)
    return y


def expert_gemm(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, scale: torch.Tensor,
                *, silu: bool, div: int, tokens: int, slots: int,
                out: torch.Tensor | None = None, pdl: bool = False,
                pass_tiles: int = 0, threads: int = 128) -> torch.Tensor:
    """:func:`grouped_gemv`'s rows on tensor cores, grouped by expert on the GPU.

    ``ids``/``scale`` are the router's flattened ``[M * slots]`` slots; ``tokens`` bounds
    the rows any one expert receives (the batch ``M``; it picks the compiled variant).
    Each CTA gathers its expert's rows itself, so every expert's weights are read once
    (``pass_tiles``: that many 8-token tiles per pass over the weights, see the spec;
    ``threads``: the CTA's warps split K between them).
    """
    k, n, e, r = _check_slot_rows(x, w, ids, scale, div)
    if r > tokens * slots:
        raise KernelsError(f"{r} slot rows exceed tokens {tokens} x slots {slots}")
    spec = expert_gemm_spec(k, n, e, tokens=tokens, slots=slots, div=div, silu=silu, pdl=pdl,
                            pass_tiles=pass_tiles, threads=threads)
    y = _out(out, "out", _BF16, (r, n // 2 if silu else n), x)
    _cache.get(spec)(x, w, ids, scale, y)
    return y


def moe_router(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, *, topk: int,
               groups: int, topk_group: int, scale: float = 1.0, shared: bool = False,
               logits: torch.Tensor | None = None, ids: torch.Tensor | None = None,
               weights: torch.Tensor | None = None, pdl: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits -> sigmoid -> grouped top-k -> normalized weights in one kernel.

    Returns ``(logits f32 [M, E], ids int32 [M, S], weights f32 [M, S])`` with
    ``S = topk (+ 1 with shared)``; the shared slot has id ``E`` and weight 1.
    """
    _check(x, "x", _BF16, (None, None))
    m, h = x.shape
    _check(wr, "wr", _BF16, (None, h))
    e = wr.shape[0]
    _check(bias, "bias", torch.float32, (e,))
    spec = router_spec(h, e, topk, groups, topk_group, scale, shared, pdl=pdl)
    s = topk + 1 if shared else topk
    lg = _out(logits, "logits", torch.float32, (m, e), x)
    ii = _out(ids, "ids", torch.int32, (m, s), x)
    ww = _out(weights, "weights", torch.float32, (m, s), x)
    _cache.get(spec)(x, wr, bias, lg, ii, ww)
    return lg, ii, ww


def _check_heads(t: object, name: str, want: tuple[int | None, ...]) -> torch.Tensor:
    """A ``[B, H, D]`` bf16 tensor whose heads are contiguous; the batch stride may be
    anything 16-byte aligned (a column slice of a q/k/v projection output)."""
    if not isinstance(t, torch.Tensor):
        raise KernelsError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _BF16:
        raise KernelsError(f"{name} must be {_BF16}, got {t.dtype}")
    check_dims(name, tuple(t.shape), want)
    if t.device.type != "cuda":
        raise KernelsError(f"{name} must be on a CUDA device, got {t.device}")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) % 8:
        raise KernelsError(f"{name} needs contiguous heads and a batch stride divisible by 8, "
                           f"got strides {tuple(t.stride())}")
    if t.data_ptr() % 16:
        raise KernelsError(f"{name} must be 16-byte aligned")
    return t


def decode_attention_mla(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, max_len: int, scale: float,
                         value_dim: int = 512, chunk: int | None = None,
                         out: torch.Tensor | None = None, pdl: bool = False,
                         threads: int = 64, stages: int = 3,
                         merge: bool = False, shared: bool = False) -> torch.Tensor:
    """One decode step of MLA attention (DeepSeek-V3 / Kimi, projections absorbed) over a
    paged latent cache, on tensor cores.

    ``q [B, H, Dk]`` bf16, H <= 16: each head's absorbed no-rope query (the latent's
    width) then its rope part; ``kv_cache [pages, P, 1, Dk]`` bf16: each token's latent
    then its rope key (P a multiple of 16); the value is the latent, the first
    ``value_dim`` columns. ``scale`` is the model's softmax scale (DeepSeek-V3: the
    unabsorbed head's ``(128 + 64) ** -0.5``, not ``Dk ** -0.5``). Returns ``[B, H,
    value_dim]`` bf16, still to be multiplied by the absorbed output projection.

    ``shared``: one CTA of ``value_dim / 128`` warps per chunk copies each tile once and
    its warps split the scoring and the value columns (``threads`` does not apply);
    otherwise ``value_dim / 128`` CTAs per chunk each score the whole key.
    """
    _check_heads(q, "q", (None, None, None))
    b, h, dk = q.shape
    _check(kv_cache, "kv_cache", _BF16, (None, None, 1, dk))
    page = kv_cache.shape[1]
    _check(block_table, "block_table", torch.int32, (b, None))
    _check(seq_lens, "seq_lens", torch.int32, (b,))
    if not 1 <= max_len <= block_table.shape[1] * page:
        raise KernelsError(f"max_len {max_len} must be 1..{block_table.shape[1] * page} "
                           f"(block_table's {block_table.shape[1]} pages of {page} tokens)")
    slices = 1 if shared else value_dim // 128  # CTAs per chunk
    step, per_sm = mma_chunk_rules(dk, h, page, threads, stages, value_dim, True,
                                   shared=shared)
    c = chunk or attention_chunk(b, slices, max_len, sms=_sms(q.device), step=step,
                                 ctas_per_sm=per_sm)
    splits = -(-max_len // c)
    direct = splits == 1
    merged = merge and not direct
    spec = decode_attention_spec(dk, h, page, c, direct=direct, pdl=pdl, threads=threads,
                                 stages=stages, mma=True, value_dim=value_dim, latent=True,
                                 merge=merged, shared=shared)
    combine = None if direct or merged else attention_combine_spec(value_dim, c, pdl=pdl)
    o = _out(out, "out", _BF16, (b, h, value_dim), q)
    part = _scratch(f"attn-part-{value_dim}", q.device, torch.float32,
                    b * h * splits * value_dim).view(b, h, splits, value_dim)
    lse = _scratch("attn-lse", q.device, torch.float32, b * h * splits).view(b, h, splits)
    placeholder = q[:, :1]  # the step's own key: unread (MLA appends it beforehand)
    counters = _scratch("attn-count", q.device, torch.int32, b)
    _cache.get(spec)(q, kv_cache, kv_cache, block_table, seq_lens, part, lse, o, placeholder,
                     placeholder, counters, scale * 1.4426950408889634)
    if combine is not None:
        _cache.get(combine)(part, lse, seq_lens, o)
    return o


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, *, max_len: int,
                     k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                     scale: float | None = None, chunk: int | None = None,
                     out: torch.Tensor | None = None, pdl: bool = False,
                     threads: int = 128, unroll: int = 4, pipe: bool = False,
                     mma: bool = False, stages: int = 3, merge: bool = False,
                     kv_heads_per_cta: int = 1, lines: bool = False,
                     dynamic: bool = False, dynamic_ctas: int = 0,
                     dynamic_fixed: int = 0) -> torch.Tensor:
    """One decode step of attention over a paged KV cache (GQA), split over the context.

    ``q [B, Hq, D]`` bf16; ``k_cache, v_cache [pages, P, Hkv, D]`` bf16 (vLLM's layout);
    ``block_table [B, max_pages]`` int32; ``seq_lens [B]`` int32 (each >= 1, <= ``max_len``,
    which the caller knows on the host, as vLLM's metadata does: reading it from the GPU
    would sync). Returns ``[B, Hq, D]`` bf16. One kernel when every context fits one
    chunk, else two (the chunks, then their combine).

    ``k_new, v_new [B, Hkv, D]``: the step's own key and value (token ``seq_lens - 1``),
    attended from there and appended to the cache in the same kernel. ``q``, ``k_new`` and
    ``v_new`` may be column slices of the q/k/v projection's output. ``threads`` and
    ``unroll`` pick the CTA's tile (warps, and steps whose loads are issued together);
    ``pipe`` issues each step's loads during the previous step's math. ``mma`` takes the
    tensor-core kernel instead: ``threads / 32`` warps of 16-token tiles, each streamed
    ``stages - 1`` tiles ahead into shared memory (pages of a multiple of 16 tokens);
    with ``merge`` its last CTA per (sequence, KV head) merges the chunks, so a split
    context is one kernel too. ``kv_heads_per_cta`` (with ``mma``): each CTA reads that
    many KV heads of its chunk (whole pages of the cache, its warps dealt out over them).
    ``lines`` (with ``mma``): keys copied in whole 128-byte lines, read back after a warp
    barrier. ``dynamic`` (with ``mma``, 2 stages, no ``k_new``): instead of a chunk each,
    the CTAs of a (sequence, KV head) -- as many as fill the GPU -- take its 16-token
    tiles from a shared counter, so SMs that stream slower take fewer (``chunk`` and
    ``merge`` do not apply; a combine always follows). ``dynamic_ctas``: that many CTAs
    a (sequence, KV head) instead (more than fill the GPU: later ones start as earlier
    ones finish, and help whichever head they belong to). ``dynamic_fixed`` (1-3): each
    warp first streams that many quarters of its even share of the tiles as its own (no
    atomic), and only the rest come from the counter.
    """
    _check_heads(q, "q", (None, None, None))
    b, hq, d = q.shape
    _check(k_cache, "k_cache", _BF16, (None, None, None, d))
    pages, page, hkv, _ = k_cache.shape
    _check(v_cache, "v_cache", _BF16, (pages, page, hkv, d))
    _check(block_table, "block_table", torch.int32, (b, None))
    _check(seq_lens, "seq_lens", torch.int32, (b,))
    if hkv < 1 or hq % hkv:
        raise KernelsError(f"{hq} query heads do not split over {hkv} KV heads")
    if (k_new is None) != (v_new is None):
        raise KernelsError("k_new and v_new go together (the step's own key and value)")
    if k_new is not None and v_new is not None:
        _check_heads(k_new, "k_new", (b, hkv, d))
        _check_heads(v_new, "v_new", (b, hkv, d))
    if not 1 <= max_len <= block_table.shape[1] * page:
        raise KernelsError(f"max_len {max_len} must be 1..{block_table.shape[1] * page} "
                           f"(block_table's {block_table.shape[1]} pages of {page} tokens)")
    # tokens one iteration of the CTA covers (and, on tensor cores, whole pages): the
    # chunk must be a multiple of them; CTAs an SM holds, from the shared memory
    if kv_heads_per_cta < 1 or hkv % kv_heads_per_cta:
        raise KernelsError(f"kv_heads_per_cta {kv_heads_per_cta} must divide the {hkv} KV "
                           f"heads")
    if mma:
        step, per_sm = mma_chunk_rules(d, hq // hkv, page, threads, stages, d, False,
                                       kv_heads=kv_heads_per_cta)
    else:
        step, per_sm = (threads // 32) * (256 // d) * unroll, 2
    if dynamic:
        if not mma or k_new is not None or merge or chunk:
            raise KernelsError("dynamic takes mma, and neither k_new, merge nor chunk")
        c = step  # nominal: one iteration's tokens
        # as many CTAs per (sequence, KV head) as fill the GPU, no more than its tiles
        fill = dynamic_ctas or dynamic_fill_ctas(b, hkv, sms=_sms(q.device),
                                                 ctas_per_sm=per_sm)
        splits = max(1, min(fill, -(-max_len // step)))
    else:
        c = chunk or attention_chunk(b, hkv // kv_heads_per_cta, max_len, sms=_sms(q.device),
                                     step=step, ctas_per_sm=per_sm)
        splits = -(-max_len // c)
    direct = splits == 1 and not dynamic
    merged = merge and mma and not direct
    spec = decode_attention_spec(d, hq // hkv, page, c, direct=direct, pdl=pdl,
                                 fresh=k_new is not None, threads=threads, unroll=unroll,
                                 pipe=pipe, mma=mma, stages=stages, merge=merged,
                                 kv_heads=kv_heads_per_cta, lines=lines, dynamic=dynamic,
                                 dynamic_fixed=dynamic_fixed)
    # the combine's spec before any launch: a shape it refuses fails with nothing written
    combine = (None if direct or merged
               else attention_combine_spec(d, c, pdl=pdl, every=dynamic))
    o = _out(out, "out", _BF16, (b, hq, d), q)
    qscale = (d ** -0.5 if scale is None else scale) * 1.4426950408889634  # base-2 softmax
    # The chunks' outputs (unwritten when direct, but the compiled kernel still checks that
    # their batch and head dims match q's; the grid's split count is part's third dim).
    part = _scratch(f"attn-part-{d}", q.device, torch.float32, b * hq * splits * d
                    ).view(b, hq, splits, d)
    lse = _scratch("attn-lse", q.device, torch.float32, b * hq * splits).view(b, hq, splits)
    kn = k_new if k_new is not None else q[:, :hkv]  # unread without fresh
    vn = v_new if v_new is not None else q[:, :hkv]
    if mma:  # + the per-(sequence, KV head) counters: the merging CTA re-arms them, or
        # (dynamic: the tiles taken) the combine does
        counters = _scratch("attn-dynamic" if dynamic else "attn-count", q.device,
                            torch.int32, b * hkv)
        _cache.get(spec)(q, k_cache, v_cache, block_table, seq_lens, part, lse, o, kn, vn,
                         counters, qscale)
    else:
        _cache.get(spec)(q, k_cache, v_cache, block_table, seq_lens, part, lse, o, kn, vn,
                         qscale)
    if combine is not None:  # the dynamic split's combine also re-arms its counters
        _cache.get(combine)(part, lse, seq_lens, o, *((counters,) if dynamic else ()))
    return o
