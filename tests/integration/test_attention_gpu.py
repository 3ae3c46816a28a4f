"""Decode attention over a paged KV cache on a GPU, against the float64 SDPA reference.

Pages are handed out in a shuffled order (so a kernel that ignored the block table would
read the wrong keys), contexts differ per sequence (so the per-sequence lengths and the
chunk tails are exercised), and the output is poisoned with NaN. Skipped without a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from agentload.kernels import KernelsError, ops  # noqa: E402
from agentload.kernels import reference as ref  # noqa: E402

BF = torch.bfloat16


def paged_case(lens: list[int], hq: int, hkv: int, d: int = 128, page: int = 16,
               seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random q, caches with shuffled pages, the block table and the lengths."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = len(lens)
    per_seq = [-(-n // page) for n in lens]
    max_pages = max(per_seq)
    total = sum(per_seq) + 3  # a few pages nobody owns
    order = torch.randperm(total, generator=g).to(torch.int32)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = order[used:used + n]
        used += n
    q = torch.randn(b, hq, d, generator=g).to(BF)
    k = torch.randn(total, page, hkv, d, generator=g).to(BF)
    v = torch.randn(total, page, hkv, d, generator=g).to(BF)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.cuda() for t in (q, k, v, table, lens_t))


@pytest.mark.parametrize(("lens", "hq", "hkv"), [
    ([1], 16, 4),                        # one key: the output is v
    ([37], 16, 4),                       # one chunk, a ragged tail: direct, no combine
    ([4096], 16, 4),                     # batch 1, split over the context
    ([32768], 16, 4),                    # batch 1, 32k
    ([1000, 17, 4096, 2500, 1, 333, 2049, 64], 32, 8),  # batch 8, ragged
    ([4096] * 64, 16, 4),                # batch 64
    ([3000, 5], 8, 8),                   # MHA (group 1)
])
def test_decode_attention_matches_sdpa(lens: list[int], hq: int, hkv: int) -> None:
    q, k, v, table, seq = paged_case(lens, hq, hkv)
    out = torch.full_like(q, float("nan"))
    ops.decode_attention(q, k, v, table, seq, max_len=max(lens), out=out)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    assert ref.rel_err(out, want) < ref.BF16_TOL
    if lens == [1]:
        assert ref.rel_err(out, v[table[0, 0].long(), 0].repeat_interleave(4, 0)[None]) < 1e-2


@pytest.mark.parametrize("chunk", [64, 256, 2048])
def test_every_chunk_length_gives_the_same_answer(chunk: int) -> None:
    q, k, v, table, seq = paged_case([5000, 1234], 16, 4, seed=3)
    out = ops.decode_attention(q, k, v, table, seq, max_len=5000, chunk=chunk)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    assert ref.rel_err(out, want) < ref.BF16_TOL


@pytest.mark.parametrize(("chunk", "unroll"), [(64, 4), (512, 8), (4096, 4)])
def test_pipelined_loads_give_the_same_answer(chunk: int, unroll: int) -> None:
    # pipe: each iteration's keys and values are loaded during the previous one's math;
    # ragged lengths end mid-iteration, one sequence is a single token
    q, k, v, table, seq = paged_case([5000, 1234, 1, 700], 16, 4, seed=11)
    out = torch.full_like(q, float("nan"))
    ops.decode_attention(q, k, v, table, seq, max_len=5000, chunk=chunk, unroll=unroll,
                         pipe=True, out=out)
    assert ref.rel_err(out, ref.paged_decode_attention(q, k, v, table, seq)) < ref.BF16_TOL


@pytest.mark.parametrize(("lens", "hq", "hkv"), [
    ([1], 16, 4),
    ([37], 16, 4),
    ([32768], 16, 4),
    ([1000, 17, 4096, 2500, 1, 333, 2049, 64], 32, 8),
    ([4096] * 64, 16, 4),
    ([3000, 5], 8, 8),                   # MHA: one real row of the MMA's 16
    ([2000, 31], 32, 4),                 # group 8
])
def test_tensor_core_attention_matches_sdpa(lens: list[int], hq: int, hkv: int) -> None:
    q, k, v, table, seq = paged_case(lens, hq, hkv, seed=len(lens))
    out = torch.full_like(q, float("nan"))
    ops.decode_attention(q, k, v, table, seq, max_len=max(lens), out=out, mma=True)
    assert ref.rel_err(out, ref.paged_decode_attention(q, k, v, table, seq)) < ref.BF16_TOL


@pytest.mark.parametrize("lines", [False, True])
@pytest.mark.parametrize(("lens", "threads", "ctas"), [
    ([32768], 256, 0),              # batch 1: 33 CTAs a KV head share 2048 tiles
    ([32768], 256, 66),             # two waves: the second's CTAs find fewer tiles left
    ([5000, 1234, 1, 700], 128, 0),  # ragged: the last tiles end mid-page; one token
    ([40], 256, 0),                 # 3 tiles: most CTAs take none (empty partials)
    ([4096] * 64, 128, 0),          # batch 64: one CTA a (sequence, KV head)
    ([4096] * 64, 128, 2),          # two: every head's first CTA launched first
])
def test_the_dynamic_split_gives_the_same_answer(lens: list[int], threads: int, ctas: int,
                                                 lines: bool) -> None:
    # three calls in a row: the combine must re-arm the counters each time
    q, k, v, table, seq = paged_case(lens, 16, 4, seed=21)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    for _ in range(3):
        out = torch.full_like(q, float("nan"))
        ops.decode_attention(q, k, v, table, seq, max_len=max(lens), out=out, mma=True,
                             threads=threads, stages=2, lines=lines, dynamic=True,
                             dynamic_ctas=ctas)
        assert ref.rel_err(out, want) < ref.BF16_TOL


@pytest.mark.parametrize("fixed", [2, 3])
@pytest.mark.parametrize(("lens", "threads", "ctas"), [
    ([32768], 256, 0),              # batch 1: each warp's first 3/4 of ~8 tiles its own
    ([32768], 256, 66),             # two waves: the second's own tiles come late
    ([5000, 1234, 1, 700], 128, 0),  # ragged: own tiles past a short sequence's end
    ([40], 256, 0),                 # fewer tiles than a round: the ramp's two only
])
def test_the_dynamic_split_with_own_tiles_first_gives_the_same_answer(
        lens: list[int], threads: int, ctas: int, fixed: int) -> None:
    q, k, v, table, seq = paged_case(lens, 16, 4, seed=23)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    for _ in range(3):  # the counters re-armed each time
        out = torch.full_like(q, float("nan"))
        ops.decode_attention(q, k, v, table, seq, max_len=max(lens), out=out, mma=True,
                             threads=threads, stages=2, lines=True, dynamic=True,
                             dynamic_ctas=ctas, dynamic_fixed=fixed)
        assert ref.rel_err(out, want) < ref.BF16_TOL


def test_the_dynamic_split_replays_in_a_cuda_graph_with_pdl() -> None:
    q, k, v, table, seq = paged_case([8192, 100], 16, 4, seed=6)
    out = torch.empty_like(q)

    def step() -> None:
        ops.decode_attention(q, k, v, table, seq, max_len=8192, out=out, mma=True,
                             threads=256, stages=2, lines=True, dynamic=True, pdl=True)

    step()  # loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert ref.rel_err(out, ref.paged_decode_attention(q, k, v, table, seq)) < ref.BF16_TOL
    with pytest.raises(KernelsError, match="dynamic takes mma"):
        ops.decode_attention(q, k, v, table, seq, max_len=8192, dynamic=True)


@pytest.mark.parametrize("lines", [False, True])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize(("chunk", "threads", "stages"),
                         [(64, 128, 3), (512, 128, 2), (256, 64, 4), (2048, 256, 2),
                          (1024, 256, 3), (512, 128, 6)])
def test_tensor_core_tiles_give_the_same_answer(chunk: int, threads: int, stages: int,
                                                merge: bool, lines: bool) -> None:
    # ragged lengths end mid-tile and mid-page; one sequence is a single token; a chunk
    # of more tiles than a warp has stages wraps the ring of shared-memory slots; with
    # merge the last CTA of each (sequence, KV head) merges the chunks, twice in a row
    # (the counters must be re-armed); with lines the keys travel in whole lines and are
    # read back by other lanes
    q, k, v, table, seq = paged_case([5000, 1234, 1, 700], 16, 4, seed=13)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    for _ in range(2 if merge else 1):
        out = torch.full_like(q, float("nan"))
        ops.decode_attention(q, k, v, table, seq, max_len=5000, chunk=chunk, threads=threads,
                             stages=stages, mma=True, merge=merge, out=out, lines=lines)
        assert ref.rel_err(out, want) < ref.BF16_TOL


@pytest.mark.parametrize("lines", [False, True])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize(("chunk", "threads", "stages"),
                         [(64, 128, 3), (256, 256, 2), (1024, 256, 3), (512, 128, 6)])
def test_a_cta_reading_every_kv_head_gives_the_same_answer(chunk: int, threads: int,
                                                           stages: int, merge: bool,
                                                           lines: bool) -> None:
    # kv_heads_per_cta: warp w takes KV head w % 4 of the CTA's chunk; the chunks meet
    # per head in shared memory, and (merge) the last CTA merges all 16 query heads
    q, k, v, table, seq = paged_case([5000, 1234, 1, 700], 16, 4, seed=17)
    want = ref.paged_decode_attention(q, k, v, table, seq)
    for _ in range(2 if merge else 1):
        out = torch.full_like(q, float("nan"))
        ops.decode_attention(q, k, v, table, seq, max_len=5000, chunk=chunk, threads=threads,
                             stages=stages, mma=True, merge=merge, out=out,
                             kv_heads_per_cta=4, lines=lines)
        assert ref.rel_err(out, want) < ref.BF16_TOL


@pytest.mark.parametrize(("mma", "kv_heads"), [(False, 1), (True, 1), (True, 4)])
@pytest.mark.parametrize("lens", [[4096, 1, 777], [40]])
def test_the_steps_own_key_and_value_come_from_the_projection(lens: list[int], mma: bool,
                                                               kv_heads: int) -> None:
    # q, k_new, v_new are column slices of one projection output, as in the layer.
    _, k, v, table, seq = paged_case(lens, 16, 4, seed=7)
    b = len(lens)
    qkv = torch.randn(b, (16 + 2 * 4) * 128, device="cuda").to(BF)
    qv = qkv[:, :2048].view(b, 16, 128)
    kn = qkv[:, 2048:2560].view(b, 4, 128)
    vn = qkv[:, 2560:].view(b, 4, 128)
    k_before, v_before = k.clone(), v.clone()
    out = ops.decode_attention(qv, k, v, table, seq, max_len=max(lens), k_new=kn, v_new=vn,
                               mma=mma, kv_heads_per_cta=kv_heads,
                               **({"threads": 128, "stages": 3} if kv_heads > 1 else {}))
    for i, n in enumerate(lens):  # what the kernel must have appended
        page, slot = int(table[i, (n - 1) // 16]), (n - 1) % 16
        k_before[page, slot], v_before[page, slot] = kn[i], vn[i]
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # nothing else written
    want = ref.paged_decode_attention(qv, k_before, v_before, table, seq)
    assert ref.rel_err(out, want) < ref.BF16_TOL


@pytest.mark.parametrize(("mma", "merge"), [(False, False), (True, False), (True, True)])
def test_decode_attention_replays_in_a_cuda_graph(mma: bool, merge: bool) -> None:
    q, k, v, table, seq = paged_case([8192, 100], 16, 4, seed=5)
    out = torch.empty_like(q)
    # loaded outside the capture
    ops.decode_attention(q, k, v, table, seq, max_len=8192, out=out, mma=mma, merge=merge)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.decode_attention(q, k, v, table, seq, max_len=8192, out=out, mma=mma,
                             merge=merge)
    for _ in range(3):  # merge: each replay finds its counters re-armed
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(BF))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert ref.rel_err(out, ref.paged_decode_attention(q, k, v, table, seq)) < ref.BF16_TOL


def test_decode_attention_rejects_bad_inputs() -> None:
    q, k, v, table, seq = paged_case([100], 16, 4)
    with pytest.raises(KernelsError, match="max_len"):
        ops.decode_attention(q, k, v, table, seq, max_len=10_000)
    with pytest.raises(KernelsError, match="query heads"):
        ops.decode_attention(q[:, :15].contiguous(), k, v, table, seq, max_len=100)
    with pytest.raises(KernelsError, match="block_table"):
        ops.decode_attention(q, k, v, table.long(), seq, max_len=100)
    with pytest.raises(KernelsError, match="go together"):
        ops.decode_attention(q, k, v, table, seq, max_len=100, k_new=q[:, :4])
    with pytest.raises(KernelsError, match="multiple of 16 tokens"):
        ops.decode_attention(q, k.view(-1, 8, 4, 128), v.view(-1, 8, 4, 128), table, seq,
                             max_len=50, mma=True)
    with pytest.raises(KernelsError, match="contiguous heads"):
        ops.decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, table,
                             seq, max_len=100)


def mla_case(lens: list[int], heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Absorbed MLA: q [B, H, 576], one latent cache [pages, 16, 1, 576] (shuffled pages)."""
    q, k, _, table, seq = paged_case(lens, heads, 1, d=576, seed=seed)
    return q, k, table, seq


