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


def test_a_vocabulary_of_one_token_words_makes_lengths_exact() -> None:
    words = ("alpha", "beta", "gamma", "delta")
    texts = TextPrompts(salt=5, vocabulary=words)
    a, b = Block(1, 40), Block(2, 23)
    text = texts.text([a, b])
    # One word per token, drawn only from the vocabulary; equal blocks, equal text.
    assert len(text.split()) == 63 and set(text.split()) <= set(words)
    assert text.startswith(texts.text([a]) + " ")
    assert TextPrompts(salt=5, vocabulary=words).text([a]) == texts.text([a])
