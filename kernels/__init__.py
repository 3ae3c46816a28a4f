"""agentload.kernels: CuTe DSL decode-step kernels, torch references and GPU ceilings.

Importing this package needs neither a GPU, torch nor the CuTe DSL: the public surface
here is the error type, the kernel specs (shape rules, cache keys) and the layer shape.
The GPU parts are modules of their own, imported when used:

- ``agentload.kernels.ops``: the kernels as torch functions (``add_rmsnorm``, ``gemv``,
  ``silu_mul``, ``moe_router``, ``oproj_residual_rmsnorm``, ``grouped_gemv``);
- ``agentload.kernels.reference``: float64 torch references and the tolerances;
- ``agentload.kernels.layer``: the scaled-down MoE decoder layer (standard / fused);
- ``agentload.kernels.ceilings`` and ``agentload.kernels.bench``: ``agentload bench
  ceilings`` and ``agentload bench kernels``;
- ``agentload.kernels.aot``: compile every variant ahead of time (CPU machine is enough).
"""

from __future__ import annotations

from agentload.kernels.errors import KernelsError
from agentload.kernels.presets import LayerConfig, bench_specs
from agentload.kernels.specs import KernelSpec

__all__ = ["KernelSpec", "KernelsError", "LayerConfig", "bench_specs"]
