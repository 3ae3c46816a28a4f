"""vLLM's range names (``profiler/vllm.py``): the parser's own tests."""

from __future__ import annotations

import polars as pl


def test_range_names_parsed_once_each_match_parsing_every_row() -> None:
    """Each distinct name is parsed once and gathered back by its categorical code: the
    same columns, row for row, as parsing every row, with null names, repeats in any
    order, and named domains prefixing the label."""
    from agentload.profiler.vllm import _parse, parse_range_names

    def mod(path: str, out: bool = False) -> str:
        return str({"Module": path, "Outputs" if out else "Inputs": [[8, 4096]]})

    names = [mod("model.layers.3.mlp"), None, "layer7.fused", mod("model.layers.3.mlp", True),
             "Torch Compiled Module (input):Qwen", None, "decode_step", "layer7.fused"]
    frame = pl.DataFrame({"name": names * 3,
                          "domain": (["dom", None, None, None, None, None, "d2", None]) * 3},
                         schema={"name": pl.String, "domain": pl.String})
    got = parse_range_names(frame)
    want = _parse(frame).with_columns(
        label=pl.when(pl.col("domain").is_not_null())
        .then(pl.col("domain") + ":" + pl.col("label")).otherwise(pl.col("label")))
    assert got.select(want.columns).equals(want)
    assert got["label"][0] == "dom:model.layers.3.mlp" and got["layer"][2] == 7
    assert got["is_output"].to_list()[:4] == [False, False, False, True]
