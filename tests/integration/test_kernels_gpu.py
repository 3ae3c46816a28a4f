"""Kernels room on a GPU: every kernel against its float64 reference (METHOD.md tolerances),
fresh random inputs per test, outputs poisoned with NaN so an unwritten element fails.
Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from agentload.kernels import KernelsError, LayerConfig, ops  # noqa: E402
from agentload.kernels import reference as ref  # noqa: E402
from agentload.kernels.layer import KVState, MoELayer  # noqa: E402
from agentload.kernels.presets import (  # noqa: E402
    ATTN_LAYER_SPLITS,
    ATTN_LAYER_STAGES,
    LAYER_GEMV_THREADS,
)

BF = torch.bfloat16


def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF)


def nan(*shape: int, dtype: torch.dtype = BF) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize(("batch", "hidden", "slots"), [(1, 2048, 1), (64, 7168, 1),
                                                         (8, 2048, 3)])
def test_add_rmsnorm(batch: int, hidden: int, slots: int) -> None:
    x, r = rnd(batch, slots, hidden), rnd(batch, hidden)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(BF)
    out, h = nan(batch, hidden), nan(batch, hidden)
    ops.add_rmsnorm(x if slots > 1 else x[:, 0], r, w, out=out, residual_out=h)
    want_o, want_h = ref.add_rmsnorm(x, r, w)
    assert ref.rel_err(out, want_o) < ref.BF16_TOL
    assert ref.rel_err(h, want_h) < ref.BF16_TOL


@pytest.mark.parametrize("cluster", [2, 4])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_add_rmsnorm_cluster(cluster: int, hidden: int) -> None:
    # Rows of very different scale: a CTA that used another row's (or only its own)
    # sum of squares would be far off.
    batch = 64
    x = rnd(batch, hidden)
    r = (torch.randn(batch, hidden, device="cuda")
         * torch.linspace(0.1, 10, batch, device="cuda")[:, None]).to(BF)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(BF)
    out, h = nan(batch, hidden), nan(batch, hidden)
    ops.add_rmsnorm(x, r, w, out=out, residual_out=h, cluster=cluster)
    want_o, want_h = ref.add_rmsnorm(x, r, w)
    assert ref.rel_err(out, want_o) < ref.BF16_TOL
    assert ref.rel_err(out[:8], want_o[:8]) < ref.BF16_TOL  # the small rows too
    assert ref.rel_err(h, want_h) < ref.BF16_TOL


@pytest.mark.parametrize("batch", [1, 64])
def test_silu_mul(batch: int) -> None:
    x, out = rnd(batch, 2 * 1024), nan(batch, 1024)
    ops.silu_mul(x, out=out)
    assert ref.rel_err(out, ref.silu_mul(x)) < ref.BF16_TOL


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize(("k", "n"), [(2048, 6144), (7168, 16384)])
def test_gemv(rows: int, k: int, n: int) -> None:
    x, w, res = rnd(rows, k), rnd(n, k, scale=k ** -0.5), rnd(rows, n)
    y = nan(rows, n)
    ops.gemv(x, w, out=y)
    assert ref.rel_err(y, ref.gemv(x, w)) < ref.BF16_TOL
    y.fill_(float("nan"))
    ops.gemv(x, w, res, out=y)
    assert ref.rel_err(y, ref.gemv(x, w, res)) < ref.BF16_TOL


@pytest.mark.parametrize("rows", [4, 8])  # 8 rows: the tensor-core loop reads x rows too
def test_gemv_strided_rows(rows: int) -> None:
    qkv = rnd(rows, 3 * 2048)
    w = rnd(6144, 2048, scale=2048 ** -0.5)
    v = qkv[:, 4096:]
    assert ref.rel_err(ops.gemv(v, w), ref.gemv(v, w)) < ref.BF16_TOL


@pytest.mark.parametrize(("threads", "opb", "mma"), [(128, 16, True), (64, 16, True),
                                                      (256, 32, True), (128, 8, False)])
def test_gemv_8_rows_tensor_core_and_fma_variants(threads: int, opb: int, mma: bool) -> None:
    # Rows of x and of W scaled apart, so a token or an output row swapped in the
    # fragment mapping shows as a large error, not a rounding-sized one.
    k, n = 7168, 16384
    x = (torch.randn(8, k, device="cuda") * torch.arange(1, 9, device="cuda")[:, None]).to(BF)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5
         * (1 + torch.arange(n, device="cuda")[:, None] % 7)).to(BF)
    y = nan(8, n)
    ops.gemv(x, w, out=y, threads=threads, opb=opb, mma=mma)
    assert ref.rel_err(y, ref.gemv(x, w)) < ref.BF16_TOL
    assert ref.rel_err(y[3], ref.gemv(x, w)[3]) < ref.BF16_TOL


@pytest.mark.parametrize("rows", [1, 2, 4, 12, 16, 32, 64])
def test_gemv_tensor_cores_at_every_row_count(rows: int) -> None:
    # Fewer than 8 rows pad the MMA's columns with zeros; more take a tile per 8 rows:
    # each row checked on its own, scaled apart, so a row lost or swapped shows.
    k, n = 7168, 16384
    x = (torch.randn(rows, k, device="cuda")
         * torch.arange(1, rows + 1, device="cuda")[:, None]).to(BF)
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(BF)
    y = nan(rows, n)
    ops.gemv(x, w, out=y, threads=128, opb=16, mma=True)
    want = ref.gemv(x, w)
    for r in range(rows):
        assert ref.rel_err(y[r], want[r]) < ref.BF16_TOL, r


@pytest.mark.parametrize("batch", [1, 8])
def test_oproj_residual_rmsnorm_chain(batch: int) -> None:
    h_dim = 2048
    x, w, res = rnd(batch, h_dim), rnd(h_dim, h_dim, scale=h_dim ** -0.5), rnd(batch, h_dim)
    nw = (1 + 0.1 * torch.randn(h_dim, device="cuda")).to(BF)
    want_n, want_h = ref.add_rmsnorm(ref.gemv(x, w), res, nw)
    for _ in range(3):  # the scratch re-arms itself: every call must be right
        h, normed = nan(batch, h_dim), nan(batch, h_dim)
        ops.oproj_residual_rmsnorm(x, w, res, nw, h_out=h, normed_out=normed)
        assert ref.rel_err(h, want_h) < ref.BF16_TOL
        assert ref.rel_err(normed, want_n) < ref.BF16_TOL


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_router(batch: int) -> None:
    cfg = LayerConfig()
    x, wr = rnd(batch, cfg.hidden), rnd(cfg.experts, cfg.hidden, scale=cfg.hidden ** -0.5)
    bias = 0.1 * torch.randn(cfg.experts, device="cuda")
    lg, ids, wts = ops.moe_router(x, wr, bias, topk=cfg.topk, groups=cfg.groups,
                                  topk_group=cfg.topk_group, scale=cfg.routed_scale, shared=True,
                                  logits=nan(batch, cfg.experts, dtype=torch.float32),
                                  weights=nan(batch, 3, dtype=torch.float32))
    want_lg, _, _ = ref.router(x, wr, bias, cfg.topk, cfg.groups, cfg.topk_group,
                                 cfg.routed_scale)
    assert ref.rel_err(lg, want_lg) < ref.F32_TOL
    # the selection is exact given the logits: compare on the kernel's own logits
    want_ids, want_w = ref.router_select(lg, bias, cfg.topk, cfg.groups,
                                                 cfg.topk_group, cfg.routed_scale)
    got = ids[:, :2].long()
    assert torch.equal(got.sort(1).values, want_ids.sort(1).values)
    assert ref.rel_err(wts[:, :2].gather(1, got.argsort(1)),
                       want_w.gather(1, want_ids.argsort(1))) < ref.F32_TOL
    assert bool((ids[:, 2] == cfg.experts).all()) and bool((wts[:, 2] == 1).all())


def test_grouped_gemv_silu_and_down() -> None:
    e, h, i, s, m = 17, 2048, 1024, 3, 2
    x = rnd(m, h)
    wgu, wd = rnd(e, 2 * i, h, scale=h ** -0.5), rnd(e, h, i, scale=i ** -0.5)
    ids = torch.tensor([3, 0, 16, 1, 3, 16], dtype=torch.int32, device="cuda")
    sc = torch.rand(m * s, device="cuda")
    act = ops.grouped_gemv(x, wgu, ids, sc, silu=True, div=s, out=nan(m * s, i))
    y = ops.grouped_gemv(act, wd, ids, sc, silu=False, div=1, out=nan(m * s, h))
    for r in range(m * s):
        gu = ref.gemv(x[r // s:r // s + 1], wgu[int(ids[r])])
        want_act = ref.silu_mul(gu)
        assert ref.rel_err(act[r:r + 1], want_act) < ref.BF16_TOL
        want_y = float(sc[r]) * ref.gemv(act[r:r + 1], wd[int(ids[r])])
        assert ref.rel_err(y[r:r + 1], want_y) < ref.BF16_TOL


def router_like_ids(batch: int, cfg: LayerConfig, *, seed: int) -> torch.Tensor:
    """``[batch * slots]`` slot ids as the router writes them: distinct routed experts per
    token (drawn from the first half only, so some experts get no row at all), then the
    shared expert."""
    g = torch.Generator().manual_seed(seed)
    rows = [[*torch.randperm(cfg.experts // 2, generator=g)[:cfg.topk].tolist(), cfg.experts]
            for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.int32, device="cuda").view(-1)


@pytest.mark.parametrize(("batch", "tokens", "pass_tiles", "threads"),
                         [(2, 2, 0, 128), (8, 8, 0, 128), (20, 64, 0, 128), (64, 64, 0, 128),
                          (64, 64, 1, 128), (64, 64, 2, 128), (64, 64, 1, 256),
                          (64, 64, 2, 256)])
def test_expert_gemm_matches_every_slot_row(batch: int, tokens: int, pass_tiles: int,
                                            threads: int) -> None:
    # Grouped by expert on the GPU: every slot row must come out as its own expert's
    # GEMV, whatever order the CTA gathered it in; (20, 64) runs fewer rows than compiled.
    cfg = LayerConfig()
    e, h, i, s = cfg.experts + 1, cfg.hidden, cfg.inter, cfg.slots
    x = rnd(batch, h)
    wgu, wd = rnd(e, 2 * i, h, scale=h ** -0.5), rnd(e, h, i, scale=i ** -0.5)
    ids = router_like_ids(batch, cfg, seed=batch)
    sc = torch.rand(batch * s, device="cuda")
    act = ops.expert_gemm(x, wgu, ids, sc, silu=True, div=s, tokens=tokens, slots=s,
                          out=nan(batch * s, i), pass_tiles=pass_tiles, threads=threads)
    y = ops.expert_gemm(act, wd, ids, sc, silu=False, div=1, tokens=tokens, slots=s,
                        out=nan(batch * s, h), pass_tiles=pass_tiles, threads=threads)
    torch.cuda.synchronize()
    for r in range(batch * s):
        want_act = ref.silu_mul(ref.gemv(x[r // s:r // s + 1], wgu[int(ids[r])]))
        assert ref.rel_err(act[r:r + 1], want_act) < ref.BF16_TOL, r
        want_y = float(sc[r]) * ref.gemv(act[r:r + 1], wd[int(ids[r])])
        assert ref.rel_err(y[r:r + 1], want_y) < ref.BF16_TOL, r
    # the same rows through the per-row kernel agree
    if batch <= 16:
        act2 = ops.grouped_gemv(x, wgu, ids, sc, silu=True, div=s)
        assert ref.rel_err(act2, act.double()) < ref.BF16_TOL
    with pytest.raises(KernelsError, match="exceed"):
        ops.expert_gemm(x, wgu, ids, sc, silu=True, div=s, tokens=batch - 1 or 1, slots=1)


def test_kernels_are_cached_not_recompiled() -> None:
    x = rnd(4, 2048)
    ops.silu_mul(x)
    n = ops.loaded_count()
    for _ in range(5):
        ops.silu_mul(rnd(4, 2048))
    assert ops.loaded_count() == n


def test_kernel_runs_inside_cuda_graph() -> None:
    x, out = rnd(8, 2048), nan(8, 1024)
    ops.silu_mul(x, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.silu_mul(x, out=out)
    x.copy_(rnd(8, 2048))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert ref.rel_err(out, ref.silu_mul(x)) < ref.BF16_TOL


def test_bad_shapes_raise_kernels_error() -> None:
    with pytest.raises(KernelsError, match="rows"):
        ops.gemv(rnd(65, 2048), rnd(2048, 2048))
    with pytest.raises(KernelsError, match="shape"):
        ops.add_rmsnorm(rnd(2, 2048), rnd(2, 1024), rnd(1024))


@pytest.mark.parametrize(("mma", "merge"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("context", [1, 4096])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_layer_paths_match_reference(batch: int, context: int, mma: bool, merge: bool) -> None:
    cfg = LayerConfig()
    layer = MoELayer(cfg, "cuda", seed=batch)
    layer.attention_mma, layer.attention_merge = mma, merge
    x, r = layer.inputs(batch, seed=batch + 1)
    kv = None if context == 1 else KVState.random(cfg, batch, context, "cuda", seed=batch)
    for path in (layer.fused, layer.standard):
        got = MoELayer.result(path(x, r, kv))
        ids = layer.last_ids
        assert ids is not None
        assert ref.rel_err(got, layer.reference(x, r, ids, kv=kv)) < ref.BF16_TOL
        _, off = layer.routing_check(x, r, ids, kv=kv)
        assert off == 0  # routing differs from float64 only at near-ties


@pytest.mark.parametrize("stages", ATTN_LAYER_STAGES)
def test_layer_attention_split_finer_than_the_gpu_matches_reference(stages: int) -> None:
    # batch 64 fills the GPU with whole contexts; 2048-token chunks, merged by their last
    # CTA, the step's own token in the second
    cfg = LayerConfig()
    layer = MoELayer(cfg, "cuda", seed=5)
    layer.attention_mma = layer.attention_merge = layer.attention_lines = True
    layer.attention_stages, layer.attention_chunk = stages, ATTN_LAYER_SPLITS[0]
    x, r = layer.inputs(64, seed=6)
    kv = KVState.random(cfg, 64, 2 * ATTN_LAYER_SPLITS[0], "cuda", seed=7)
    for _ in range(2):  # the merging CTAs re-arm their counters for the next call
        got = MoELayer.result(layer.fused(x, r, kv))
        ids = layer.last_ids
        assert ids is not None
        assert ref.rel_err(got, layer.reference(x, r, ids, kv=kv)) < ref.BF16_TOL


@pytest.mark.parametrize("threads", LAYER_GEMV_THREADS)
def test_layer_projection_gemvs_on_more_warps_match_reference(threads: int) -> None:
    batch = 64  # above the FMA GEMV's rows: the tensor-core loop's K split over the warps
    cfg = LayerConfig()
    layer = MoELayer(cfg, "cuda", seed=8)
    layer.attention_mma = layer.attention_lines = True
    layer.gemv_threads = threads
    x, r = layer.inputs(batch, seed=9)
    kv = KVState.random(cfg, batch, 4096, "cuda", seed=10)
    got = MoELayer.result(layer.fused(x, r, kv))
    ids = layer.last_ids
    assert ids is not None
    assert ref.rel_err(got, layer.reference(x, r, ids, kv=kv)) < ref.BF16_TOL
    for n in (cfg.qkv_out, cfg.hidden):  # and the op alone, against float32
        xs, w = rnd(batch, cfg.hidden), rnd(n, cfg.hidden)
        assert ref.rel_err(ops.gemv(xs, w, threads=threads), xs.float() @ w.float().T
                           ) < ref.BF16_TOL


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("context", [1, 32768])
def test_fused_layer_replays_in_a_cuda_graph(batch: int, context: int) -> None:
    cfg = LayerConfig()
    layers = [MoELayer(cfg, "cuda", seed=20 + i, index=i) for i in range(2)]
    # one layer on each attention kernel; the tensor-core one merging its own chunks
    layers[1].attention_mma = layers[1].attention_merge = True
    x, r = layers[0].inputs(batch, seed=3)
    states = [None if context == 1 else KVState.random(cfg, batch, context, "cuda", seed=i)
              for i in range(2)]

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        y, h = x, r
        for lay, st in zip(layers, states, strict=True):  # PDL across the layer boundary too
            y, h = lay.fused(y, h, st)
        return y, h

    want = MoELayer.result(step())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(3):
        out[0].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        # not bitwise: the fused norm's float atomics add in a different order each run
        assert ref.rel_err(MoELayer.result(out), want) < ref.BF16_TOL
