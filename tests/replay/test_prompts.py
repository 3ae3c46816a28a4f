"""Prompt builders: token ids and chat text per block, and the model's answers threaded in."""

from __future__ import annotations

from agentload.replay.engine.prompts import TextPrompts, TokenPrompts
from agentload.traces import Block


def test_equal_blocks_are_equal_text_and_prompts_extend() -> None:
    texts = TextPrompts(salt=5, words_per_token=0.5)
    a, b = Block(1, 40), Block(2, 20)
    assert texts.text([a]) == texts.text([a])
    assert texts.text([a, b]).startswith(texts.text([a]) + " ")
    assert len(texts.text([a]).split()) == 20  # 40 tokens at 0.5 words per token
    assert TextPrompts(salt=6, words_per_token=0.5).text([a]) != texts.text([a])


def test_answers_become_assistant_turns_between_user_turns() -> None:
    texts = TextPrompts(salt=5)
    first, follow_up, later = Block(1, 8), Block(2, 4), Block(3, 4)
    answer = texts.literal("the model said this", tokens=5)
    second = texts.literal("and then this", tokens=3)
    messages = texts.messages([first, answer, follow_up, second, later])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[1]["content"] == "the model said this"
    assert messages[3]["content"] == "and then this"
    assert messages[0]["content"] == texts.text([first])
    assert messages[2]["content"] == texts.text([follow_up])
    # Without answers there is one user turn, as with canned outputs.
    assert texts.messages([first, follow_up]) == [{"role": "user",
                                                   "content": texts.text([first, follow_up])}]
    assert answer.tokens == 5 and answer.id != second.id


def test_token_literals_are_exact() -> None:
    prompts = TokenPrompts(salt=1, low=10, high=100)
    lit = prompts.literal([11, 12, 13])
    block = Block(7, 4)
    assert prompts.prompt([block, lit])[-3:] == [11, 12, 13]
    assert prompts.prompt([block, lit])[:4] == prompts.prompt([block])


def test_word_token_counts_make_lengths_exact() -> None:
    from agentload.replay.engine.prompts import WORDS

    # A tokenizer where short words are one token and longer ones two or three.
    counts = [1 if len(w) <= 3 else 2 if len(w) <= 6 else 3 for w in WORDS]
    cost = dict(zip(WORDS, counts, strict=True))
    texts = TextPrompts(salt=5, word_tokens=counts)
    blocks = [Block(i, n) for i, n in enumerate([64, 1, 2, 17, 63, 640], start=1)]
    for block in blocks:
        words = texts.text([block]).split()
        assert sum(cost[w] for w in words) == block.tokens
        assert any(cost[w] > 1 for w in words) or block.tokens < 4  # not only 1-token words
    whole = texts.text(blocks)
    assert sum(cost[w] for w in whole.split()) == sum(b.tokens for b in blocks)
    assert whole.startswith(texts.text(blocks[:2]) + " ")  # prompts extend
    assert TextPrompts(salt=5, word_tokens=counts).text(blocks) == whole
    assert TextPrompts(salt=6, word_tokens=counts).text(blocks) != whole
