"""The stamped transport: chunked bodies split anywhere, kernel stamps, stale keep-alives."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from agentload.replay.client.netstamp import StampedTransport, kernel_stamps_work, stamps_of
from agentload.replay.client.sse import LATE_READ_NS, StreamResult, stream_completion


async def _server(handler: object) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    return server, server.sockets[0].getsockname()[1]


def test_chunked_body_split_at_every_byte_keeps_stamps() -> None:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"data: a\n\n", b"data: bb\n\n"))
    wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for i in range(len(wire)):  # one byte a write: every split the decoder can meet
            writer.write(wire[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.0005)
        writer.close()

    async def main() -> None:
        server, port = await _server(handler)
        async with server, httpx.AsyncClient(transport=StampedTransport()) as client:
            async with client.stream("GET", f"http://127.0.0.1:{port}/") as resp:
                got, kernels = b"", []
                async for raw in resp.aiter_raw():
                    got += raw
                    st = stamps_of(resp)
                    assert st is not None
                    kernels.append(st.kernel_ns)
                    if st.kernel_ns is not None:
                        # The kernel got the bytes before the loop served the socket.
                        assert st.kernel_ns <= st.user_ns + 100_000
            assert got == b"data: a\n\ndata: bb\n\n"
            if kernel_stamps_work():
                assert all(k is not None for k in kernels)

    asyncio.run(main())


def test_a_stale_keep_alive_connection_is_not_a_failure() -> None:
    """The server closes idle connections; the next request must still succeed."""
    count = {"n": 0}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        count["n"] += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # keep-alive advertised, then closed while idle

    async def main() -> None:
        server, port = await _server(handler)
        async with server, httpx.AsyncClient(transport=StampedTransport()) as client:
            for _ in range(3):
                resp = await client.get(f"http://127.0.0.1:{port}/")
                assert resp.status_code == 200 and resp.text == "ok"
                await asyncio.sleep(0.1)
        assert count["n"] == 3

    asyncio.run(main())


def test_refused_and_stall_map_to_httpx_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(2)
        writer.close()

    async def main() -> None:
        server, port = await _server(silent)
        async with server, httpx.AsyncClient(transport=StampedTransport(),
                                             timeout=httpx.Timeout(0.2)) as client:
            try:
                await client.get(f"http://127.0.0.1:{port}/")
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("no ReadTimeout")
        try:
            async with httpx.AsyncClient(transport=StampedTransport()) as client:
                await client.get(f"http://127.0.0.1:{port}/")
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("no ConnectError")

    asyncio.run(main())


@pytest.mark.parametrize("min_streams", [1, 64])
def test_queued_reads_come_as_one_item_and_keep_their_own_stamps(
        min_streams: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A woken body hands over every queued read at once; each event keeps its read's stamp.
    Wake-ups are batched only while ``LAZY_MIN_STREAMS`` bodies stream (1 here: this one);
    below that (64, the default) every read wakes the body on its own."""
    from agentload.replay.client import netstamp
    from agentload.replay.client.sse import stream_completion

    monkeypatch.setattr(netstamp, "LAZY_MIN_STREAMS", min_streams)

    def chunk(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    events = [b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(6)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: every request on the connection
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            if b"content-length: 2" in head.lower():
                await reader.readexactly(2)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for ev in events:  # one event a write, 5 ms apart: one read each
                await asyncio.sleep(0.005)
                writer.write(chunk(ev))
                await writer.drain()
            await asyncio.sleep(0.005)
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        server, port = await _server(handler)
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with server, httpx.AsyncClient(transport=StampedTransport()) as client:
            batches = []
            async with client.stream("POST", url, content=b"{}") as resp:
                async for raw in resp.aiter_raw():
                    st = stamps_of(resp)
                    assert st is not None and st.batch
                    assert st.batch[-1][0] == len(raw)  # the offsets cover the item
                    batches.append(len(st.batch))
            if min_streams == 1:
                # Wake-ups after the first body read are batched: an item held several reads.
                assert max(batches) > 1 and sum(batches) >= 6
            else:  # one stream: no batching, one read an item
                assert set(batches) == {1} and sum(batches) >= 6
            res = await stream_completion(client, url, b"{}")
        assert res.ok and res.chunks == 6
        # Every event has its own stamp, in order, about 5 ms apart (not one per item).
        gaps = [b - a for a, b in zip(res.chunk_ns, res.chunk_ns[1:], strict=False)]
        assert all(g > 1_000_000 for g in gaps), gaps
        assert res.reads == 6 and res.multi_event_reads == 0

    asyncio.run(main())


def _scripted(writes: list[bytes], end: bool = True) -> object:
    """A server answering each request with ``writes`` (chunked), 5 ms apart; ``end=False``
    closes the connection mid-body instead of ending it."""
    def chunk(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for w in writes:
            await asyncio.sleep(0.005)
            writer.write(chunk(w))
            await writer.drain()
        if end:
            writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        else:
            await asyncio.sleep(0.005)
        writer.close()

    return handler


def _play(writes: list[bytes], end: bool = True, **kw: bool) -> StreamResult:
    async def main() -> StreamResult:
        server, port = await _server(_scripted(writes, end))
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with server, httpx.AsyncClient(transport=StampedTransport()) as client:
            return await stream_completion(client, url, b"{}", **kw)

    return asyncio.run(main())


def _ev(i: int, extra: bytes = b"") -> bytes:
    return b'data: {"choices":[{"index":0,"text":"t%d"%s}],"t_emit_ns":%d}\n\n' % (
        i, extra, 1000 + i)


def test_events_kept_raw_and_parsed_later_keep_order_stamps_and_read_counts() -> None:
    """After the first token, one-event reads are kept raw and parsed at the end; a read
    of two events counts as one read of two, sharing its stamp; the usage applies."""
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":7}}\n\n'
    writes = [_ev(0), _ev(1, b',"token_ids":[5,6]'), _ev(2), _ev(3), _ev(4) + _ev(5),
              _ev(6) + usage]
    res = _play(writes, collect_emit_ns=True, collect_token_ids=True)
    assert res.ok and res.error is None
    assert res.chunks == 7 and res.client_tokens == 8
    assert res.output_ids == [5, 6]
    assert res.chunk_emit_ns == [1000 + i for i in range(7)]
    assert (res.prompt_tokens, res.completion_tokens) == (7, 7)
    ns = res.chunk_ns
    assert ns == sorted(ns) and ns[5] == ns[4]  # the two-event read shares one stamp
    assert all(b - a > 1_000_000 for a, b in itertools.pairwise(ns[:5]))
    # The two came in one write: read within LATE_READ_NS of it they were sent together,
    # not waited for (a loaded machine may serve the read later: then it counts).
    late = res.chunk_user_ns is None or res.chunk_user_ns[5] - ns[5] > LATE_READ_NS
    assert res.reads == 6 and res.multi_event_reads == int(late)
    assert res.max_events_per_read == 2


@pytest.mark.skipif(not kernel_stamps_work(), reason="needs SO_TIMESTAMPNS on loopback")
def test_events_that_waited_for_a_late_client_count_as_it_being_behind() -> None:
    """Two events written apart, read together 20 ms later (the loop was blocked): the
    read was late, so it counts as the client behind; its stamp is the later segment's."""
    import time

    def chunk(payload: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(payload), payload)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(3):
            await asyncio.sleep(0.005)
            writer.write(chunk(_ev(i)))
            await writer.drain()
        await asyncio.sleep(0.005)
        for i in (3, 4):  # two segments, then the whole loop (the client too) blocked
            writer.write(chunk(_ev(i)))
            await writer.drain()
        time.sleep(0.02)
        await asyncio.sleep(0.005)
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> StreamResult:
        server, port = await _server(handler)
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with server, httpx.AsyncClient(transport=StampedTransport()) as client:
            return await stream_completion(client, url, b"{}")

    res = asyncio.run(main())
    assert res.ok and res.chunks == 5
    assert res.multi_event_reads >= 1 and res.max_events_per_read >= 2
    assert res.chunk_ns[3] == res.chunk_ns[4]
    assert res.chunk_user_ns is not None
    assert res.chunk_user_ns[4] - res.chunk_ns[4] > 15_000_000  # the read's lateness


def test_an_error_event_after_kept_events_counts_them_and_fails() -> None:
    writes = [_ev(0), _ev(1), _ev(2), b'data: {"error":{"message":"engine died"}}\n\n']
    res = _play(writes)
    assert not res.ok and res.error_kind == "server_error"
    assert "engine died" in (res.error or "") and res.chunks == 3


def test_a_cut_stream_still_counts_the_kept_events() -> None:
    res = _play([_ev(0), _ev(1), _ev(2), _ev(3)], end=False)
    assert res.error_kind == "cut" and res.chunks == 4


def test_a_malformed_kept_event_is_named() -> None:
    res = _play([_ev(0), _ev(1), b"data: {not json}\n\n", _ev(3)])
    assert res.error_kind == "malformed" and "not json" in (res.error or "")
    assert res.chunks == 2


def test_an_empty_body_returns_its_connection_once() -> None:
    """vLLM's /start_profile answers 200 with no body. Its connection went back to the idle
    list twice (at the head, and again when the body was read), so two later streams
    shared one socket and one of them waited for ever: seen on an H100 as a request in
    flight for 300 s with no stall reported."""
    from aiohttp import web

    from agentload.replay.serve.server import free_port

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(10):
            await resp.write(b'data: {"choices":[{"text":"x"}]}\n\n')
            await asyncio.sleep(0.005)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def main() -> list[StreamResult]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/start_profile", empty)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        transport = StampedTransport()
        try:
            async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
                assert (await client.post(base + "/start_profile")).status_code == 200
                assert [len(v) for v in transport._idle.values()] == [1]
                return list(await asyncio.gather(*(
                    stream_completion(client, base + "/v1/completions",
                                      {"prompt": [1], "max_tokens": 10, "stream": True},
                                      total_timeout_s=5.0) for _ in range(3))))
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    assert [(r.error, r.chunks) for r in results] == [(None, 10)] * 3
