"""The embedded tiny model is built locally, deterministically, and in vLLM's shape."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agentload.replay.errors import ServerError
from agentload.replay.serve.tiny_model import TinyModelSpec, ensure_tiny_model


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir())}


def test_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = ensure_tiny_model(cache_dir=tmp_path / "a")
    b = ensure_tiny_model(cache_dir=tmp_path / "b")
    assert digest(a) == digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(cache_dir=tmp_path / "a") == a  # second call reuses the build
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_model_shape_and_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    spec = TinyModelSpec()
    model = ensure_tiny_model(spec, cache_dir=tmp_path)
    config = json.loads((model / "config.json").read_text())
    assert config["hidden_size"] == 256 and config["num_attention_heads"] == 4
    assert config["head_dim"] == 64 and config["num_hidden_layers"] == 2
    assert config["max_position_embeddings"] >= 8192
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.get_vocab_size() == spec.vocab_size
    text = "def replay(trace): return 42 # naïve ünïcode ✓"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    assert len(ids) < len(text.encode())  # and merges really compress it


def test_different_seed_gives_a_different_directory(tmp_path: Path) -> None:
    assert (ensure_tiny_model(TinyModelSpec(seed=1), tmp_path)
            != ensure_tiny_model(TinyModelSpec(seed=2), tmp_path))


def test_small_heads_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="head_dim"):
        ensure_tiny_model(TinyModelSpec(hidden_size=64, num_heads=4), tmp_path)
