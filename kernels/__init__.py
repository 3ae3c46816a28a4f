"""agentload.kernels: CuTe DSL decode-step kernels, references and GPU ceilings (GPU only).

Not built yet; its commands arrive with the kernels issue.
"""
