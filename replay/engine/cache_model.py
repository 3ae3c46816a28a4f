"""The prefix cache a perfect server would have: hits counted at the server's block size.

vLLM caches prompts in KV blocks of ``block_size`` tokens (64 for the embedded server,
16 by default on GPUs) and matches a new prompt block by block from its start; a
block matches only if every token before its end is the same as in some earlier
prompt. A trace's own blocks may be of another size (Mooncake's 512, or scaled down by
``--scale-tokens``), so each server block is identified by the trace blocks that lead
up to its end: the chain of whole trace blocks before it, the trace block it ends in,
and how far into that block it ends. Equal identity means equal tokens.

vLLM always computes at least the prompt's last token, so at most
``(ISL - 1) // block_size`` blocks can hit. A prompt's blocks count as cached from its
first token on: one sent while an identical prefix is still being prefilled misses.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentload.traces import Block


def server_block_keys(blocks: Sequence[Block], block_size: int) -> list[int]:
    """One identity per full server block of the prompt, in order."""
    keys: list[int] = []
    chain = 0
    pos = 0
    for block in blocks:
        end = pos + block.tokens
        boundary = (pos // block_size + 1) * block_size
        while boundary <= end:
            keys.append(hash((chain, block.id, boundary - pos)))
            boundary += block_size
        chain = hash((chain, block.id))
        pos = end
    return keys


class PrefixCacheModel:
    """An infinite prefix cache at ``block_size``: how much of each prompt would hit."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._seen: set[int] = set()

    def send(self, blocks: Sequence[Block], *, cache_now: bool = True) -> tuple[int, list[int]]:
        """Cached tokens for a prompt of ``blocks`` sent now, and the prompt's block keys.

        With ``cache_now`` the prompt counts as cached at once; otherwise the caller
        calls ``cache(keys)`` when the server has computed it (its first token): a
        prompt that arrives while an identical prefix is still being prefilled cannot
        hit it on a real server either.
        """
        keys = server_block_keys(blocks, self.block_size)
        tokens = sum(b.tokens for b in blocks)
        limit = max(0, (tokens - 1) // self.block_size)
        hits = 0
        for key in keys[:limit]:
            if key not in self._seen:
                break
            hits += 1
        if cache_now:
            self.cache(keys)
        return hits * self.block_size, keys

    def cache(self, keys: Sequence[int]) -> None:
        self._seen.update(keys)

    def send_hits(self, blocks: Sequence[Block]) -> int:
        """``send`` for a prompt cached at once; just the hit tokens."""
        return self.send(blocks)[0]
