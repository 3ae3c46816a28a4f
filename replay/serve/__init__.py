"""The servers replayed against: launching vLLM (embedded or from an arm), the tiny
and dummy-weight models, the GPU bundle, Prometheus scrapes, GPU telemetry and the
profile window.
"""
