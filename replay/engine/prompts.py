"""Token-ID prompts: every trace block becomes the same token ids every time it appears.

Token ids are a hash of (run salt, block id, position), so equal blocks are
byte-equal within a run (the server's prefix cache sees exactly the reuse the
trace describes) while a new salt gives a run its own tokens and no cache hits from
an earlier run against the same server. Lengths are exact: a block of 64 tokens sends
64 token ids, with no tokenizer round trip in between.
"""

from __future__ import annotations

import math
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
        # Blocks whose tokens are given, not derived: the model's actual outputs, threaded
        # into later prompts (``--outputs actual``).
        self._literals: dict[int, np.ndarray] = {}
        self._next_literal = LITERAL_BASE

    def literal(self, token_ids: Sequence[int]) -> Block:
        """A new block that stands for exactly ``token_ids``."""
        block = Block(self._next_literal, len(token_ids))
        self._next_literal -= 1
        self._literals[block.id] = np.asarray(token_ids, dtype=np.int64)
        return block

    def block_ids(self, block: Block) -> np.ndarray:
        """The token ids of one block."""
        return self._ids(np.array([block.id], dtype=np.int64),
                         np.array([block.tokens], dtype=np.int64))

    def prompt(self, blocks: Sequence[Block]) -> list[int]:
        """The token ids of a prompt made of ``blocks``, in order."""
        if not blocks:
            return []
        if self._literals and any(b.id in self._literals for b in blocks):
            parts: list[np.ndarray] = []
            run: list[Block] = []
            for block in blocks:
                if block.id in self._literals:
                    if run:
                        parts.append(self._derived(run))
                        run = []
                    parts.append(self._literals[block.id])
                else:
                    run.append(block)
            if run:
                parts.append(self._derived(run))
            return np.concatenate(parts).tolist()  # type: ignore[no-any-return]
        return self._derived(blocks).tolist()  # type: ignore[no-any-return]

    def _derived(self, blocks: Sequence[Block]) -> np.ndarray:
        ids = np.fromiter((b.id for b in blocks), dtype=np.int64, count=len(blocks))
        lengths = np.fromiter((b.tokens for b in blocks), dtype=np.int64, count=len(blocks))
        return self._ids(ids, lengths)

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
# Literal blocks count down from here, far below play markers (-1, -2, ...).
LITERAL_BASE = -(1 << 40)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


# Short, common English words: one token each (with their leading space) in the usual
# BPE vocabularies, so a block's word count tracks its token count.
_WORD_TEXT = (
    "the of and to in is it that for on was with he as at by be this had not are but from "
    "or have an they which one you were her all she there would their we him been has when "
    "who will more no if out so said what up its about into than them can only other new "
    "some could time these two may then do first any my now such like our over man me even "
    "most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three place around however home small found thought went say part once high "
    "general upon school every don does got united left number course war until always away "
    "something fact though water less public put think almost hand enough far took head yet "
    "government system better set told nothing night end why called didn eyes find going "
    "look asked later point knew city next program business give group toward young days let "
    "room president side social present given several order national possible rather second "
    "face per among form important often things looked early white case john become large big "
    "need four within felt along children saw best church ever least power development light "
    "thing seemed family interest want members mind country area others done turned although "
    "open god service problem certain kind different thus began door help means sense whole "
    "matter perhaps itself york times law human line above name example action company hands "
    "local show whether five history gave today either act feet across taken past quite "
    "anything seen having death experience body word half really week field car words already "
    "themselves information tell together college shall money period held keep sure free "
    "seems real behind cannot miss political air question making office brought whose special"
)
WORDS = tuple(_WORD_TEXT.split())


EXACT_CACHE_BLOCKS = 1 << 16
"""Blocks whose exact-length words are kept (a few MB); past it the cache starts over."""


