"""Kernel specifications and the shape rules every kernel checks (pure Python, no torch).

A :class:`KernelSpec` names one compiled variant: the kernel kind plus every value that
is fixed at compile time (hidden size, rows, threads, ...). Its :meth:`KernelSpec.key` is
the compile-cache key and the exported file's name, so a variant is compiled once per
GPU architecture and loaded from disk afterwards. The ``choose_*`` functions turn a
problem shape into a spec, raising :class:`KernelsError` with the reason when a shape is
outside what the kernels handle (the torch path is the fallback for those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from agentload.kernels.errors import KernelsError

Kind = Literal["add_rmsnorm", "silu_mul", "gemv", "grouped_gemv", "router", "decode_attn",
               "attn_combine", "expert_gemm"]
VEC = 8  #: bf16 values per 16-byte access
GEMV_MAX_ROWS = 16  #: above this batch the FP32-FMA GEMV loses to tensor cores
MMA_ROWS = 8  #: the tensor-core GEMV's batch: the n = 8 of mma.sync m16n8k16
MMA_MAX_ROWS = 64  #: tensor-core GEMV and expert GEMM: up to 8 token tiles of 8
ROUTER_MAX_EXPERTS = 64  #: the router's selection is fully unrolled over experts
ATTN_HEAD_DIMS = (64, 128, 256)  #: D / 8 lanes per token must divide a warp
ATTN_MAX_GROUP = 8  #: query heads per KV head (accumulators per lane: 8 x group)
SMEM_PER_CTA = 227 * 1024  #: Hopper's opt-in shared memory per CTA
ATTN_COMBINE_DIMS = (64, 128, 192, 256, 384, 512)  #: value widths the combine merges
ATTN_MMA_MAX_GROUP = 16  #: query heads per KV head on tensor cores (the MMA's 16 rows)
#: Split-KV chunk lengths compiled. The long ones serve batches whose sequences and KV
#: heads alone fill the GPU: one chunk per sequence, no combine kernel.
ATTN_CHUNKS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """One compiled kernel variant: its kind and its compile-time parameters."""

    kind: Kind
    params: tuple[tuple[str, int | float | bool], ...]

    def get(self, name: str, default: int | float | bool | None = None) -> int | float | bool:
        for key, value in self.params:
            if key == name:
                return value
        if default is None:
            raise KeyError(name)
        return default

    def key(self) -> str:
        """File-name-safe cache key, e.g. ``gemv-k2048-n3072-m1-t128-opb4-res0-norm0``."""
        parts = [self.kind.replace("_", "")]
        for name, value in self.params:
            if isinstance(value, bool):
                value = int(value)
            text = f"{value:g}" if isinstance(value, float) else str(value)
            parts.append(f"{name}{text.replace('.', 'p').replace('-', 'm')}")
        return "-".join(parts)


def _spec(kind: Kind, pdl: bool = False, **params: int | float | bool) -> KernelSpec:
    # ``pdl`` (programmatic dependent launch) joins the key only when on, so the keys of
    # the plain variants stay what they were.
    items = tuple(params.items()) + ((("pdl", True),) if pdl else ())
    return KernelSpec(kind, items)


def _threads_for(length: int, candidates: tuple[int, ...]) -> int:
    """The first thread count whose tile (threads * 8 values) divides ``length``."""
    for t in candidates:
        if length % (t * VEC) == 0:
            return t
    raise KernelsError(
        f"length {length} is not a multiple of {min(candidates) * VEC} (8 bf16 per thread "
        f"and at least {min(candidates)} threads)")


def check_dims(name: str, shape: tuple[int, ...], want: tuple[int | None, ...]) -> None:
    """Raise unless ``shape`` has ``len(want)`` dims matching ``want`` (None = any size)."""
    if len(shape) != len(want) or any(w is not None and s != w for s, w in zip(shape, want,
                                                                                strict=False)):
        pretty = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        raise KernelsError(f"{name} has shape {list(shape)}, expected {pretty}")


def add_rmsnorm_spec(hidden: int, slots: int = 1, *, pdl: bool = False,
                     cluster: int = 1) -> KernelSpec:
    """Fused residual add (+ sum of ``slots`` inputs) and RMSNorm over ``hidden``;
    ``cluster`` CTAs per row (1, 2 or 4) split the row's columns."""
    if slots < 1 or slots > 16:
        raise KernelsError(f"slots must be 1..16, got {slots}")
    if hidden % VEC:
        raise KernelsError(f"hidden {hidden} must be a multiple of {VEC}")
    if cluster not in (1, 2, 4) or (hidden // VEC) % cluster:
        raise KernelsError(f"cluster must be 1, 2 or 4 and split hidden / 8 = {hidden // VEC} "
                           f"evenly, got {cluster}")
    # Aim for 2 vectors per thread (short dependency chains, one load round trip).
    vecs = hidden // VEC // cluster
    options = [t for t in range(32, 1025, 32) if vecs % t == 0]
    if not options:
        raise KernelsError(f"hidden {hidden} / 8 / cluster {cluster} must be divisible by a "
                           "multiple of 32")
    threads = min(options, key=lambda t: (abs(vecs // t - 2), -t))
    if cluster > 1:  # joins the key only when on, so the one-CTA keys stay what they were
        return _spec("add_rmsnorm", pdl, h=hidden, s=slots, t=threads, c=cluster)
    return _spec("add_rmsnorm", pdl, h=hidden, s=slots, t=threads)


def silu_mul_spec(inter: int) -> KernelSpec:
    """SiLU(gate) * up for an ``[M, 2 * inter]`` input."""
    if inter % VEC:
        raise KernelsError(f"intermediate size {inter} must be a multiple of {VEC}")
    return _spec("silu_mul", i=inter, t=128)


def gemv_spec(k: int, n: int, rows: int, *, residual: bool = False,
              fuse_norm: bool = False, opb: int | None = None,
              threads: int | None = None, pdl: bool = False,
              mma: bool | None = None) -> KernelSpec:
    """Small-batch GEMV ``[rows, k] @ [n, k]^T``; optional residual and fused RMSNorm.

    ``mma`` picks the tensor-core main loop (any row count: fewer than 8 rows pad the
    MMA's 8 columns with zeros, more take one tile per 8 rows; the default at 8 rows
    whenever the shape allows it, and the only loop above 16 rows: 16 outputs per CTA,
    128 threads); the FMA loop otherwise.
    """
    if not 1 <= rows <= MMA_MAX_ROWS or (rows > GEMV_MAX_ROWS and mma is False):
        raise KernelsError(f"GEMV handles 1..{GEMV_MAX_ROWS} rows (1..{MMA_MAX_ROWS} on "
                           f"tensor cores), got {rows}")
    if rows > GEMV_MAX_ROWS:
        mma = True
    if mma is None:
        mma = (rows == MMA_ROWS and opb in (None, 16, 32) and threads in (None, 64, 128, 256)
               and k % (threads or 128) == 0 and n % (opb or 16) == 0)
    if mma:
        t = threads or 128
        o = opb or 16
        if t % 32 or not 32 <= t <= 1024 or k % t:
            # each warp takes 32-wide K chunks in turn: the CTA covers threads values a step
            raise KernelsError(f"tensor-core GEMV: K {k} must be a multiple of the threads "
                               f"{t} (a multiple of 32)")
        if o not in (16, 32) or n % o:
            raise KernelsError(f"tensor-core GEMV: outputs per block must be 16 or 32 and "
                               f"divide N {n}, got {o}")
    else:
        t = threads or _threads_for(k, (128, 64, 256, 32))
        if k % (t * VEC):
            raise KernelsError(f"K {k} must be a multiple of threads*8 = {t * VEC}")
        o = opb or 4
        if n % o:
            raise KernelsError(f"N {n} must be a multiple of outputs per block {o}")
        if t < 32 or t % 32 or rows * o > t:
            raise KernelsError(f"bad GEMV tile: threads {t}, rows {rows}, outputs per block {o}")
    if fuse_norm and (rows * o > t or 32 % o):
        raise KernelsError(f"the fused norm needs rows * outputs per block <= threads and "
                           f"outputs per block dividing 32, got {rows} x {o} on {t} threads")
    items: dict[str, int | bool] = {"k": k, "n": n, "m": rows, "t": t, "opb": o,
                                    "res": residual, "norm": fuse_norm}
    if mma:  # joins the key only when on, so the FMA variants keep their keys
        items["mma"] = True
    return _spec("gemv", pdl, **items)


def grouped_gemv_spec(k: int, n: int, experts: int, *, div: int, silu: bool,
                      opb: int = 4, pdl: bool = False) -> KernelSpec:
    """Expert GEMV over (token, slot) rows; ``silu`` fuses SiLU-and-mul (``n`` = 2 * I)."""
    t = _threads_for(k, (128, 64, 256, 32))
    n_out = n // 2 if silu else n
    if silu and n % 2:
        raise KernelsError(f"gate/up width {n} must be even")
    if n_out % opb:
        raise KernelsError(f"output width {n_out} must be a multiple of {opb}")
    return _spec("grouped_gemv", pdl, k=k, n=n, e=experts, t=t, opb=opb, div=div, silu=silu)


def expert_gemm_spec(k: int, n: int, experts: int, *, tokens: int, slots: int, div: int,
                     silu: bool, threads: int = 128, pdl: bool = False,
                     pass_tiles: int = 0) -> KernelSpec:
    """Tensor-core expert GEMM over rows grouped by expert (up to ``tokens`` per expert).

    The same rows as :func:`grouped_gemv_spec` (``slots`` per token, ``div`` rows per x
    row), but one CTA per (16 weight rows, expert) gathers its expert's rows from the
    router's ids itself, so each expert's weights are read once per step whatever the
    batch. ``tokens`` is rounded up to whole MMA tiles of 8. ``pass_tiles`` (1-4) takes
    that many tiles per pass over K, in as many passes as an expert's rows need (0: all
    tiles in one pass).
    """
    if not 1 <= tokens <= MMA_MAX_ROWS:
        raise KernelsError(f"expert GEMM takes 1..{MMA_MAX_ROWS} tokens per expert, got {tokens}")
    if threads % 32 or not 32 <= threads <= 1024 or k % threads:
        raise KernelsError(f"expert GEMM: K {k} must be a multiple of the threads {threads} "
                           "(a multiple of 32)")
    if silu and (n % 2 or (n // 2) % 8):
        raise KernelsError(f"expert GEMM: gate/up width {n} must be 2 x a multiple of 8")
    if not silu and n % 16:
        raise KernelsError(f"expert GEMM: output width {n} must be a multiple of 16")
    if slots < 1 or div not in (1, slots):
        raise KernelsError(f"expert GEMM: div must be 1 or the slots {slots}, got {div}")
    if not 0 <= pass_tiles <= 4:
        raise KernelsError(f"expert GEMM: pass_tiles must be 0 (one pass) or 1..4, got "
                           f"{pass_tiles}")
    m = -(-tokens // 8) * 8
    items: dict[str, int | bool] = {"k": k, "n": n, "e": experts, "m": m, "s": slots,
                                    "t": threads, "div": div, "silu": silu}
    if pass_tiles and pass_tiles < m // 8:  # joins the key only when it changes the kernel
        items["pt"] = pass_tiles
    return _spec("expert_gemm", pdl, **items)


def router_spec(hidden: int, experts: int, topk: int, groups: int, topk_group: int,
                scale: float, shared: bool, *, pdl: bool = False) -> KernelSpec:
    """Router logits -> sigmoid -> grouped top-k -> normalized weights, one kernel."""
    if experts > ROUTER_MAX_EXPERTS:
        raise KernelsError(f"router kernel handles <= {ROUTER_MAX_EXPERTS} experts, "
                           f"got {experts}")
    if groups < 1 or experts % groups:
        raise KernelsError(f"{experts} experts do not split into {groups} groups")
    if not 1 <= topk_group <= groups:
        raise KernelsError(f"topk_group {topk_group} must be 1..{groups}")
    if not 1 <= topk <= topk_group * (experts // groups):
        raise KernelsError(f"top-k {topk} exceeds the experts in {topk_group} groups")
    if hidden % (32 * VEC):
        raise KernelsError(f"router hidden {hidden} must be a multiple of {32 * VEC}")
    return _spec("router", pdl, h=hidden, e=experts, k=topk, g=groups, tg=topk_group,
                 scale=float(scale), shared=shared)


def decode_attention_spec(head_dim: int, group: int, page: int, chunk: int, *,
                          direct: bool, threads: int = 128, unroll: int = 4,
                          pdl: bool = False, fresh: bool = False,
                          pipe: bool = False, mma: bool = False,
                          stages: int = 3, value_dim: int = 0,
                          latent: bool = False, merge: bool = False,
                          shared: bool = False, kv_heads: int = 1,
                          lines: bool = False, timeline: bool = False,
                          dynamic: bool = False, dynamic_fixed: int = 0) -> KernelSpec:
    """Split-KV decode attention over a paged cache: ``group`` query heads per KV head,
    ``page`` tokens per cache page, ``chunk`` tokens per CTA; ``direct`` writes the bf16
    output itself (every context fits one chunk, no combine); ``fresh`` takes the step's
    own key and value from the projection and appends them to the cache; ``pipe`` issues
    each iteration's loads during the previous iteration's math (double-buffered).

    ``mma``: the tensor-core kernel (:class:`DecodeAttentionMma`): ``threads / 32`` warps
    each take tiles of 16 tokens, streamed ``stages - 1`` tiles ahead by ``cp.async``; up
    to 16 query heads per KV head, head dim a multiple of 64, pages of a multiple of 16
    tokens (``unroll`` and ``pipe`` do not apply). ``latent`` (tensor cores only) is MLA:
    one KV head, the key ``head_dim`` wide (latent + rope), the value its first
    ``value_dim`` columns. ``merge`` (tensor cores, split contexts only): the last CTA of
    each (sequence, KV head) merges the chunks, so no combine kernel follows. ``shared``
    (with ``latent``): one CTA of ``value_dim / 128`` warps per chunk shares each tile
    (:class:`DecodeAttentionMla`; ``threads`` follows). ``kv_heads`` (tensor cores, GQA):
    KV heads per CTA, its warps dealt out over them, so a CTA reads whole pages (vLLM's
    pages interleave the heads) and ``kv_heads`` times fewer CTAs cover a chunk. ``lines``
    (tensor cores): a tile's keys are copied in whole 128-byte lines and the MMA's lanes
    read them back after a warp barrier (else each lane copies the 64-byte pieces its
    fragment needs). ``timeline`` (tensor cores, GQA; a diagnostic whose outputs are
    wrong): each CTA stamps its phases over its first head's partial output, read by
    ``kernels.tools.attn_probe --timeline``. ``dynamic`` (tensor cores, GQA, 2 stages,
    split): the CTAs of a (sequence, KV head) take its 16-token tiles from a shared
    counter instead of a chunk each, one partial per CTA (``chunk`` is then one
    iteration's tokens; the combine takes every partial); ``dynamic_fixed`` (1-3) deals
    that many quarters of each warp's even share of the tiles out statically first (no
    atomic for them), the counter giving out only the rest."""
    if shared:
        return _mla_shared_spec(head_dim, group, page, chunk, direct=direct, stages=stages,
                                pdl=pdl, value_dim=value_dim, latent=latent, merge=merge,
                                fresh=fresh)
    if mma or latent:
        return _mma_attention_spec(head_dim, group, page, chunk, direct=direct,
                                   threads=threads, stages=stages, pdl=pdl, fresh=fresh,
                                   value_dim=value_dim, latent=latent, merge=merge,
                                   kv_heads=kv_heads, lines=lines, timeline=timeline,
                                   dynamic=dynamic, dynamic_fixed=dynamic_fixed)
    if lines:
        raise KernelsError("lines (keys copied in whole lines) needs mma")
    if kv_heads != 1:
        raise KernelsError("kv_heads (several KV heads per CTA) needs mma")
    if merge:
        raise KernelsError("merge (the last CTA merges the chunks) needs mma")
    if head_dim not in ATTN_HEAD_DIMS:
        raise KernelsError(f"decode attention takes head dim {ATTN_HEAD_DIMS}, got {head_dim}")
    if not 1 <= group <= ATTN_MAX_GROUP:
        raise KernelsError(f"query heads per KV head must be 1..{ATTN_MAX_GROUP}, got {group}")
    if page < 1:
        raise KernelsError(f"page size must be >= 1, got {page}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise KernelsError(f"threads must be a multiple of 32 up to 1024, got {threads}")
    step = (threads // 32) * (256 // head_dim) * unroll  # tokens one iteration covers
    if chunk % step:
        raise KernelsError(f"chunk {chunk} must be a multiple of the {step} tokens one "
                           f"iteration of {threads} threads x {unroll} covers")
    items: dict[str, int | bool] = {"d": head_dim, "g": group, "p": page, "c": chunk,
                                    "t": threads, "u": unroll, "direct": direct}
    if fresh:  # joins the key only when on
        items["fresh"] = True
    if pipe:
        items["pipe"] = True
    return _spec("decode_attn", pdl, **items)


def mma_attention_smem(head_dim: int, group: int, page: int, chunk: int, warps: int,
                       stages: int, value_dim: int, latent: bool) -> int:
    """Shared-memory bytes of one :class:`DecodeAttentionMma` CTA (as it launches)."""
    dvs = 128 if latent else value_dim  # value columns per CTA
    vectors = 2 * (head_dim // 32) + 4 * (dvs // 64)  # 16-byte vectors per lane per tile
    q_frags = (head_dim // 32) * 2 * 32 * 16 if head_dim // 32 > 8 else 0
    return (warps * stages * vectors * 32 * 16 + chunk // page * 4
            + warps * group * (dvs + 2) * 4 + 256 + q_frags)


MLA_ROW_PAD = 8  #: bf16 after each row of the shared MLA tile: rows 16 bytes apart in banks


def mla_shared_smem(head_dim: int, value_dim: int, page: int, chunk: int, stages: int) -> int:
    """Shared-memory bytes of one :class:`DecodeAttentionMla` CTA (as it launches)."""
    warps = value_dim // 128
    return (stages * 16 * (head_dim + MLA_ROW_PAD) * 2 + warps * 32 * 8 * 4
            + chunk // page * 4 + 256)


def mma_chunk_rules(head_dim: int, group: int, page: int, threads: int, stages: int,
                    value_dim: int, latent: bool, shared: bool = False,
                    kv_heads: int = 1) -> tuple[int, int]:
    """``(step, ctas_per_sm)`` for :func:`attention_chunk` on the tensor-core kernels
    (``shared``: the MLA one whose CTA shares each tile): a chunk of whole iterations and
    whole pages, and the CTAs its shared memory lets an SM hold (at most the 2 the choice
    aims at)."""
    if shared:
        smem = mla_shared_smem(head_dim, value_dim, page, 512, stages)
        tokens = 16  # the CTA's warps share each 16-token tile
    else:
        smem = mma_attention_smem(head_dim, group, page, 512, threads // 32, stages,
                                  value_dim, latent)
        tokens = 16 * (threads // 32 // kv_heads)
    return math.lcm(tokens, page), max(1, min(2, SMEM_PER_CTA // smem))


def _mma_attention_spec(head_dim: int, group: int, page: int, chunk: int, *, direct: bool,
                        threads: int, stages: int, pdl: bool, fresh: bool,
                        value_dim: int = 0, latent: bool = False,
                        merge: bool = False, kv_heads: int = 1,
                        lines: bool = False, timeline: bool = False,
                        dynamic: bool = False, dynamic_fixed: int = 0) -> KernelSpec:
    if merge and direct:
        raise KernelsError("merge applies to a context split over chunks (direct needs none)")
    if latent:
        if head_dim % 32 or not 128 <= head_dim <= 1024:
            raise KernelsError(f"MLA attention takes a key (latent + rope) of a multiple of "
                               f"32 up to 1024, got {head_dim}")
        if value_dim % 128 or not 128 <= value_dim <= head_dim:
            raise KernelsError(f"MLA attention takes a value (the key's latent prefix) of a "
                               f"multiple of 128 up to the key's {head_dim}, got {value_dim}")
        if fresh:
            raise KernelsError("MLA attention does not take the step's own key (append it "
                               "to the cache first)")
        if merge:
            raise KernelsError("merge is for GQA only: MLA's 512 value columns would be "
                               "merged by one small CTA (use the combine)")
    elif head_dim % 64 or not 64 <= head_dim <= 256:
        raise KernelsError(f"tensor-core attention takes a head dim of 64, 128, 192 or 256, "
                           f"got {head_dim}")
    elif value_dim not in (0, head_dim):
        raise KernelsError("a value narrower than the key needs latent (MLA)")
    if not 1 <= group <= ATTN_MMA_MAX_GROUP:
        raise KernelsError(f"tensor-core attention takes 1..{ATTN_MMA_MAX_GROUP} query heads "
                           f"per KV head (the MMA's rows), got {group}")
    if page < 16 or page % 16:
        raise KernelsError(f"tensor-core attention needs pages of a multiple of 16 tokens "
                           f"(one page per tile), got {page}")
    if chunk % page:
        raise KernelsError(f"tensor-core attention needs a chunk of whole pages: {chunk} "
                           f"is not a multiple of {page}")
    if threads % 32 or not 32 <= threads <= 512:
        raise KernelsError(f"threads must be a multiple of 32 up to 512, got {threads}")
    if not 2 <= stages <= 6:
        raise KernelsError(f"stages must be 2..6, got {stages}")
    if kv_heads < 1 or (threads // 32) % kv_heads:
        raise KernelsError(f"kv_heads {kv_heads} must divide the CTA's {threads // 32} warps")
    if latent and kv_heads != 1:
        raise KernelsError("MLA has one KV head: kv_heads must be 1")
    step = (threads // 32 // kv_heads) * 16
    if chunk % step:
        raise KernelsError(f"chunk {chunk} must be a multiple of the {step} tokens "
                           f"{threads // 32} warps over {kv_heads} KV head(s) take per "
                           f"iteration")
    smem = mma_attention_smem(head_dim, group, page, chunk, threads // 32, stages,
                              value_dim or head_dim, latent)
    if smem > SMEM_PER_CTA:
        raise KernelsError(f"{threads // 32} warps x {stages} stages need {smem // 1024} KiB "
                           f"of shared memory, more than a CTA's {SMEM_PER_CTA // 1024} KiB: "
                           f"fewer warps or stages")
    items: dict[str, int | bool] = {"d": head_dim, "g": group, "p": page, "c": chunk,
                                    "t": threads, "mma": True, "st": stages, "direct": direct}
    if fresh:
        items["fresh"] = True
    if latent:
        items["dv"] = value_dim
        items["latent"] = True
    if merge:
        items["merge"] = True
    if kv_heads > 1:  # joins the key only when on
        items["kh"] = kv_heads
    if lines:
        items["kl"] = True
    if timeline:
        if latent or merge:
            raise KernelsError("timeline stamps GQA attention that a combine follows or "
                               "that writes directly (not MLA, not merge)")
        items["tl"] = True
    if dynamic:
        if latent or merge or direct or fresh or kv_heads != 1 or stages != 2:
            raise KernelsError("dynamic splits GQA attention (one KV head a CTA, 2 stages) "
                               "whose combine follows: not MLA, merge, direct or fresh")
        items["dyn"] = True
        if not 0 <= dynamic_fixed <= 3:
            raise KernelsError(f"dynamic_fixed is 0..3 quarters, got {dynamic_fixed}")
        if dynamic_fixed:
            items["dfx"] = dynamic_fixed
    elif dynamic_fixed:
        raise KernelsError("dynamic_fixed applies to the dynamic split only")
    return _spec("decode_attn", pdl, **items)


def _mla_shared_spec(head_dim: int, group: int, page: int, chunk: int, *, direct: bool,
                     stages: int, pdl: bool, value_dim: int, latent: bool, merge: bool,
                     fresh: bool) -> KernelSpec:
    if not latent or merge or fresh:
        raise KernelsError("shared (one CTA per chunk sharing each tile) is MLA only "
                           "(latent), without merge or the step's own key")
    # the same shape rules as the per-slice kernel (it checks key, value, heads, pages)
    _mma_attention_spec(head_dim, group, page, chunk, direct=direct, threads=32,
                        stages=stages, pdl=pdl, fresh=False, value_dim=value_dim, latent=True)
    if chunk % 16:
        raise KernelsError(f"chunk {chunk} must be a multiple of 16 tokens")
    smem = mla_shared_smem(head_dim, value_dim, page, chunk, stages)
    if smem > SMEM_PER_CTA:
        raise KernelsError(f"{stages} stages need {smem // 1024} KiB of shared memory, more "
                           f"than a CTA's {SMEM_PER_CTA // 1024} KiB")
    items: dict[str, int | bool] = {"d": head_dim, "g": group, "p": page, "c": chunk,
                                    "t": 32 * (value_dim // 128), "mma": True, "st": stages,
                                    "direct": direct, "dv": value_dim, "latent": True,
                                    "shared": True}
    return _spec("decode_attn", pdl, **items)


def attention_combine_spec(head_dim: int, chunk: int, *, threads: int = 256,
                           pdl: bool = False, every: bool = False) -> KernelSpec:
    """Merge of :func:`decode_attention_spec`'s chunks (same ``chunk``); ``head_dim`` is
    the value's width (512 for MLA). ``every``: all the partials there are, whatever the
    length (a dynamic split writes one per CTA)."""
    if head_dim not in ATTN_COMBINE_DIMS:
        raise KernelsError(f"attention combine takes head dim {ATTN_COMBINE_DIMS}, "
                           f"got {head_dim}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise KernelsError(f"threads must be a multiple of 32 up to 1024, got {threads}")
    if every:
        return _spec("attn_combine", pdl, d=head_dim, c=chunk, t=threads, all=True)
    return _spec("attn_combine", pdl, d=head_dim, c=chunk, t=threads)


def dynamic_fill_ctas(batch: int, kv_heads: int, *, sms: int, ctas_per_sm: int) -> int:
    """CTAs a (sequence, KV head) of the dynamic split needs to fill the GPU (at least
    one): ``ctas_per_sm`` on each of ``sms``, shared by every (sequence, KV head)."""
    return max(1, sms * ctas_per_sm // (batch * kv_heads))


def attention_chunk(batch: int, kv_heads: int, max_len: int, *, sms: int = 132,
                    ctas_per_sm: int = 2, step: int = 32) -> int:
    """Split-KV chunk length for a step: the smallest of :data:`ATTN_CHUNKS` (a multiple of
    ``step``) that keeps the grid near ``ctas_per_sm`` CTAs per SM; longer chunks mean
    fewer partial outputs for the combine to read."""
    target = sms * ctas_per_sm
    options = [c for c in ATTN_CHUNKS if c % step == 0]
    for c in options:
        if batch * kv_heads * -(-max_len // c) <= target:
            return c
    # the sequences alone fill the GPU: one chunk each, no longer than the context needs
    return next((c for c in options if c >= max_len), options[-1])
