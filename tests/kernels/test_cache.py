"""The compiled-kernel cache (``kernels/_cache.py``): its own tests."""

from __future__ import annotations

import pytest

from agentload.kernels import KernelsError
from agentload.kernels.specs import silu_mul_spec


def test_cache_reports_missing_compiler(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from agentload.kernels import _cache

    monkeypatch.setenv("AGENTLOAD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(_cache, "cutlass_available", lambda: False)
    monkeypatch.setattr(_cache, "_LOADED", {})  # a GPU session may have loaded it already
    with pytest.raises(KernelsError, match="no compiled kernel"):
        _cache.get(silu_mul_spec(1024))
    assert _cache.so_path(silu_mul_spec(1024)).parent == tmp_path / "sm_90a"
