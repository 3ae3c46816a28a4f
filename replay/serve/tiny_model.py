"""Write the embedded tiny Llama model (weights, config, byte-level BPE tokenizer) locally.

The embedded CPU server must never download anything, so agentload builds its own model
from a fixed seed: a 2-layer Llama (hidden 256, 4 heads of 64, the smallest head size
vLLM's CPU attention accepts) with a 4,096-token byte-level BPE tokenizer trained on a
generated corpus. The weights are random, so the text it writes is noise; what matters
for load testing is that the architecture, the tokenizer and the KV cache are real.

The build is deterministic: the same ``TinyModelSpec`` gives byte-identical files, and
the directory name carries a digest of the spec so a changed spec never reuses a stale
build. Building takes a few seconds and needs ``numpy``, ``safetensors`` and
``tokenizers`` (all in the ``cpu-server`` extra).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from agentload.replay.errors import ServerError

SERVED_MODEL_NAME = "agentload-tiny-llama"
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
# Marker file written last, so a build interrupted half-way is never mistaken for a good one.
COMPLETE_MARKER = "agentload-build.json"
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape of the embedded model; the defaults are what ``serve --embedded`` uses."""

    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 4
    num_layers: int = 2
    intermediate_size: int = 768
    vocab_size: int = 4096
    max_position_embeddings: int = 16384
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def digest(self) -> str:
        """Short content id of the spec (and of the builder's format version)."""
        payload = json.dumps({"v": 1, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:12]


DEFAULT_TINY_MODEL = TinyModelSpec()


def default_cache_dir() -> Path:
    """``$AGENTLOAD_CACHE``, else ``$XDG_CACHE_HOME/agentload``, else ``~/.cache/agentload``."""
    if env := os.environ.get("AGENTLOAD_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "agentload"


def tiny_model_dir(spec: TinyModelSpec = DEFAULT_TINY_MODEL, cache_dir: Path | None = None) -> Path:
    """Where the model for ``spec`` lives (built or not)."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    return root / "models" / f"tiny-llama-{spec.digest()}"


def ensure_tiny_model(
    spec: TinyModelSpec = DEFAULT_TINY_MODEL, cache_dir: Path | None = None
) -> Path:
    """Return the model directory for ``spec``, building it first if it is missing.

    The build goes to a temporary sibling directory that is renamed into place, so two
    processes building at once, or a build killed half-way, never leave a broken model.
    """
    if spec.head_dim < 32 or spec.hidden_size % spec.num_heads:
        raise ServerError(
            f"tiny model head_dim must be a whole number >= 32 (vLLM's CPU attention refuses "
            f"smaller heads); got hidden_size={spec.hidden_size}, num_heads={spec.num_heads}"
        )
    return build_once(tiny_model_dir(spec, cache_dir), lambda out: _write_model(spec, out))


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write`` into a temporary sibling renamed into place unless
    a complete build (its ``COMPLETE_MARKER`` written last) is already there."""
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first; its build is identical, keep it.
            if not (target / COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(spec: TinyModelSpec, out: Path) -> None:
    _write_tokenizer(spec, out)
    _write_weights(spec, out)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": spec.vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    )
    write_json(out / COMPLETE_MARKER, {"builder": "agentload", "spec": asdict(spec)})


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _training_corpus(seed: int, lines: int = 4000, words_drawn: int = 3000) -> list[str]:
    """Pseudo-English from a seeded syllable grammar, with code-like and numeric lines.

    Agent traffic is mostly prose, code and tool output, so the corpus mixes the three;
    the merges the trainer learns from it give a realistic bytes-per-token ratio (~3).
    """
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "pl", "ch", "sh", "th"]
    nuclei = ["a", "e", "i", "o", "u", "ea", "ou", "io", "ai"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck"]
    words = sorted({"".join(rng.choice(p) for p in (onsets, nuclei, codas, nuclei, codas))
                    for _ in range(words_drawn)})
    symbols = ["(", ")", "{", "}", "[", "]", " = ", ".", ", ", ": ", "->", "==", "_", "/"]
    corpus = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.6:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
            corpus.append(sentence.capitalize() + ".")
        elif kind < 0.9:
            corpus.append("".join(rng.choice(words) + rng.choice(symbols)
                                  for _ in range(rng.randint(2, 8))))
        else:
            corpus.append(" ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(2, 10))))
    return corpus


def _write_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, spec.seed)


def write_tokenizer(out: Path, vocab_size: int, max_len: int, seed: int,
                    corpus_lines: int = 4000) -> int:
    """A byte-level BPE of at most ``vocab_size`` tokens in ``out``; returns its size.

    Larger corpora (``corpus_lines``) draw more distinct words, so a 32k vocabulary
    fills up; the default is what the embedded tiny model has always been built from.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    words_drawn = 3000 if corpus_lines == 4000 else 10 * corpus_lines
    tokenizer.train_from_iterator(_training_corpus(seed, corpus_lines, words_drawn),
                                  trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size > vocab_size:
        raise ServerError(f"tokenizer grew to {size} > {vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    bos, eos, pad = SPECIAL_TOKENS
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "add_bos_token": False,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "chat_template": _CHAT_TEMPLATE,
        },
    )
    return int(size)


def _write_weights(spec: TinyModelSpec, out: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.Generator(np.random.PCG64(spec.seed))
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal(spec.vocab_size, h),
        "model.norm.weight": np.ones(h, dtype=np.float32),
        "lm_head.weight": normal(spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, dtype=np.float32),
            p + "self_attn.q_proj.weight": normal(h, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, spec.intermediate_size),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
