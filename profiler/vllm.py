"""Structured range names: vLLM's layerwise NVTX text, module paths and layer indices.

vLLM's ``--enable-layerwise-nvtx-tracing`` (``vllm/utils/nvtx_pytorch_hooks.py``) pushes,
for every module, a range whose text is a Python dict repr such as
``{'Module': 'model.layers.3.self_attn', 'Inputs': [[8, 4096]], ...}``, and after the
forward a second, empty range with the same ``'Module'`` and an ``'Outputs'`` key.
Compiled regions appear as ``Torch Compiled Module (input):<Class>`` / ``(output)``.
The module path is taken with a regex rather than ``ast.literal_eval`` (these strings
are unique per shape, so there can be millions, and the regex runs vectorized in
polars); output markers are flagged so they never count as instances.
"""

from __future__ import annotations

import numpy as np
import polars as pl

MODULE_RE = r"'Module':\s*'([^']+)'"
LAYER_RE = r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)"
"""The layer index in a module path: ``model.layers.3.mlp`` (vLLM, HF), ``blocks.3``,
``transformer.h.3`` (GPT-2)."""
GLUED_LAYER_RE = r"(?:^|\.)layers?_?(\d+)(?:\.|$)"
"""The layer index glued to its name, as hand-written ranges put it: ``layer3``,
``layer_3``, ``layer3.standard``."""
LAYER_RANGE_RE = (r"(?:(?:^|\.)(?:layers|blocks|h)\.\d+"
                  r"|(?:^|\.)layers?_?\d+(?:\.[A-Za-z_]\w*)?)$")
"""A label that *is* a decoder layer, not one of its submodules: a module path ending
at ``layers.<i>`` (or ``blocks.<i>``, ``h.<i>``), or a glued ``layer<i>`` with at most
one name after it (``layer3.standard``: a layer and the path it took)."""
COMPILED_RE = r"^Torch Compiled Module \((input|output)\):?(.*)$"
TORCH_MODULE_RE = r"^nn\.Module: ([A-Za-z_]\w*?)_(\d+)$"
"""The PyTorch profiler's module ranges (``with_stack=True``): ``nn.Module: <Class>_<k>``,
``k`` counting that class's instances in the order they first ran."""
DECODER_CLASS_RE = r"(?:DecoderLayer|Block)$"
"""A module class that is one decoder layer (``LlamaDecoderLayer``,
``DeepseekV2DecoderLayer``, ``GPT2Block``): its instance count is the layer index."""


def parse_range_names(ranges: pl.DataFrame) -> pl.DataFrame:
    """The name columns of :func:`_parse`, computed once per distinct name (traces
    repeat names every step) and gathered back by each row's categorical code (one
    hashing pass over the names; joining the parse back on the strings took 1.3x as
    long at 2 M ranges)."""
    if not ranges.height:
        return _parse(ranges)
    codes = ranges["name"].cast(pl.String).cast(pl.Categorical)
    names = codes.unique()
    uniq = _parse(pl.DataFrame({"name": names.cast(pl.String)}))
    # Physical codes -> row of ``uniq`` (a null name is its own row, as in the join).
    physical = names.to_physical()
    top = int(physical.fill_null(0).to_numpy().max()) + 1
    slot = np.zeros(top + 1, np.int64)
    slot[physical.fill_null(top).to_numpy()] = np.arange(names.len())
    rows = slot[codes.to_physical().fill_null(top).to_numpy()]
    out = ranges.hstack(uniq.drop("name")[rows].get_columns())
    if "domain" in out.columns and out["domain"].null_count() < out.height:
        # nsys's naming: a range of a named NVTX domain is "<domain>:<text>".
        out = out.with_columns(label=pl.when(pl.col("domain").is_not_null())
                               .then(pl.col("domain") + ":" + pl.col("label"))
                               .otherwise(pl.col("label")))
    return out


def _parse(ranges: pl.DataFrame) -> pl.DataFrame:
    """Add ``module`` (null when the name is not vLLM's dict), ``label`` (the module path,
    else the raw name), ``layer`` (index from ``layers.<i>``, or a decoder-layer class's
    instance in ``nn.Module: <Class>_<k>``, else null), ``is_layer`` (the range is a whole
    layer) and ``is_output`` (vLLM's output markers)."""
    name = pl.col("name").fill_null("")
    module = name.str.extract(MODULE_RE, 1)
    compiled = name.str.extract(COMPILED_RE, 2)
    out = ranges.with_columns(
        module=module,
        is_output=(module.is_not_null() & name.str.contains("'Outputs'", literal=True))
        | (name.str.extract(COMPILED_RE, 1) == "output").fill_null(False),
        label=pl.coalesce(module, pl.when(compiled.is_not_null())
                          .then(pl.lit("Torch Compiled Module:") + compiled), name),
    )
    torch_class = name.str.extract(TORCH_MODULE_RE, 1)
    torch_layer = (pl.when(torch_class.str.contains(DECODER_CLASS_RE))
                   .then(name.str.extract(TORCH_MODULE_RE, 2)))
    return out.with_columns(
        layer=pl.coalesce(pl.col("label").str.extract(LAYER_RE, 1),
                          pl.col("label").str.extract(GLUED_LAYER_RE, 1),
                          torch_layer).cast(pl.Int64),
        is_layer=pl.col("label").str.contains(LAYER_RANGE_RE) | torch_layer.is_not_null(),
    )


def layer_type(label: pl.Expr) -> pl.Expr:
    """A label with its layer (and other numeric path) indices replaced by ``*``:
    ``model.layers.7.mlp`` -> ``model.layers.*.mlp``, ``layer7.fused`` -> ``layer*.fused``."""
    return (label.str.replace_all(r"\.\d+(\.|$)", ".*$1")
            .str.replace_all(r"\.\d+(\.|$)", ".*$1")  # a second pass for adjacent indices
            .str.replace(r"_\d+$", "_*")
            # ``layer3.standard`` (a layer index glued to its name) -> ``layer*.standard``
            .str.replace(r"(^|\.)layer\d+(\.|$)", "${1}layer*${2}"))
