"""Checks of the measuring client itself: the emulated server, client benchmarks,
agreement with ``vllm bench serve`` and AIPerf, worker shards, and their CLI.
"""