class TextPrompts:
    """Maps blocks to deterministic text for chat endpoints (which take no token ids).

    Word ``k`` of block ``b`` is picked by the same hash of (salt, b, k) as token-id
    prompts, so equal blocks are equal text and a prompt that extends another extends
    its text. Given each built-in word's token count on the target's tokenizer (asked of
    its /tokenize: ``probe.calibrate_words``), a block of n tokens takes its hashed words
    while they fit in n and ends with one-token words, so lengths are exact with the
    text's usual words per token; without the counts, ``words_per_token`` (measured with
    /tokenize when the target has it) sets how many words stand for a block's tokens.
    The server's ``usage.prompt_tokens`` is the ISL that gets recorded, and the run
    reports how far it is from the trace's.
    """

    def __init__(self, salt: int, words_per_token: float = 1.0,
                 word_tokens: Sequence[int] | None = None) -> None:
        if not words_per_token > 0:
            raise ValueError("words_per_token must be positive")
        self._ids = TokenPrompts(salt, 0, len(WORDS))
        self.words_per_token = words_per_token
        self._exact: tuple[np.ndarray, np.ndarray] | None = None
        if word_tokens is not None:
            counts = np.asarray(word_tokens, dtype=np.int64)
            ones = np.flatnonzero(counts == 1)
            if len(counts) != len(WORDS) or not len(ones) or (counts < 1).any():
                raise ValueError("word_tokens needs a count >= 1 per built-in word and at "
                                 "least one one-token word")
            self._exact = counts, ones
        self._exact_cache: dict[tuple[int, int], np.ndarray] = {}
        # The model's actual answers (``--outputs actual``): text given, not derived.
        self._literals: dict[int, str] = {}
        self._next_literal = LITERAL_BASE

    def _exact_words(self, block: Block) -> np.ndarray:
        """Word indices whose token counts sum to ``block.tokens``: the block's hashed
        words while they fit, then one-token words (hashed too) for the rest."""
        assert self._exact is not None
        # Later turns resend earlier blocks: each block's words are worked out once.
        key = (block.id, block.tokens)
        cached = self._exact_cache.get(key)
        if cached is not None:
            return cached
        if len(self._exact_cache) >= EXACT_CACHE_BLOCKS:
            self._exact_cache.clear()
        counts, ones = self._exact
        picks = self._ids.block_ids(block)
        total = np.cumsum(counts[picks])
        fit = int(np.searchsorted(total, block.tokens, side="right"))
        rest = block.tokens - (int(total[fit - 1]) if fit else 0)
        # Each word taken holds >= 1 token, so fit + rest <= tokens: picks suffice.
        words: np.ndarray = np.concatenate([picks[:fit], ones[picks[fit:fit + rest] % len(ones)]])
        self._exact_cache[key] = words
        return words

    def _words(self, block: Block) -> int:
        """How many words stand for ``block``: ``tokens * words_per_token``, its fraction
        rounded up for a fixed, id-hashed share of blocks (``_dither``). Plain rounding
        bias every block the same way (at 0.30 words per token a 64-token block is 19.3
        words: 19, 1.7 % short on every prompt); this way a block's text is the same
        wherever it appears and prompts come out right on average."""
        exact = block.tokens * self.words_per_token
        whole = math.floor(exact)
        return max(1, whole + (_dither(block.id) < exact - whole))

    def literal(self, text: str, tokens: int) -> Block:
        """A new block that stands for exactly ``text`` (``tokens`` long, as generated)."""
        block = Block(self._next_literal, max(1, tokens))
        self._next_literal -= 1
        self._literals[block.id] = text
        return block

    def block_text(self, block: Block) -> str:
        return self.text([block])

    def text(self, blocks: Sequence[Block]) -> str:
        """The text of a prompt made of ``blocks``: space-separated words, in order."""
        parts = [text for _, text in self._segments(blocks)]
        return " ".join(p for p in parts if p)

    def messages(self, blocks: Sequence[Block]) -> list[dict[str, str]]:
        """Chat messages for ``blocks``: the model's own answers (literal blocks) become
        assistant turns between user turns, as an agent's history would, so the server
        can reuse the KV it generated; everything else is user text."""
        out: list[dict[str, str]] = []
        for is_answer, text in self._segments(blocks):
            role = "assistant" if is_answer else "user"
            if out and out[-1]["role"] == role:
                out[-1]["content"] += " " + text
            else:
                out.append({"role": role, "content": text})
        if not out or out[0]["role"] != "user":
            out.insert(0, {"role": "user", "content": ""})
        return out

    def messages_in(self, blocks: Sequence[Block],
                    segments: Sequence[tuple[str, int]]) -> list[dict[str, str]]:
        """Chat messages for ``blocks`` cut into ``segments`` ((role, blocks) in order,
        ``plan.chat_segments``'s). A marker block (negative id, not counted in the
        segments) joins the message of the block after it; blocks past the segments
        join the last message."""
        out: list[dict[str, str]] = []
        groups: list[tuple[str, list[Block]]] = [(role, []) for role, _ in segments]
        left = [n for _, n in segments]
        at = 0
        for block in blocks:
            while at < len(left) - 1 and left[at] <= 0:
                at += 1
            if not groups:
                groups.append(("user", []))
                left.append(0)
            groups[at][1].append(block)
            if block.id >= 0:
                left[at] -= 1
        for role, group in groups:
            if group:
                out.append({"role": role, "content": self.text(group)})
        if not out or out[-1]["role"] == "assistant":
            out.append({"role": "user", "content": ""})
        return out

    def _segments(self, blocks: Sequence[Block]) -> list[tuple[bool, str]]:
        """Runs of derived words and literal answers, in order: (is_answer, text)."""
        segments: list[tuple[bool, str]] = []
        run: list[Block] = []

        def flush() -> None:
            if run:
                if self._exact is not None:
                    picks: list[int] = np.concatenate(
                        [self._exact_words(b) for b in run]).tolist()
                else:
                    picks = self._ids.prompt([Block(b.id, self._words(b)) for b in run])
                segments.append((False, " ".join(WORDS[i] for i in picks)))
                run.clear()

        for block in blocks:
            answer = self._literals.get(block.id)
            if answer is None:
                run.append(block)
            else:
                flush()
                segments.append((True, answer))
        flush()
        return segments


CALIBRATION_BLOCK = Block(id=-7, tokens=400)
# What ``run.calibrate_words`` tokenizes: 3,200 words, so the sample's word mix is close
# to a long prompt's (one 400-word block put words per token off by about 1 %).
CALIBRATION_BLOCKS = tuple(Block(id=-7 - i, tokens=400) for i in range(8))


def _dither(block_id: int) -> float:
    """A fixed number in [0, 1) per block id (a multiplicative hash)."""
    return ((block_id * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) / 2.0**64


def words_per_token(token_count: int, words: int = CALIBRATION_BLOCK.tokens) -> float:
    """The word count that makes ``words`` words tokenize to as many tokens."""
    return words / token_count if token_count > 0 else 1.0
