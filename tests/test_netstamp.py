"""The stamped transport: chunked bodies split anywhere, kernel stamps, stale keep-alives."""

from __future__ import annotations

import asyncio

import httpx

from agentload.replay.netstamp import StampedTransport, kernel_stamps_work, stamps_of


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


def test_queued_reads_come_as_one_item_and_keep_their_own_stamps() -> None:
    """A woken body hands over every queued read at once; each event keeps its read's stamp."""
    from agentload.replay.client import stream_completion

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
            # Wake-ups after the first body read are batched: some item held several reads.
            assert max(batches) > 1 and sum(batches) >= 6
            res = await stream_completion(client, url, b"{}")
        assert res.ok and res.chunks == 6
        # Every event has its own stamp, in order, about 5 ms apart (not one per item).
        gaps = [b - a for a, b in zip(res.chunk_ns, res.chunk_ns[1:], strict=False)]
        assert all(g > 1_000_000 for g in gaps), gaps
        assert res.reads == 6 and res.multi_event_reads == 0

    asyncio.run(main())
