"""Fitting traces to a target (scale, cap) and the server-block prefix-cache model."""

from __future__ import annotations

import pytest

from agentload.replay.engine.cache_model import PrefixCacheModel
from agentload.replay.engine.fit import FitOptions, check_fits, fit_trace
from agentload.replay.errors import ReplayError
from agentload.traces import Block, Request, Session, Trace
from agentload.traces.formats import import_trace
from agentload.traces.model import theoretical_prefix_hits
from tests.support import ROOT

WEKA = ROOT / "tests" / "data" / "weka"


def test_scaling_keeps_every_reuse_and_caps_context() -> None:
    trace = import_trace("weka", WEKA).trace
    fitted, report = fit_trace(trace, FitOptions(scale_tokens=0.12, max_context=16384,
                                                 pause_cap_s=5.0))
    assert fitted.num_requests == trace.num_requests
    for a, b in zip(trace.requests(), fitted.requests(), strict=True):
        assert [x.id for x in a.blocks] == [y.id for y in b.blocks]  # same content ids
        assert b.input_tokens + b.output_tokens <= 16384
        assert b.pause_s == min(a.pause_s, 5.0) and b.depends_on == a.depends_on
        assert b.output_tokens == max(1, round(a.output_tokens * 0.12))
    lengths: dict[int, int] = {}
    for req in fitted.requests():
        for blk in req.blocks:
            assert lengths.setdefault(blk.id, blk.tokens) == blk.tokens
    assert report.requests_truncated == 0 and report.pauses_capped > 0
    assert report.input_tokens_after == pytest.approx(0.12 * report.input_tokens_before,
                                                      rel=0.05)
    # Reuse is block-for-block the same, so the trace-level hit rate hardly moves.
    before = sum(theoretical_prefix_hits(list(trace.requests())))
    after = sum(theoretical_prefix_hits(list(fitted.requests())))
    assert after / report.input_tokens_after == pytest.approx(
        before / report.input_tokens_before, abs=0.01)


def test_max_context_cuts_the_tail_and_reuses_cut_ids() -> None:
    long = tuple(Block(i, 64) for i in range(1, 11))  # 640 tokens
    reqs = (Request("a", "s", long, 10), Request("b", "s", long, 10, ("a",)))
    trace = Trace("t", (Session("s", reqs),))
    fitted, report = fit_trace(trace, FitOptions(max_context=300))
    a, b = fitted.sessions[0].requests
    assert a.input_tokens == 290 and a.blocks[:4] == long[:4]
    assert a.blocks[4].tokens == 34 and a.blocks[4].id > 10  # a new id for cut content
    assert a.blocks == b.blocks and report.requests_truncated == 2
    with pytest.raises(ReplayError, match="--scale-tokens"):
        check_fits(trace, 512)
    check_fits(fitted, 300)
    for bad in (FitOptions(scale_tokens=0), FitOptions(max_context=1),
                FitOptions(pause_cap_s=-1)):
        with pytest.raises(ReplayError):
            fit_trace(trace, bad)


def test_cache_model_counts_server_blocks_whatever_the_trace_block_size() -> None:
    model = PrefixCacheModel(64)
    small = [Block(i, 8) for i in range(20)]  # 160 tokens in 8-token trace blocks
    assert model.send_hits(small) == 0
    assert model.send_hits([*small, Block(99, 8)]) == 128  # two full server blocks match
    assert model.send_hits(small[:9]) == 64  # 72 tokens: one full block, and it matches
    assert model.send_hits(small[:8]) == 0  # exactly one block: vLLM recomputes the last one
    big = PrefixCacheModel(16)
    assert big.send_hits([Block(1, 512)]) == 0
    assert big.send_hits([Block(1, 512), Block(2, 100)]) == 512
    assert big.send_hits([Block(1, 512)]) == 496  # fully cached: the last block is recomputed
    other = PrefixCacheModel(64)
    other.send_hits([Block(1, 64), Block(2, 64)])
    assert other.send_hits([Block(3, 64), Block(2, 64), Block(4, 64)]) == 0  # prefix, not set
