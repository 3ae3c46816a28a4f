"""The streaming HTTP client: SSE parsing (``sse``), kernel receive stamps
(``netstamp``) and the client's self-diagnostics.
"""
