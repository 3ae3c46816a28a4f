"""Replay itself: each lane's plan, the prompts, the prefix-cache model, pacing,
the trace fit and presets, and the engine (``core``) that drives them.
"""
