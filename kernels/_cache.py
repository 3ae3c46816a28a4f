"""The compiled-kernel cache: memory, then disk, then (if CuTe DSL is installed) compile.

``get(spec)`` returns a callable taking torch tensors. Lookups, in order:

1. this process's dictionary (one load per spec per process: no recompiling per call);
2. ``<cache>/<arch>/<key>.so`` exported earlier, here or ahead of time on a CPU machine
   (``python -m agentload.kernels.aot``); ``<cache>`` is ``$AGENTLOAD_KERNEL_CACHE`` or
   ``~/.cache/agentload/kernels``, ``<arch>`` e.g. ``sm_90a``;
3. compile with CuTe DSL, export to (2), load.

Loading needs only ``apache-tvm-ffi`` and ``libcute_dsl_runtime.so`` (found beside the
``.so`` files, through ``$AGENTLOAD_CUTE_RUNTIME``, or in the installed DSL), not the
200 MB compiler.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentload.kernels.errors import KernelsError
from agentload.kernels.specs import KernelSpec

_LOADED: dict[tuple[str, str], Callable[..., Any]] = {}
_LOCK = threading.Lock()
_RUNTIME_LOADED = False


def cache_root() -> Path:
    env = os.environ.get("AGENTLOAD_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentload" / "kernels"


def current_arch() -> str:
    """``sm_XXa`` of the current GPU, else ``$CUTE_DSL_ARCH`` (for ahead-of-time builds)."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    try:
        import torch
    except ImportError as exc:
        raise KernelsError("no GPU architecture: torch is missing and CUTE_DSL_ARCH unset") \
            from exc
    if not torch.cuda.is_available():
        raise KernelsError("no CUDA GPU visible and CUTE_DSL_ARCH unset")
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def cutlass_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def _runtime_candidates(arch_dir: Path) -> list[Path]:
    out = []
    env = os.environ.get("AGENTLOAD_CUTE_RUNTIME")
    if env:
        out.append(Path(env))
    out.append(arch_dir / "libcute_dsl_runtime.so")
    spec = importlib.util.find_spec("cutlass")
    if spec is not None and spec.origin:
        # .../nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py -> .../nvidia_cutlass_dsl
        base = Path(spec.origin).resolve().parents[2]
        out.extend(sorted(base.glob("cu*/lib/libcute_dsl_runtime.so")))
    return out


def _load_runtime(arch_dir: Path) -> None:
    global _RUNTIME_LOADED
    if _RUNTIME_LOADED:
        return
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so for the kernels' DT_NEEDED)

    for cand in _runtime_candidates(arch_dir):
        if cand.is_file():
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            _RUNTIME_LOADED = True
            return
    raise KernelsError("libcute_dsl_runtime.so not found: install nvidia-cutlass-dsl, put it "
                       f"in {arch_dir}, or set AGENTLOAD_CUTE_RUNTIME")


def so_path(spec: KernelSpec, arch: str | None = None) -> Path:
    return cache_root() / (arch or current_arch()) / f"{spec.key()}.so"


def _load_so(path: Path) -> Callable[..., Any]:
    import torch  # noqa: F401  (tvm_ffi takes torch tensors once torch is imported)
    import tvm_ffi

    _load_runtime(path.parent)
    module = tvm_ffi.load_module(str(path))
    fn: Callable[..., Any] = module["run"]
    return fn


def get(spec: KernelSpec) -> Callable[..., Any]:
    """The compiled kernel for ``spec`` on this GPU (loaded or compiled once per process)."""
    arch = current_arch()
    key = (arch, spec.key())
    fn = _LOADED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _LOADED.get(key)
        if fn is not None:
            return fn
        path = so_path(spec, arch)
        if not path.is_file():
            if not cutlass_available():
                raise KernelsError(
                    f"no compiled kernel {path.name} for {arch} and nvidia-cutlass-dsl is not "
                    "installed (pip install 'agentload[gpu]', or build ahead of time with "
                    "python -m agentload.kernels.aot)")
            from agentload.kernels._build import export_spec

            export_spec(spec, path.parent)
        fn = _load_so(path)
        _LOADED[key] = fn
        return fn


def loaded_count() -> int:
    """How many kernel variants this process has loaded (a test checks none reload)."""
    return len(_LOADED)
