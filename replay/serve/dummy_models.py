"""Model directories for ``vllm serve --load-format dummy``: a config and a tokenizer, no weights.

On a GPU, vLLM can serve any architecture it knows with random weights
(``--load-format dummy``): it needs only ``config.json`` and a tokenizer. That is how
agentload puts real serving code paths (MLA attention, a routed MoE, CUDA graphs,
speculative decoding) on a lent GPU without downloading a checkpoint. The shapes are
scaled-down copies of public architectures, sized to load on one 80 GB card; the speed
of a decode step depends on the shapes and the kernels, not on the weights' values.

Each preset is built once into the cache (``$AGENTLOAD_CACHE/models/<name>-<digest>``),
deterministically, like the embedded tiny model; an arm names one with
``dummy_model = "<name>"``. The tokenizer is a byte-level BPE (25,109 tokens) trained on a generated
corpus, so the config's ``vocab_size`` is exactly the tokenizer's (a sampled id past the
tokenizer's end would not detokenize).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentload.replay.errors import ServerError
from agentload.replay.serve.tiny_model import (
    COMPLETE_MARKER,
    build_once,
    default_cache_dir,
    write_json,
    write_tokenizer,
)

DUMMY_VOCAB = 32000


@dataclass(frozen=True, slots=True)
class DummyModel:
    """One preset: the architecture's ``config.json`` less what the tokenizer decides."""

    name: str
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 32768

    def digest(self) -> str:
        payload = json.dumps({"v": 1, "name": self.name, "config": self.config},
                             sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:12]


_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}

PRESETS: dict[str, DummyModel] = {
    "dsv3-mini": DummyModel(
        "dsv3-mini",
        "DeepSeek-V3 / Kimi-style MoE scaled to one GPU: MLA attention (latent KV 512 + "
        "rope 64), 12 layers (the first dense), 64 routed experts top-6 with sigmoid "
        "grouped routing, 1 shared expert, one MTP layer; ~5 B parameters",
        {**_COMMON,
         "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
         "hidden_size": 2048, "intermediate_size": 8192, "moe_intermediate_size": 1024,
         "num_hidden_layers": 12, "first_k_dense_replace": 1, "moe_layer_freq": 1,
         "num_attention_heads": 16, "num_key_value_heads": 16,
         "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128,
         "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 6,
         "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
         "norm_topk_prob": True, "routed_scaling_factor": 2.5,
         "num_nextn_predict_layers": 1, "attention_bias": False, "rope_scaling": None}),
    "llama-1b": DummyModel(
        "llama-1b",
        "dense Llama baseline shaped like Llama 3.2 1B: 16 layers, hidden 2048, GQA 32/8 "
        "heads of 64, MLP 8192; ~1.1 B parameters",
        {**_COMMON,
         "architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
         "attention_bias": False, "mlp_bias": False}),
}


def dummy_model(name: str) -> DummyModel:
    """The preset called ``name``, with an error that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ServerError(f"no dummy model {name!r} (known: {', '.join(PRESETS)})") from None


def served_name(model: DummyModel) -> str:
    return f"agentload-{model.name}"


def dummy_model_dir(model: DummyModel, cache_dir: Path | None = None) -> Path:
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return root / "models" / f"{model.name}-{model.digest()}"


def ensure_dummy_model(model: DummyModel, cache_dir: Path | None = None) -> Path:
    """The directory of ``model`` (config + tokenizer), built first if missing."""
    def write(out: Path) -> None:
        vocab = write_tokenizer(out, DUMMY_VOCAB, model.max_model_len, seed=0,
                                corpus_lines=12000)
        write_json(out / "config.json", {**model.config, "vocab_size": vocab})
        write_json(out / "generation_config.json",
                   {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
        write_json(out / COMPLETE_MARKER, {"builder": "agentload", "dummy_model": model.name,
                                           "vocab_size": vocab})

    return build_once(dummy_model_dir(model, cache_dir), write)
