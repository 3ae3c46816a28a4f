"""Layer boundaries inferred from a decode step's repeating kernel sequence.

vLLM's specialized decode path (and any CUDA-graph decode) emits no per-layer ranges;
its kernels carry generated names. A transformer's decode step is, however, a prelude
(embedding), the same per-layer kernel sequence repeated once per layer, and a postlude
(final norm, LM head). The period is the shortest shift ``p`` under which the longest
run of ``seq[i] == seq[i + p]`` covers the most kernels; the repeated region is then cut
every ``p`` kernels. The result is a guess and is always labelled ``inferred``: a
prelude that ends with the layer's last kernel shifts the cut by one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MIN_SEQUENCE = 12
"""Shortest step searched: a decode step of any transformer launches more kernels, while
a few bookkeeping kernels outside the step ranges (a sampler's 6) repeat by chance."""
MAX_SEQUENCE = 20_000
"""Longest step searched (the search is O(n^2 / 2) compares, vectorized per shift)."""


@dataclass(frozen=True, slots=True)
class Period:
    """The repeated region: ``reps`` blocks of ``period`` kernels from ``offset``."""

    offset: int
    period: int
    reps: int


GENERATED_INDEX = re.compile(r"^([a-z][a-z0-9]*(?:_[a-z0-9]+)*)_\d+$")
"""A generated kernel name ending in an index: torch.compile numbers the kernels of each
compiled graph (``triton_poi_fused_3``, ``copy_index_select_..._view_5``), so the same
kernel of two layers compiled as two piecewise graphs carries two indices."""


def kernel_identity(name: str) -> str:
    """``name`` less torch.compile's per-graph index: what repeats from layer to layer."""
    match = GENERATED_INDEX.match(name)
    return match.group(1) if match else name


def identity_ids(ids: npt.NDArray[np.int64], names: dict[int, str]) -> npt.NDArray[np.int64]:
    """Kernel name ids mapped so that names equal up to :func:`kernel_identity` share one."""
    if not len(ids):
        return ids
    canon: dict[str, int] = {}
    table = np.arange(int(ids.max()) + 1, dtype=np.int64)
    for i, name in names.items():
        if 0 <= i < len(table):
            table[i] = canon.setdefault(kernel_identity(name), i)
    return table[np.clip(ids, 0, None)]


def find_period(seq: npt.NDArray[np.int64], min_reps: int = 2,
                min_period: int = 2, min_share: float = 0.5) -> Period | None:
    """The repeating block of ``seq`` (kernel name ids in launch order), or None.

    The repeats must cover ``min_share`` of the sequence: a step of a few bookkeeping
    kernels (a sampler, input preparation) often holds two short equal runs by chance,
    which are not layers (vLLM on an H100: "2 layers of 2 kernels" in 16 such kernels).
    """
    n = min(len(seq), MAX_SEQUENCE)
    if n < MIN_SEQUENCE:
        return None
    seq = seq[:n]
    best: Period | None = None
    best_cover = 0
    for p in range(min_period, n // min_reps + 1):
        eq = seq[:-p] == seq[p:]
        if not eq.any():
            continue
        # Longest run of True in eq: boundaries are the False positions.
        padded = np.concatenate(([False], eq, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, ends = edges[0::2], edges[1::2]
        k = int(np.argmax(ends - starts))
        run = int(ends[k] - starts[k])
        cover = run + p
        reps = cover // p
        # Strictly greater only: multiples of the true period cover the same kernels,
        # so the first (smallest) shift reaching the best cover is the period.
        if reps >= min_reps and cover > best_cover:
            best_cover = cover
            best = Period(offset=int(starts[k]), period=p, reps=reps)
    if best is not None and best.period * best.reps < min_share * n:
        return None
    return best


def block_labels(n: int, period: Period | None) -> npt.NDArray[np.int64]:
    """Per position: -1 prelude, 0..reps-1 the layer, ``reps`` (or more) the postlude."""
    pos = np.arange(n, dtype=np.int64)
    if period is None:
        return np.zeros(n, np.int64)
    block = (pos - period.offset) // period.period
    block = np.where(pos < period.offset, -1, block)
    return np.minimum(block, period.reps)
