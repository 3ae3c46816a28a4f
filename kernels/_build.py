"""Compile one :class:`KernelSpec` with CuTe DSL and export it as a small shared library.

Compilation needs ``nvidia-cutlass-dsl`` but no GPU: with ``CUTE_DSL_ARCH=sm_90a`` a CPU
machine builds H200 kernels ahead of time (``python -m agentload.kernels.aot``). Each
kernel is compiled with ``--enable-tvm-ffi`` and the TVM-FFI environment stream, so the
exported function takes torch tensors directly and launches on torch's current stream
(CUDA-graph capture included). The export is ``<key>.o`` linked into ``<key>.so`` against
``libcute_dsl_runtime.so`` and ``libtvm_ffi.so`` with an ``$ORIGIN`` rpath.
"""

# mypy: ignore-errors

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from agentload.kernels import _cute, _cute_attention, _cute_experts, _cute_mla
from agentload.kernels.errors import KernelsError
from agentload.kernels.specs import KernelSpec

FUNCTION = "run"


def _t(dtype: Any, shape: tuple[Any, ...]) -> Any:
    order = tuple(range(len(shape) - 1, -1, -1))  # row-major
    return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)


def _launcher_and_args(spec: KernelSpec) -> tuple[Any, tuple[Any, ...]]:
    g = spec.get
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if spec.kind == "add_rmsnorm":
        h, s = int(g("h")), int(g("s"))
        m = cute.sym_int()
        fn = _cute.AddRMSNorm(h, s, int(g("t")), bool(g("pdl", False)), int(g("c", 1)))
        return fn, (_t(BFloat16, (m, s, h)), _t(BFloat16, (m, h)), _t(BFloat16, (1, h)),
                    _t(BFloat16, (m, h)), _t(BFloat16, (m, h)), Float32(1e-6), stream)
    if spec.kind == "silu_mul":
        i = int(g("i"))
        m = cute.sym_int()
        fn = _cute.SiluMul(i, int(g("t")))
        return fn, (_t(BFloat16, (m, 2 * i)), _t(BFloat16, (m, i)), stream)
    if spec.kind == "gemv":
        k, n, m = int(g("k")), int(g("n")), int(g("m"))
        res, norm = bool(g("res")), bool(g("norm"))
        fn = _cute.Gemv(k, m, int(g("t")), int(g("opb")), res, norm, bool(g("pdl", False)),
                        bool(g("mma", False)))
        small = (1, 8)
        # x may be a row slice of a wider tensor (v of qkv): dynamic row stride, 16 B aligned.
        x = make_fake_tensor(BFloat16, (m, k), (cute.sym_int(divisibility=8), 1),
                             assumed_align=16)
        return fn, (x, _t(BFloat16, (n, k)),
                    _t(BFloat16, (m, n) if res else small), _t(BFloat16, (m, n)),
                    _t(BFloat16, (1, n) if norm else small),
                    _t(BFloat16, (m, n) if norm else small),
                    _t(Float32, (m,) if norm else (1,)), _t(Int32, (1,)), Float32(1e-6), stream)
    if spec.kind == "grouped_gemv":
        k, n, e = int(g("k")), int(g("n")), int(g("e"))
        silu = bool(g("silu"))
        rx, r = cute.sym_int(), cute.sym_int()
        fn = _cute.GroupedGemv(k, int(g("t")), int(g("opb")), int(g("div")), silu,
                               bool(g("pdl", False)))
        return fn, (_t(BFloat16, (rx, k)), _t(BFloat16, (e, n, k)), _t(Int32, (r,)),
                    _t(Float32, (r,)), _t(BFloat16, (r, n // 2 if silu else n)), stream)
    if spec.kind == "expert_gemm":
        k, n, e, m, slots = int(g("k")), int(g("n")), int(g("e")), int(g("m")), int(g("s"))
        silu = bool(g("silu"))
        rx, r = cute.sym_int(), cute.sym_int()
        fn = _cute_experts.ExpertGemm(k, m, m * slots, int(g("t")), int(g("div")), silu,
                                      bool(g("pdl", False)), int(g("pt", 0)))
        return fn, (_t(BFloat16, (rx, k)), _t(BFloat16, (e, n, k)), _t(Int32, (r,)),
                    _t(Float32, (r,)), _t(BFloat16, (r, n // 2 if silu else n)), stream)
    if spec.kind == "router":
        h, e, k = int(g("h")), int(g("e")), int(g("k"))
        slots = k + 1 if g("shared") else k
        m = cute.sym_int()
        fn = _cute.Router(h, e, k, int(g("g")), int(g("tg")), float(g("scale")),
                          bool(g("shared")), bool(g("pdl", False)))
        return fn, (_t(BFloat16, (m, h)), _t(BFloat16, (e, h)), _t(Float32, (e,)),
                    _t(Float32, (m, e)), _t(Int32, (m, slots)), _t(Float32, (m, slots)), stream)
    if spec.kind == "decode_attn":
        d = int(g("d"))
        b, hq, hkv, pages, maxp, splits = (cute.sym_int() for _ in range(6))
        dv = int(g("dv", 0)) or d  # the value's width (MLA: the key's latent prefix)
        if g("shared", False):
            fn = _cute_mla.DecodeAttentionMla(d, dv, int(g("g")), int(g("p")), int(g("c")),
                                              int(g("st")), bool(g("direct")),
                                              bool(g("pdl", False)))
        elif g("mma", False):
            fn = _cute_attention.DecodeAttentionMma(
                d, int(g("g")), int(g("p")), int(g("c")), int(g("t")) // 32, int(g("st")),
                bool(g("direct")), bool(g("pdl", False)), bool(g("fresh", False)), dv,
                bool(g("latent", False)), bool(g("merge", False)), int(g("kh", 1)),
                bool(g("kl", False)), bool(g("tl", False)), bool(g("dyn", False)),
                int(g("dfx", 0)))
        else:
            fn = _cute_attention.DecodeAttention(
                d, int(g("g")), int(g("p")), int(g("c")), int(g("t")), int(g("u")),
                bool(g("direct")), bool(g("pdl", False)), bool(g("fresh", False)),
                bool(g("pipe", False)))

        def heads(n: Any) -> Any:  # [B, n, D] with any 16-byte-aligned batch stride
            return make_fake_tensor(BFloat16, (b, n, d), (cute.sym_int(divisibility=8), d, 1),
                                    assumed_align=16)

        cache = _t(BFloat16, (pages, int(g("p")), hkv, d))
        counters = (_t(Int32, (cute.sym_int(),)),) if g("mma", False) else ()
        return fn, (heads(hq), cache, _t(BFloat16, (pages, int(g("p")), hkv, d)),
                    _t(Int32, (b, maxp)), _t(Int32, (b,)), _t(Float32, (b, hq, splits, dv)),
                    _t(Float32, (b, hq, splits)), _t(BFloat16, (b, hq, dv)), heads(hkv),
                    heads(hkv), *counters, Float32(1.0), stream)
    if spec.kind == "attn_combine":
        d = int(g("d"))
        b, hq, splits = (cute.sym_int() for _ in range(3))
        tensors = (_t(Float32, (b, hq, splits, d)), _t(Float32, (b, hq, splits)),
                   _t(Int32, (b,)), _t(BFloat16, (b, hq, d)))
        if g("all", False):  # + the dynamic split's tile counters, re-armed here
            fn = _cute_attention.AttentionCombineEvery(d, int(g("c")), int(g("t")),
                                                       bool(g("pdl", False)))
            return fn, (*tensors, _t(Int32, (cute.sym_int(),)), stream)
        fn = _cute_attention.AttentionCombine(d, int(g("c")), int(g("t")), bool(g("pdl", False)))
        return fn, (*tensors, stream)
    raise KernelsError(f"unknown kernel kind {spec.kind!r}")


def compile_spec(spec: KernelSpec, *, keep_ptx: bool = False) -> Any:
    """``cute.compile`` the spec's launcher; returns the TVM-FFI callable."""
    fn, args = _launcher_and_args(spec)
    if not keep_ptx:
        return cute.compile(fn, *args, options="--enable-tvm-ffi")
    # The DSL dumps the PTX under a name made of the launcher's signature (specs of one
    # class share it) and reads it back: in the working directory, two compiles running
    # at once would read each other's. A directory of its own for each.
    with tempfile.TemporaryDirectory(prefix="agentload-ptx-") as tmp:
        compiled = cute.compile(fn, *args,
                                options=f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp}")
        compiled.__ptx__  # noqa: B018 (read while the file is there)
        return compiled


def runtime_libraries() -> list[str]:
    return list(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True))


def export_spec(spec: KernelSpec, out_dir: Path, *, keep_ptx: bool = False) -> Path:
    """Compile and write ``out_dir/<key>.so`` (plus ``.ptx`` when asked); return the .so."""
    compiled = compile_spec(spec, keep_ptx=keep_ptx)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = spec.key()
    with tempfile.TemporaryDirectory(prefix="agentload-cute-") as tmp:
        obj = Path(tmp) / f"{key}.o"
        compiled.export_to_c(str(obj), function_name=FUNCTION)
        so_tmp = Path(tmp) / f"{key}.so"
        libs = runtime_libraries()
        cmd = [os.environ.get("CC", "gcc"), "-shared", "-o", str(so_tmp), str(obj),
               *[f"-L{Path(p).parent}" for p in libs], "-l:libcute_dsl_runtime.so",
               "-l:libtvm_ffi.so", "-Wl,-rpath,$ORIGIN"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise KernelsError(f"linking {key}.so failed: {done.stderr.strip()[:400]}")
        target = out_dir / f"{key}.so"
        shutil.move(str(so_tmp), target)
    if keep_ptx and getattr(compiled, "__ptx__", None):
        (out_dir / f"{key}.ptx").write_text(compiled.__ptx__)
    return target
