"""Kernels room, CPU only: import without GPU/cutlass, shape rules, cache keys, references."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from agentload.kernels import KernelsError, LayerConfig, bench_specs
from agentload.kernels.presets import (
    ATTN_ALL_HEADS,
    ATTN_HEADS_TILES,
    ATTN_MMA_TILES,
    gemv_variants,
)
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


def test_import_needs_no_gpu_torch_or_cutlass() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['cutlass'] = None; "
            "import agentload.kernels as k; print(len(k.bench_specs()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 10


def test_error_derives_from_agentload_error() -> None:
    from agentload import AgentloadError

    assert issubclass(KernelsError, AgentloadError)


def test_spec_keys_are_unique_and_file_safe() -> None:
    keys = [s.key() for s in bench_specs()]
    assert len(keys) == len(set(keys))
    assert all(k.replace("-", "").isalnum() for k in keys)
    assert gemv_spec(2048, 2048, 1, residual=True, fuse_norm=True).key() == \
        "gemv-k2048-n2048-m1-t128-opb4-res1-norm1"
    assert router_spec(2048, 16, 2, 4, 2, 2.5, True).key().endswith("scale2p5-shared1")


def test_shape_rules() -> None:
    assert add_rmsnorm_spec(7168).get("t") == 448  # 7168 = 448 threads * 8 * 2 vectors
    assert add_rmsnorm_spec(2048, 3).get("s") == 3
    assert add_rmsnorm_spec(7168, cluster=2).key() == "addrmsnorm-h7168-s1-t224-c2"
    assert add_rmsnorm_spec(7168, cluster=4).get("t") == 224  # 1 vector per thread
    with pytest.raises(KernelsError, match="cluster"):
        add_rmsnorm_spec(7168, cluster=3)
    with pytest.raises(KernelsError, match="multiple of 8"):
        add_rmsnorm_spec(2050)
    with pytest.raises(KernelsError, match=r"1\.\.16 rows"):
        gemv_spec(2048, 2048, 17, mma=False)
    with pytest.raises(KernelsError, match="outputs per block"):
        gemv_spec(2048, 2046, 1)
    with pytest.raises(KernelsError, match="multiple of"):
        gemv_spec(1000, 2048, 1)
    with pytest.raises(KernelsError, match=r"<= 64 experts"):
        router_spec(2048, 128, 2, 4, 2, 1.0, False)
    with pytest.raises(KernelsError, match="groups"):
        router_spec(2048, 16, 2, 3, 2, 1.0, False)
    with pytest.raises(KernelsError, match="top-k"):
        router_spec(2048, 16, 9, 4, 2, 1.0, False)
    with pytest.raises(KernelsError, match="even"):
        grouped_gemv_spec(2048, 2047, 17, div=3, silu=True)
    with pytest.raises(KernelsError, match="multiple of 8"):
        silu_mul_spec(1001)
    with pytest.raises(KernelsError, match=r"expected \[2, \*\]"):
        check_dims("x", (3, 4), (2, None))


def test_gemv_picks_tensor_cores_at_eight_rows() -> None:
    spec = gemv_spec(7168, 16384, 8)
    assert spec.key() == "gemv-k7168-n16384-m8-t128-opb16-res0-norm0-mma1"
    assert gemv_spec(2048, 2048, 8, residual=True, fuse_norm=True).get("mma") is True
    assert gemv_spec(7168, 16384, 4).get("mma", False) is False  # FMA below 8 rows
    assert gemv_spec(7168, 16384, 8, opb=4).get("mma", False) is False  # FMA tile asked
    assert gemv_spec(7168, 16384, 8, mma=False).get("opb") == 4
    # any row count on tensor cores when asked: 1-7 pad the MMA's 8 columns, 9-16 two tiles
    assert gemv_spec(2048, 2048, 4, mma=True).key().endswith("m4-t128-opb16-res0-norm0-mma1")
    assert gemv_spec(2048, 2048, 13, mma=True).get("m") == 13
    with pytest.raises(KernelsError, match="16 or 32"):
        gemv_spec(2048, 2048, 8, opb=8, mma=True)
    with pytest.raises(KernelsError, match="multiple of the threads"):
        gemv_spec(2112, 2048, 8, threads=128, mma=True)
    with pytest.raises(KernelsError, match="fused norm"):
        gemv_spec(2048, 2048, 8, opb=32, threads=128, mma=True, fuse_norm=True)
    variants = [s.key() for s in gemv_variants(7168, 16384, 8)]
    assert sum(k.endswith("mma1") for k in variants) == 4
    assert any("mma" in s.key() for s in gemv_variants(7168, 16384, 4))  # tried, not default


def test_tensor_cores_take_17_to_64_rows() -> None:
    spec = gemv_spec(2048, 3072, 64)
    assert spec.key() == "gemv-k2048-n3072-m64-t128-opb16-res0-norm0-mma1"
    assert gemv_spec(2048, 2048, 17).get("mma") is True
    with pytest.raises(KernelsError, match=r"1\.\.64 on tensor cores"):
        gemv_spec(2048, 2048, 65)
    with pytest.raises(KernelsError, match="rows"):
        gemv_spec(2048, 2048, 32, mma=False)  # the FMA loop unrolls rows: 16 at most
    with pytest.raises(KernelsError, match="fused norm"):
        gemv_spec(2048, 2048, 64, residual=True, fuse_norm=True)
    assert not [s for s in gemv_variants(2048, 6144, 32) if "mma" not in s.key()]


def test_expert_gemm_shape_rules() -> None:
    spec = expert_gemm_spec(2048, 2048, 17, tokens=20, slots=3, div=3, silu=True)
    # tokens round up to whole MMA tiles of 8; rows = tokens x slots sizes the gather
    assert spec.key() == "expertgemm-k2048-n2048-e17-m24-s3-t128-div3-silu1"
    assert expert_gemm_spec(1024, 2048, 17, tokens=64, slots=3, div=1, silu=False,
                            pdl=True).key().endswith("div1-silu0-pdl1")
    with pytest.raises(KernelsError, match=r"1\.\.64 tokens"):
        expert_gemm_spec(2048, 2048, 17, tokens=65, slots=3, div=3, silu=True)
    with pytest.raises(KernelsError, match="multiple of the threads"):
        expert_gemm_spec(2112, 2048, 17, tokens=8, slots=3, div=3, silu=True)
    with pytest.raises(KernelsError, match="multiple of 8"):
        expert_gemm_spec(2048, 2050, 17, tokens=8, slots=3, div=3, silu=True)
    with pytest.raises(KernelsError, match="multiple of 16"):
        expert_gemm_spec(1024, 2056, 17, tokens=8, slots=3, div=1, silu=False)
    with pytest.raises(KernelsError, match="div must be 1 or the slots"):
        expert_gemm_spec(2048, 2048, 17, tokens=8, slots=3, div=2, silu=True)
    # passes of fewer tiles: a key of their own, unless one pass holds every tile anyway
    assert expert_gemm_spec(2048, 2048, 17, tokens=64, slots=3, div=3, silu=True,
                            pass_tiles=2).get("pt") == 2
    assert "pt" not in expert_gemm_spec(2048, 2048, 17, tokens=8, slots=3, div=3, silu=True,
                                        pass_tiles=2).key()
    with pytest.raises(KernelsError, match="pass_tiles"):
        expert_gemm_spec(2048, 2048, 17, tokens=64, slots=3, div=3, silu=True, pass_tiles=5)


def test_fused_layer_variants_up_to_64_rows_are_compiled_ahead_of_time() -> None:
    keys = {s.key() for s in bench_specs()}
    cfg = LayerConfig()
    for b in (8, 64):
        for spec in cfg.specs(b):
            assert spec.key() in keys
    b64 = {s.kind for s in cfg.specs(64)}
    # batch 64 runs on this room's kernels alone: no SiLU kernel (cuBLAS path) needed
    assert {"gemv", "expert_gemm", "router", "add_rmsnorm", "decode_attn"} <= b64
    assert "silu_mul" not in b64
    assert "silu_mul" in {s.kind for s in cfg.specs(65)}


def test_layer_bytes_match_the_anchor() -> None:
    cfg = LayerConfig()
    assert cfg.slots == 3
    assert cfg.qkv_out == 3072 and cfg.group == 4
    assert abs(cfg.weight_bytes_touched(1) / 1e6 - 58.8) < 0.1
    assert cfg.kv_bytes_read(1, 32768) == 32768 * 4 * 128 * 2 * 2  # 64 MiB at 32k
    assert cfg.step_bytes(8, 4096) == cfg.weight_bytes_touched(8) + 8 * 4096 * 2048
    # at batch 64 all 16 routed experts are touched at least once
    assert cfg.weight_bytes_touched(64) == cfg.weight_bytes_touched(8) > \
        cfg.weight_bytes_touched(1)


# -- torch references (CPU) -----------------------------------------------------------------
def test_attention_shape_rules() -> None:
    spec = decode_attention_spec(128, 4, 16, 512, direct=False)
    assert spec.key() == "decodeattn-d128-g4-p16-c512-t128-u4-direct0"
    assert attention_combine_spec(128, 512).key() == "attncombine-d128-c512-t256"
    with pytest.raises(KernelsError, match="head dim"):
        decode_attention_spec(96, 4, 16, 512, direct=False)
    with pytest.raises(KernelsError, match="query heads per KV head"):
        decode_attention_spec(128, 16, 16, 512, direct=False)
    # 4 warps x 2 tokens (D 128: 16 lanes a token) x 4 steps = 32 tokens an iteration
    with pytest.raises(KernelsError, match="multiple of the 32 tokens"):
        decode_attention_spec(128, 4, 16, 48, direct=False)
    assert decode_attention_spec(64, 4, 16, 64, direct=True).get("c") == 64


def test_tensor_core_attention_shape_rules() -> None:
    spec = decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, stages=3)
    assert spec.key() == "decodeattn-d128-g4-p16-c512-t128-mma1-st3-direct0"
    # up to 16 heads per KV head (the MMA's rows: an MLA-like group of 16 fits)
    assert decode_attention_spec(128, 16, 16, 512, direct=False, mma=True).get("g") == 16
    with pytest.raises(KernelsError, match=r"1\.\.16 query heads"):
        decode_attention_spec(128, 17, 16, 512, direct=False, mma=True)
    with pytest.raises(KernelsError, match="head dim"):
        decode_attention_spec(96, 4, 16, 512, direct=False, mma=True)
    with pytest.raises(KernelsError, match="multiple of 16 tokens"):
        decode_attention_spec(128, 4, 8, 512, direct=False, mma=True)
    # 4 warps x 16 tokens a tile = 64 tokens an iteration
    with pytest.raises(KernelsError, match="multiple of the 64 tokens"):
        decode_attention_spec(128, 4, 16, 32, direct=False, mma=True)
    with pytest.raises(KernelsError, match="stages"):
        decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, stages=1)
    merged = decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, merge=True)
    assert merged.key() == "decodeattn-d128-g4-p16-c512-t128-mma1-st3-direct0-merge1"
    with pytest.raises(KernelsError, match="split over chunks"):
        decode_attention_spec(128, 4, 16, 512, direct=True, mma=True, merge=True)
    with pytest.raises(KernelsError, match="needs mma"):
        decode_attention_spec(128, 4, 16, 512, direct=False, merge=True)
    # one page id per tile, counted from the chunk's first page: whole pages a chunk
    with pytest.raises(KernelsError, match="whole pages"):
        decode_attention_spec(128, 4, 128, 64, direct=False, mma=True, threads=64)
    assert decode_attention_spec(128, 4, 128, 256, direct=False, mma=True).get("p") == 128
    # a 192-wide head splits too: the combine takes its rows
    assert attention_combine_spec(192, 512).get("d") == 192
    # every KV head of a chunk in one CTA: 8 warps over 4 heads = 2 tiles an iteration
    heads = decode_attention_spec(128, 4, 16, 32, direct=False, mma=True, threads=256,
                                  stages=2, kv_heads=4)
    assert heads.key() == "decodeattn-d128-g4-p16-c32-t256-mma1-st2-direct0-kh4"
    with pytest.raises(KernelsError, match="multiple of the 32 tokens"):
        decode_attention_spec(128, 4, 16, 16, direct=False, mma=True, threads=256,
                              kv_heads=4)
    with pytest.raises(KernelsError, match="must divide the CTA's 4 warps"):
        decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, kv_heads=3)
    with pytest.raises(KernelsError, match="needs mma"):
        decode_attention_spec(128, 4, 16, 512, direct=False, kv_heads=4)
    with pytest.raises(KernelsError, match="one KV head"):
        decode_attention_spec(576, 16, 16, 512, direct=False, mma=True, threads=64,
                              value_dim=512, latent=True, kv_heads=2)
    # keys copied in whole lines: tensor cores only
    lines = decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, lines=True)
    assert lines.key() == "decodeattn-d128-g4-p16-c512-t128-mma1-st3-direct0-kl1"
    with pytest.raises(KernelsError, match=r"lines .* needs mma"):
        decode_attention_spec(128, 4, 16, 512, direct=False, lines=True)
    # its chunk rule: 16 tokens an iteration per warp of each head
    assert mma_chunk_rules(128, 4, 16, 256, 2, 128, False, kv_heads=4)[0] == 32
    # the stamping diagnostic: GQA only, a key of its own (its outputs are not attention)
    tl = decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, timeline=True)
    assert tl.key().endswith("-tl1") and tl.key() != lines.key()
    dyn = decode_attention_spec(128, 4, 16, 128, direct=False, mma=True, threads=256,
                                stages=2, dynamic=True)
    assert dyn.key() == "decodeattn-d128-g4-p16-c128-t256-mma1-st2-direct0-dyn1"
    for bad in ({"stages": 3}, {"stages": 2, "direct": True}, {"stages": 2, "fresh": True},
                {"stages": 2, "merge": True}):
        with pytest.raises(KernelsError, match="dynamic splits GQA"):
            decode_attention_spec(128, 4, 16, 128, **{"direct": False, **bad}, mma=True,
                                  threads=256, dynamic=True)
    assert attention_combine_spec(128, 128, every=True).key().endswith("-all1")
    # CTAs a (sequence, KV head) to fill 132 SMs: 33 at batch 1 over 4 KV heads (one
    # CTA an SM), 66 at two an SM, and never fewer than one however large the batch
    assert dynamic_fill_ctas(1, 4, sms=132, ctas_per_sm=1) == 33
    assert dynamic_fill_ctas(1, 4, sms=132, ctas_per_sm=2) == 66
    assert dynamic_fill_ctas(64, 4, sms=132, ctas_per_sm=2) == 1
    assert dynamic_fill_ctas(128, 4, sms=132, ctas_per_sm=2) == 1
    with pytest.raises(KernelsError, match="timeline stamps GQA"):
        decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, merge=True,
                              timeline=True)


def test_mla_attention_shape_rules() -> None:
    spec = decode_attention_spec(576, 16, 16, 512, direct=False, mma=True, threads=64,
                                 value_dim=512, latent=True)
    assert spec.key() == "decodeattn-d576-g16-p16-c512-t64-mma1-st3-direct0-dv512-latent1"
    assert spec.key() in {s.key() for s in bench_specs()}
    with pytest.raises(KernelsError, match="latent prefix"):
        decode_attention_spec(576, 16, 16, 512, direct=False, value_dim=600, latent=True)
    with pytest.raises(KernelsError, match="own key"):
        decode_attention_spec(576, 16, 16, 512, direct=False, value_dim=512, latent=True,
                              fresh=True)
    with pytest.raises(KernelsError, match="GQA only"):
        decode_attention_spec(576, 16, 16, 512, direct=False, value_dim=512, latent=True,
                              merge=True)
    with pytest.raises(KernelsError, match="needs latent"):
        decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, value_dim=64)
    assert attention_combine_spec(512, 512).key() == "attncombine-d512-c512-t256"
    # one CTA of 4 warps per chunk sharing each tile: its threads follow from the value
    shared = decode_attention_spec(576, 16, 16, 512, direct=False, mma=True, stages=4,
                                   value_dim=512, latent=True, shared=True)
    assert shared.key() == ("decodeattn-d576-g16-p16-c512-t128-mma1-st4-direct0-dv512-"
                            "latent1-shared1")
    assert shared.key() in {s.key() for s in bench_specs()}
    with pytest.raises(KernelsError, match="MLA only"):
        decode_attention_spec(128, 4, 16, 512, direct=False, mma=True, shared=True)
    # 4 warps x 3 stages of 22.5 KiB each: over the 227 KiB a CTA has
    with pytest.raises(KernelsError, match="shared memory"):
        decode_attention_spec(576, 16, 16, 512, direct=False, mma=True, threads=128,
                              stages=3, value_dim=512, latent=True)


def test_attention_chunk_fills_the_gpu_without_tiny_chunks() -> None:
    # batch 1, 4 KV heads, 32k: 64 chunks of 512 x 4 heads = 256 CTAs (2 per SM of 132)
    assert attention_chunk(1, 4, 32768) == 512
    assert attention_chunk(1, 4, 1000) == 64  # short: as many CTAs as the context allows
    assert attention_chunk(64, 4, 4096) == 4096  # the batch fills the GPU: one chunk each
    # the sequences alone fill the GPU: one chunk per context, no combine kernel
    assert attention_chunk(64, 4, 32768) == 32768
    assert attention_chunk(8, 4, 32768) == 4096
    assert attention_chunk(8, 4, 4096) == 512
    # many short sequences: one chunk each, as long as the context, not the longest chunk
    assert attention_chunk(64, 8, 100) == 128


def test_every_attention_variant_is_compiled_ahead_of_time() -> None:
    keys = {s.key() for s in bench_specs()}
    for c in (64, 512, 4096):
        assert decode_attention_spec(128, 4, 16, c, direct=True).key() in keys
        assert decode_attention_spec(128, 4, 16, c, direct=False).key() in keys
        assert attention_combine_spec(128, c).key() in keys
        for threads, stages in ATTN_MMA_TILES:  # the tensor-core tiles the bench tries
            if c % (16 * (threads // 32)) == 0:  # a chunk of whole iterations
                for merge in (False, True):
                    assert decode_attention_spec(128, 4, 16, c, direct=False, mma=True,
                                                 threads=threads, stages=stages,
                                                 merge=merge).key() in keys
        for threads, stages in ATTN_HEADS_TILES:  # a CTA reading every KV head
            for merge in (False, True):
                assert decode_attention_spec(128, 4, 16, c, direct=False, mma=True,
                                             threads=threads, stages=stages, merge=merge,
                                             kv_heads=ATTN_ALL_HEADS).key() in keys
    # the fused layer's attention on tensor cores, at every batch and context it runs
    cfg = LayerConfig()
    for b in (1, 8, 64):
        for s in cfg.attention_specs(b, 32768, pdl=True):
            assert s.key() in keys


torch = pytest.importorskip("torch")


def test_paged_attention_reference_matches_explicit_softmax() -> None:
    from agentload.kernels import reference as ref

    g = torch.Generator().manual_seed(1)
    page, hkv, hq, d = 4, 2, 4, 8
    k_cache = torch.randn(6, page, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(6, page, hkv, d, generator=g).bfloat16()
    table = torch.tensor([[5, 0, 3], [2, 4, 1]], dtype=torch.int32)
    lens = torch.tensor([10, 3], dtype=torch.int32)
    q = torch.randn(2, hq, d, generator=g).bfloat16()
    got = ref.paged_decode_attention(q, k_cache, v_cache, table, lens)
    for b in range(2):
        n = int(lens[b])
        toks = [(int(table[b, t // page]), t % page) for t in range(n)]
        for h in range(hq):
            kv = h // (hq // hkv)  # GQA: query head h reads KV head h // group
            keys = torch.stack([k_cache[p, s, kv] for p, s in toks]).double()
            vals = torch.stack([v_cache[p, s, kv] for p, s in toks]).double()
            w = torch.softmax(keys @ q[b, h].double() / d ** 0.5, 0)
            assert torch.allclose(got[b, h], w @ vals)




def test_references_match_plain_math() -> None:
    from agentload.kernels import reference as ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 64, generator=g).bfloat16()
    r = torch.randn(3, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    out, h = ref.add_rmsnorm(x, r, w, 1e-6)
    hh = r.double() + x.double().sum(1)
    want = hh / torch.sqrt((hh ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(out, want) and torch.allclose(h, hh)
    a = torch.randn(4, 16, generator=g)
    assert torch.allclose(ref.silu_mul(a), (a[:, :8] * torch.sigmoid(a[:, :8]) * a[:, 8:])
                          .double())
    assert ref.rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")


def test_router_select_grouped_topk() -> None:
    from agentload.kernels import reference as ref

    # 8 experts in 4 groups of 2; keep 2 groups; top-2.
    logits = torch.tensor([[5.0, 4.0, -9, -9, 3.0, 2.9, 6.0, -9]])
    bias = torch.zeros(8)
    ids, w = ref.router_select(logits, bias, 2, 4, 2, 1.0)
    # group sums: g0 = s(5)+s(4), g2 = s(3)+s(2.9), g3 = s(6)+s(-9); g0 and g2 win,
    # so expert 6 (best single score) is excluded with its group.
    assert sorted(ids[0].tolist()) == [0, 1]
    assert torch.allclose(w.sum(-1), torch.tensor([1.0], dtype=torch.float64))


def test_standard_layer_matches_float_reference_on_cpu() -> None:
    from agentload.kernels import reference as ref
    from agentload.kernels.layer import KVState, MoELayer

    cfg = LayerConfig(hidden=256, heads=4, kv_heads=2, head_dim=64, page=4, experts=8,
                      topk=2, groups=4, topk_group=2, inter=128)
    layer = MoELayer(cfg, "cpu", seed=3)
    for batch in (1, 5):  # gather path (few rows) and dense-masked path
        x, r = layer.inputs(batch)
        got = MoELayer.result(layer.standard(x, r))
        assert ref.rel_err(got, layer.reference(x, r)) < ref.BF16_TOL
        kv = KVState.random(cfg, batch, 37, "cpu", seed=batch)
        before = kv.k_cache.clone()
        got = MoELayer.result(layer.standard(x, r, kv))
        assert ref.rel_err(got, layer.reference(x, r, kv=kv)) < ref.BF16_TOL
        # the step appended exactly one key per sequence, at its last slot
        changed = (kv.k_cache != before).any(-1).any(-1).view(-1)
        assert sorted(changed.nonzero().view(-1).tolist()) == sorted(kv.slots.tolist())
        # the context matters: a cache of other keys gives another answer
        other = KVState.random(cfg, batch, 37, "cpu", seed=batch + 50)
        assert ref.rel_err(MoELayer.result(layer.standard(x, r, other)), got) > 0.01


def test_ops_reject_bad_inputs_before_any_gpu_work() -> None:
    ops = importlib.import_module("agentload.kernels.ops")
    x = torch.zeros(2, 64, dtype=torch.float32)
    with pytest.raises(KernelsError, match=r"torch\.bfloat16"):
        ops.silu_mul(x)
    with pytest.raises(KernelsError, match="CUDA device"):
        ops.silu_mul(x.bfloat16())
    with pytest.raises(KernelsError, match="shape"):
        ops.gemv(torch.zeros(2, 64, 3, dtype=torch.bfloat16),
                 torch.zeros(8, 32, dtype=torch.bfloat16))
    with pytest.raises(KernelsError, match=r"must be a torch\.Tensor"):
        ops.silu_mul([1, 2])  # type: ignore[arg-type]


def test_routing_tie_margins_count_only_experts_of_the_chosen_groups() -> None:
    from agentload.kernels.layer import selection_margins

    cfg = LayerConfig()  # 16 experts in 4 groups of 4, top-2 of the best 2 groups
    sel = torch.full((1, 16), 0.1, dtype=torch.float64)
    sel[0, 0:2] = torch.tensor([0.9, 0.5])    # group 0: 1.4
    sel[0, 4:6] = torch.tensor([0.8, 0.79])   # group 1: 1.59
    sel[0, 8:10] = torch.tensor([0.85, 0.2])  # group 2: 1.05, left out
    g_margin, e_margin = selection_margins(cfg, sel)
    assert abs(float(g_margin[0]) - (1.4 - 1.05)) < 1e-6
    # 0.8 vs 0.79 decide the second expert: a near-tie, although the best score left out
    # globally (0.85, of a group not chosen) is 0.05 from 0.8
    assert abs(float(e_margin[0]) - 0.01) < 1e-6


def test_dsl_helpers_with_branches_are_traced_by_the_dsl() -> None:
    # A module-level helper that branches on a runtime value must be @cute.jit (or a
    # dsl_user_op): undecorated, the DSL refuses it at compile time, which only a GPU
    # build would show (a refactor once slid a new function under _block_sum's decorator).
    import ast
    from pathlib import Path

    import agentload.kernels as pkg

    room = Path(pkg.__file__).parent
    bare = []
    for path in sorted(room.glob("_cute*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            names = {ast.unparse(d) for d in node.decorator_list}
            # a branch on a Python value (``x is None``) is resolved before tracing
            branches = any(isinstance(n, ast.If) and not (
                isinstance(n.test, ast.Compare)
                and all(isinstance(op, (ast.Is, ast.IsNot)) for op in n.test.ops))
                for n in ast.walk(node))
            if branches and not names & {"cute.jit", "dsl_user_op"}:
                bare.append(f"{path.name}:{node.name}")
    assert bare == []


def test_timeline_stamps_unwrap_across_the_timer_wrap() -> None:
    torch = pytest.importorskip("torch")
    from agentload.kernels.tools.attn_probe import WRAP, timeline_report, unwrap

    # 3 CTAs: entry, prologue done, first tile, last tile, end (ns), straddling 2^24
    rel = torch.tensor([[0, 800, 2000, 20000, 21000], [100, 1100, 2600, 20500, 21500],
                        [50, 900, 3000, 19000, 22000]])
    raw = torch.remainder(rel + WRAP - 500, WRAP)
    assert torch.equal(unwrap(raw), rel)
    report = timeline_report(rel, 66_000_000)  # 66 MB in 22 µs: 3000 GB/s
    assert "span 22.0 µs" in report and "3000 GB/s" in report
    assert "streaming from 3.0 to 19.0 µs (73% of the span)" in report
    assert "first tile: median   1.50 µs" in report


def test_the_probes_paged_kv_covers_every_page_once() -> None:
    torch = pytest.importorskip("torch")
    from agentload.kernels.tools.attn_probe import paged_kv

    kc, vc, table, lens = paged_kv(2, 64, 4, 3, device="cpu")  # 2 x 64 tokens: 8 pages
    assert len(kc) == len(vc) == 3 and kc[0].shape == (8, 16, 4, 128)
    assert kc[0].dtype == torch.bfloat16 and table.dtype == torch.int32
    assert table.shape == (2, 4) and sorted(table.view(-1).tolist()) == list(range(8))
    assert lens.tolist() == [64, 64]
    _, _, in_order, _ = paged_kv(1, 64, 4, 1, shuffled=False, device="cpu")
    assert in_order.tolist() == [[0, 1, 2, 3]]


def test_every_layer_knob_the_bench_tries_is_a_layer_option() -> None:
    pytest.importorskip("torch")
    from agentload.kernels.bench import layer_knobs
    from agentload.kernels.layer import MoELayer

    cfg = LayerConfig(hidden=256, heads=4, kv_heads=2, head_dim=64, page=4, experts=8,
                      topk=2, groups=4, topk_group=2, inter=128)
    layer = MoELayer(cfg, "cpu", seed=3)
    for knob in MoELayer.KNOBS:  # each a plain attribute the bench may set and read back
        assert hasattr(layer, knob), knob
    for batch, context in ((1, 4096), (8, 32768), (64, 4096), (64, 32768)):
        tried = layer_knobs(batch, context)
        assert tried and all(set(k) <= set(MoELayer.KNOBS) for k in tried)
    # above the GEMV's rows: the finer splits (shorter than the context only) and the
    # wider GEMV and expert tiles
    keys = {k for knobs in layer_knobs(64, 4096) for k in knobs}
    assert {"attention_chunk", "gemv_threads", "expert_threads"} <= keys
    assert all(k.get("attention_chunk", 0) < 4096 for k in layer_knobs(64, 4096))
