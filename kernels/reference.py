"""Torch references for every kernel, computed in float64 (or a chosen dtype) from bf16 inputs.

The kernels are checked against these by relative Frobenius error (METHOD.md: bf16
operands land between 1e-3 and 1e-2; :data:`BF16_TOL` is the bound the tests use). The
same functions in bf16 are the ``standard`` path's building blocks.
"""

from __future__ import annotations

import torch

BF16_TOL = 1e-2  #: ||out - ref|| / ||ref|| bound for bf16 outputs (METHOD.md)
F32_TOL = 1e-4  #: bound for float32 outputs computed from bf16 operands (router logits)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf."""
    o, r = out.double(), ref.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    den = float(torch.linalg.vector_norm(r))
    num = float(torch.linalg.vector_norm(o - r))
    return num / den if den else num


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-6, dtype: torch.dtype = torch.float64
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(h) * weight, h)``, ``h = residual + x`` (``x`` ``[M, H]`` or ``[M, S, H]``)."""
    xs = x.to(dtype)
    h = residual.to(dtype) + (xs.sum(1) if xs.dim() == 3 else xs)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd * weight.to(dtype).reshape(-1), h


def gemv(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
         dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``x @ w.T (+ residual)``."""
    y = x.to(dtype) @ w.to(dtype).T
    return y if residual is None else y + residual.to(dtype)


def silu_mul(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]``."""
    xs = x.to(dtype)
    i = xs.shape[-1] // 2
    return torch.nn.functional.silu(xs[..., :i]) * xs[..., i:]


def keep_top_groups(sel: torch.Tensor, groups: int, topk_group: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sel with the experts outside the best topk_group groups at -inf, the group
    scores)``: groups rank by the sum of their two best biased scores ``sel [M, E]``."""
    m, e = sel.shape
    gscore = sel.view(m, groups, e // groups).topk(min(2, e // groups), dim=-1).values.sum(-1)
    if topk_group >= groups:
        return sel, gscore
    mask = torch.zeros(m, groups, dtype=torch.bool, device=sel.device)
    mask.scatter_(1, gscore.topk(topk_group, dim=-1).indices, True)
    return sel.masked_fill(~mask.repeat_interleave(e // groups, dim=1), float("-inf")), gscore


def router_select(logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int,
                  topk_group: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scoring + grouped top-k (DeepSeek-V3 style) from given logits.

    Groups rank by the sum of their two best biased scores; the best ``topk_group`` are
    kept; the top ``topk`` biased scores inside them are chosen; weights are the unbiased
    scores normalized to sum 1, times ``scale``. Returns ``(ids int64 [M, k], weights)``.
    """
    scores = torch.sigmoid(logits.double())
    sel, _ = keep_top_groups(scores + bias.double(), groups, topk_group)
    ids = sel.topk(topk, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True) * scale


def router(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, topk: int, groups: int,
           topk_group: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, ids, weights)``: float64 logits, then :func:`router_select`."""
    logits = x.double() @ wr.double().T
    ids, w = router_select(logits, bias, topk, groups, topk_group, scale)
    return logits, ids, w


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None,
                           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Decode attention by gathering each sequence's pages and calling SDPA (GQA by
    repeating KV heads). ``q [B, Hq, D]``; caches ``[pages, P, Hkv, D]`` (values may be
    narrower: ``Dv``, e.g. MLA's latent prefix of the key); returns ``[B, Hq, Dv]``."""
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    outs = []
    for i in range(b):
        n = int(seq_lens[i])
        ids = block_table[i, :-(-n // page)].long()
        k = k_cache[ids].reshape(-1, hkv, d)[:n].to(dtype)  # [n, Hkv, D]
        v = v_cache[ids].reshape(-1, hkv, dv)[:n].to(dtype)
        k = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qi = q[i].to(dtype).unsqueeze(1)  # [Hq, 1, D]
        o = torch.nn.functional.scaled_dot_product_attention(qi, k, v, scale=scale)
        outs.append(o.squeeze(1))
    return torch.stack(outs)