@pytest.mark.parametrize(("lens", "heads"), [
    ([1], 16),                           # one token: the output is its latent
    ([37], 16),                          # one chunk, ragged: direct
    ([32768], 16),                       # batch 1, 32k, split with the 512-wide combine
    ([1000, 17, 4096, 2500, 1, 333, 2049, 64], 16),  # batch 8, ragged
    ([3000, 5], 8),                      # 8 heads: the MMA's rows 8-15 unused
])
@pytest.mark.parametrize("shared", [False, True])
def test_mla_attention_matches_the_reference(lens: list[int], heads: int,
                                             shared: bool) -> None:
    q, kv, table, seq = mla_case(lens, heads, seed=len(lens))
    scale = (128 + 64) ** -0.5
    out = torch.full((len(lens), heads, 512), float("nan"), device="cuda").to(BF)
    ops.decode_attention_mla(q, kv, table, seq, max_len=max(lens), scale=scale, out=out,
                             shared=shared)
    want = ref.paged_decode_attention(q, kv, kv[..., :512], table, seq, scale=scale)
    assert ref.rel_err(out, want) < ref.BF16_TOL
    if lens == [1]:
        assert ref.rel_err(out[0], kv[table[0, 0].long(), 0, 0, :512].expand(heads, 512)) < 1e-2


@pytest.mark.parametrize(("chunk", "threads", "stages", "shared"),
                         [(64, 64, 3, False), (512, 32, 4, False), (64, 128, 2, True),
                          (1024, 128, 4, True)])
def test_mla_tiles_give_the_same_answer(chunk: int, threads: int, stages: int,
                                        shared: bool) -> None:
    # shared: one CTA per chunk copies each tile once for its 4 warps (two barriers a tile)
    q, kv, table, seq = mla_case([5000, 1234, 1, 700], 16, seed=17)
    scale = (128 + 64) ** -0.5
    out = ops.decode_attention_mla(q, kv, table, seq, max_len=5000, scale=scale, chunk=chunk,
                                   threads=threads, stages=stages, shared=shared)
    want = ref.paged_decode_attention(q, kv, kv[..., :512], table, seq, scale=scale)
    assert ref.rel_err(out, want) < ref.BF16_TOL
