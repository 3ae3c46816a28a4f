"""What a target server is before a replay: its URL checked, its model and KV block size,
the token ids it accepts, and the words per token of its tokenizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentload.replay.engine.prompts import (
    CALIBRATION_BLOCKS,
    DEFAULT_TOKEN_ID_RANGE,
    WORDS,
    TextPrompts,
    words_per_token,
)
from agentload.replay.errors import ReplayError
from agentload.replay.serve import prometheus
from agentload.traces.headers import PROBE_HEADER

Say = Callable[[str], None]


def check_target_url(url: str) -> str:
    """Normalize ``url`` (no trailing slash) or raise ``ReplayError`` saying what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplayError(f"--target must be an http(s) URL such as http://127.0.0.1:8000, "
                          f"got {url!r}")
    try:
        _ = parts.port
    except ValueError:
        raise ReplayError(f"--target has an invalid port: {url!r}") from None
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def probe_target(base_url: str, model: str | None, api_key: str | None,
                 timeout_s: float = 10.0) -> tuple[str, dict[str, Any]]:
    """Ask the server for its models (and version); return (model to use, facts)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client:
            resp = client.get(base_url + "/v1/models")
            version = None
            with contextlib.suppress(httpx.HTTPError, ValueError):
                v = client.get(base_url + "/version")
                if v.status_code == 200:
                    version = v.json().get("version")
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise ReplayError(f"cannot reach {base_url}: {reason}") from None
    if resp.status_code != 200:
        raise ReplayError(f"{base_url}/v1/models answered HTTP {resp.status_code}; "
                          "is this an OpenAI-compatible server (and is the API key right)?")
    try:
        listing = resp.json().get("data", [])
        models = [m["id"] for m in listing]
        max_len = {m["id"]: m.get("max_model_len") for m in listing}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ReplayError(f"{base_url}/v1/models did not return an OpenAI model list") from None
    if model is None:
        if not models:
            raise ReplayError(f"{base_url} serves no models")
        model = models[0]
    elif models and model not in models:
        raise ReplayError(f"{base_url} does not serve model {model!r} (it serves: "
                          f"{', '.join(models)})")
    return model, {"models": models, "server_version": version,
                   "max_model_len": max_len.get(model),
                   "kv_block_size": _kv_block_size(base_url, headers, timeout_s)}


def _kv_block_size(base_url: str, headers: dict[str, str], timeout_s: float) -> int | None:
    """The server's KV block size from its metrics, so theoretical hits use its blocks."""
    with (contextlib.suppress(httpx.HTTPError),
          httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client):
        resp = client.get(base_url + "/metrics")
        if resp.status_code == 200:
            return prometheus.kv_block_size(resp.text)
    return None


def _accepts_token_id(client: httpx.Client, base_url: str, model: str, token_id: int) -> bool:
    # The probe header lets a recording proxy (``agentload record``) leave probes out.
    resp = client.post(base_url + "/v1/completions", headers={PROBE_HEADER: "1"},
                       json={"model": model, "prompt": [token_id], "max_tokens": 1})
    if resp.status_code == 200:
        return True
    if resp.status_code in (400, 422):
        return False
    raise ReplayError(f"{base_url}/v1/completions answered HTTP {resp.status_code} to a "
                      f"one-token probe: {resp.text[:200]}")


def detect_token_id_range(base_url: str, model: str, api_key: str | None,
                          wanted: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
                          timeout_s: float = 30.0) -> tuple[int, int]:
    """The part of ``wanted`` inside the target's vocabulary, found with 1-token probes.

    One probe when the vocabulary covers ``wanted`` (the usual case); otherwise a binary
    search for the largest accepted id (about 15 probes), made before the run's window
    opens, so they are not in its metrics.
    """
    low, high = wanted
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client:
            if _accepts_token_id(client, base_url, model, high - 1):
                return wanted
            low = min(low, 16)
            if not _accepts_token_id(client, base_url, model, low):
                raise ReplayError(
                    f"{base_url} refuses token-id prompts on /v1/completions; agentload's "
                    "token-id mode needs a vLLM-compatible completions endpoint")
            good, bad = low, high - 1  # good is accepted, bad is refused
            while bad - good > 1:
                mid = (good + bad) // 2
                if _accepts_token_id(client, base_url, model, mid):
                    good = mid
                else:
                    bad = mid
    except httpx.HTTPError as exc:
        raise ReplayError(f"cannot probe {base_url}: {exc}") from None
    if good + 1 - low < 256:
        raise ReplayError(f"{base_url}'s vocabulary is too small for token-id prompts "
                          f"(largest id {good})")
    return low, good + 1


def _token_count(client: httpx.Client, base_url: str, model: str, text: str) -> int:
    """``text``'s token count by the target's /tokenize, no special tokens (0: refused)."""
    resp = client.post(base_url + "/tokenize", json={
        "model": model, "prompt": text, "add_special_tokens": False})
    return int(resp.json()["count"]) if resp.status_code == 200 else 0


def word_token_counts(client: httpx.Client, base_url: str, model: str
                      ) -> tuple[int, ...] | None:
    """Each built-in word's token count after a space (as it stands in a prompt), asked
    of the target's /tokenize one word at a time; None when it cannot say."""
    counts = []
    for word in WORDS:
        n = _token_count(client, base_url, model, " " + word)
        if n <= 0:
            return None
        counts.append(n)
    return tuple(counts)


def calibrate_words(base_url: str, model: str, api_key: str | None, timeout_s: float = 30.0
                    ) -> tuple[float, str, tuple[int, ...] | None]:
    """How chat prompts are written for the target: (words per token, how it was found,
    each word's token count or None). With /tokenize, every word's count is asked and a
    3,200-token sample built from the counts is checked to be 3,200 tokens (give or take
    the first word); then prompt lengths are exact. Else words per token is measured."""
    words = sum(b.tokens for b in CALIBRATION_BLOCKS)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client:
            tokens = word_token_counts(client, base_url, model)
            if tokens is not None and 1 in tokens and min(tokens) >= 1:
                sample = TextPrompts(0, 1.0, tokens).text(CALIBRATION_BLOCKS)
                got = _token_count(client, base_url, model, sample)
                if abs(got - words) <= 2:
                    per = len(sample.split()) / words
                    return per, (f"/tokenize: each word's tokens counted, {words}-token "
                                 f"sample = {got} tokens ({per:.3f} words per token)"), tokens
            got = _token_count(client, base_url, model, TextPrompts(0).text(CALIBRATION_BLOCKS))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        got = 0
    if got <= 0:
        return 1.0, "no /tokenize on the target: one word per token assumed", None
    return words_per_token(got, words), f"/tokenize: {words} words = {got} tokens", None
