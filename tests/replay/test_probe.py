"""Target probes (``replay/serve/probe.py``): chat word counts from a fake /tokenize."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from agentload.replay.engine.prompts import WORDS
from agentload.replay.serve.probe import calibrate_words
from agentload.replay.serve.server import free_port


def _serve(one_token: set[str]) -> Iterator[str]:
    """A /tokenize where ``one_token`` words are one token each and others three."""
    async def tokenize(request: web.Request) -> web.Response:
        text = (await request.json())["prompt"]
        return web.json_response({"count": sum(1 if w in one_token else 3
                                                for w in text.split())})

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    port = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


@pytest.mark.parametrize("ones", [40, 0])
def test_chat_words_carry_their_token_counts_when_the_target_can_count(ones: int) -> None:
    one_token = set(WORDS[:ones])
    for url in _serve(one_token):
        wpt, how, counts = calibrate_words(url, "m", None)
    if ones:
        assert counts == tuple(1 if w in one_token else 3 for w in WORDS)
        assert "each word's tokens counted, 3200-token sample = 3200 tokens" in how
        assert 1 / 3 < wpt < 1  # the text's own words per token, for the record
    else:  # no one-token word to end a block with: words per token, as measured
        assert counts is None and wpt == pytest.approx(1 / 3)
        assert "words =" in how
