"""Token-ID prompts: every trace block becomes the same token ids every time it appears.

Token ids are a hash of (run salt, block id, position), so equal blocks are
byte-equal within a run (the server's prefix cache sees exactly the reuse the
trace describes) while a new salt gives a run its own tokens and no cache hits from
an earlier run against the same server. Lengths are exact: a block of 64 tokens sends
64 token ids, with no tokenizer round trip in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentload.traces import Block

# Ids low enough to exist in every common vocabulary and high enough to skip the
# special tokens most tokenizers put first.
DEFAULT_TOKEN_ID_RANGE = (1000, 32000)


class TokenPrompts:
    """Maps blocks to token ids in ``[low, high)`` for one run (``salt``).

    Token ``k`` of block ``b`` is a 64-bit mix (splitmix64) of (salt, b, k), reduced
    into the range. A token's id depends only on its block and position, so a block
    sent shorter (a cut prompt) is a prefix of itself sent whole, and a whole prompt is
    computed in a few vectorized numpy passes: scaled traces have thousands of small
    blocks per prompt, and building one must not hold up the event loop.
    """

    def __init__(self, salt: int, low: int = DEFAULT_TOKEN_ID_RANGE[0],
                 high: int = DEFAULT_TOKEN_ID_RANGE[1]) -> None:
        if not 0 <= low < high:
            raise ValueError(f"token id range [{low}, {high}) is empty")
        self.salt = salt
        self.low = low
        self.high = high
        self._salt_mix = _splitmix(np.array([salt & _MASK], dtype=np.uint64))[0]

    def block_ids(self, block: Block) -> np.ndarray:
        """The token ids of one block."""
        return self._ids(np.array([block.id], dtype=np.int64),
                         np.array([block.tokens], dtype=np.int64))

    def prompt(self, blocks: Sequence[Block]) -> list[int]:
        """The token ids of a prompt made of ``blocks``, in order."""
        if not blocks:
            return []
        ids = np.fromiter((b.id for b in blocks), dtype=np.int64, count=len(blocks))
        lengths = np.fromiter((b.tokens for b in blocks), dtype=np.int64, count=len(blocks))
        return self._ids(ids, lengths).tolist()  # type: ignore[no-any-return]

    def _ids(self, block_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        total = int(lengths.sum())
        starts = np.cumsum(lengths) - lengths
        position = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
        owner = np.repeat(block_ids, lengths).astype(np.uint64)  # negative ids wrap: fine
        with np.errstate(over="ignore"):
            x = _splitmix(owner ^ self._salt_mix) ^ (position.astype(np.uint64) * _GOLDEN)
            x = _splitmix(x)
        return (self.low + (x % np.uint64(self.high - self.low)).astype(np.int64))


_MASK = 0xFFFFFFFFFFFFFFFF
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out
