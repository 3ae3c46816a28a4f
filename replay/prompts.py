"""Token-ID prompts: every trace block becomes the same token ids every time it appears.

Token ids are drawn from a generator seeded by (run salt, block id), so equal blocks
are byte-equal within a run (the server's prefix cache sees exactly the reuse the
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
    """Maps blocks to token ids in ``[low, high)`` for one run (``salt``)."""

    def __init__(self, salt: int, low: int = DEFAULT_TOKEN_ID_RANGE[0],
                 high: int = DEFAULT_TOKEN_ID_RANGE[1]) -> None:
        if not 0 <= low < high:
            raise ValueError(f"token id range [{low}, {high}) is empty")
        self.salt = salt
        self.low = low
        self.high = high
        self._cache: dict[int, np.ndarray] = {}

    def block_ids(self, block: Block) -> np.ndarray:
        ids = self._cache.get(block.id)
        if ids is None or len(ids) != block.tokens:
            rng = np.random.default_rng([self.salt & 0xFFFFFFFF, block.id & 0xFFFFFFFFFFFF])
            ids = rng.integers(self.low, self.high, size=block.tokens, dtype=np.int64)
            self._cache[block.id] = ids
        return ids

    def prompt(self, blocks: Sequence[Block]) -> list[int]:
        """The token ids of a prompt made of ``blocks``, in order."""
        if not blocks:
            return []
        return np.concatenate([self.block_ids(b) for b in blocks]).tolist()  # type: ignore[no-any-return]
