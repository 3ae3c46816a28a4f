"""A loopback OpenAI-compatible SSE emulator: test equipment for measuring the client.

It is not a server to benchmark and never a default target. It answers
``/v1/completions`` and ``/v1/chat/completions`` (streaming or not), ``/v1/models``,
``/health``, ``/version``, ``/tokenize``, ``/detokenize`` and ``/metrics`` well enough
for agentload and ``vllm bench serve`` to talk to it, and it emits tokens the way vLLM
does: one global engine step every ``itl`` (plus optional seeded jitter), and at every
step one SSE event for *every* running stream, so N sockets become readable at once.
A request joins the batch at the first step at least ``ttft`` after it arrived.

Every token event carries ``"t_emit_ns"``: ``time.perf_counter_ns()`` (CLOCK_MONOTONIC,
comparable with the client's stamps in any process on this host) taken just before the
write, the ground truth the client benchmark compares agentload's stamps with. The first
event also carries ``"t_arrive_ns"``, when the request's body was complete, so an
emission-derived TTFT can be computed. The emulator logs its own emission schedule
(intended vs actual step times) and samples its own CPU every second; ``stats()`` (and
``GET /_emulator/stats``) say whether it was ever near saturation, in which case a
client measurement against it is not valid.

Run it with ``agentload bench emulator`` or ``python -m agentload.replay.bench.emulator``.
Plain asyncio protocols (uvloop when installed), hand-written HTTP/1.1 with chunked
encoding, and a pre-built byte template per stream keep it cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any

import orjson

EMULATOR_MODEL = "agentload-emulator"
EMULATOR_NAME = "agentload-emulator (test equipment, not a server under test)"
# The emulator is near saturation (so a client measured against it is not valid)
# when it used more than this share of one core in any one-second sample.
MAX_EMULATOR_CPU = 0.85


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """The emulator's schedule. Times in milliseconds."""

    host: str = "127.0.0.1"
    port: int = 8100
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    jitter_ms: float = 0.0
    tokens_per_event: int = 1
    model: str = EMULATOR_MODEL
    max_model_len: int = 1 << 20
    seed: int = 0
    # Busy-wait this long before each step: loop timers are only ~1 ms exact.
    spin_us: float = 300.0
    vocab: int = 32000
    # Several emulator processes may share one port (SO_REUSEPORT: the kernel spreads the
    # connections), each answering its own stats on its own control port.
    reuse_port: bool = False
    control_port: int | None = None


_HEAD_OK = (b"HTTP/1.1 200 OK\r\nserver: agentload-emulator\r\n"
            b"content-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def _plain(status: int, body: bytes, ctype: bytes = b"application/json",
           close: bool = False) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found",
              405: b"Method Not Allowed"}.get(status, b"Error")
    conn = b"connection: close\r\n" if close else b""
    return (b"HTTP/1.1 %d %s\r\nserver: agentload-emulator\r\ncontent-type: %s\r\n"
            b"content-length: %d\r\n%s\r\n" % (status, reason, ctype, len(body), conn)) + body


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class _Stream:
    """One running request: its byte templates and how many tokens are left."""

    __slots__ = (
        "arrive_ns",
        "chat",
        "first",
        "head",
        "include_usage",
        "left",
        "mid",
        "ok_tail",
        "prompt_tokens",
        "proto",
        "sent",
        "seq",
        "stream",
        "token_ids",
        "total",
    )

    def __init__(self, proto: _Conn, seq: int, chat: bool, total: int, prompt_tokens: int,
                 include_usage: bool, stream: bool, token_ids: bool, model: str,
                 arrive_ns: int) -> None:
        self.proto, self.seq, self.chat, self.total = proto, seq, chat, total
        self.left, self.sent, self.first = total, 0, True
        self.prompt_tokens, self.include_usage, self.stream = prompt_tokens, include_usage, stream
        self.token_ids, self.arrive_ns = token_ids, arrive_ns
        created = int(time.time())
        if chat:
            self.head = (b'data: {"id":"chatcmpl-emu-%d","object":"chat.completion.chunk",'
                         b'"created":%d,"model":"%s","choices":[{"index":0,"delta":{'
                         % (seq, created, model.encode()))
        else:
            self.head = (b'data: {"id":"cmpl-emu-%d","object":"text_completion",'
                         b'"created":%d,"model":"%s","choices":[{"index":0,'
                         % (seq, created, model.encode()))
        self.ok_tail = b""
        self.mid = b""  # a middle event up to its t_emit_ns value (built at first use)


class Emulator:
    """The step engine and its books; one per process."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.itl_ns = int(config.itl_ms * 1e6)
        self.ttft_ns = int(config.ttft_ms * 1e6)
        self.jitter_ns = int(config.jitter_ms * 1e6)
        self.spin_ns = int(config.spin_us * 1e3)
        self.rng = random.Random(config.seed)
        self.pending: list[tuple[int, _Stream]] = []  # (ready_ns, stream), arrival order
        self.running: list[_Stream] = []
        self.seq = 0
        self.events = 0
        self.tokens = 0
        self.requests = 0
        self.steps = 0
        self.max_running = 0
        # Per step: intended and actual start, and how long writing the step took (ns).
        self.step_intended = array("q")
        self.step_actual = array("q")
        self.step_write = array("q")
        self.cpu_samples: list[float] = []
        self.started_ns = time.perf_counter_ns()
        self._task: asyncio.Task[None] | None = None
        self._cpu_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.model_bytes = config.model.encode()

    # -- the engine ----------------------------------------------------------------------

    def admit(self, stream: _Stream) -> None:
        self.requests += 1
        self.pending.append((stream.arrive_ns + self.ttft_ns, stream))
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._steps())
        self._cpu_task = asyncio.get_running_loop().create_task(self._cpu())

    async def stop(self) -> None:
        for task in (self._task, self._cpu_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _cpu(self) -> None:
        last_w, last_c = time.perf_counter(), time.process_time()
        while True:
            await asyncio.sleep(1.0)
            w, c = time.perf_counter(), time.process_time()
            # Only seconds with work count: an idle emulator says nothing about headroom.
            if self.running or self.pending:
                self.cpu_samples.append((c - last_c) / max(w - last_w, 1e-9))
            last_w, last_c = w, c

    async def _steps(self) -> None:
        perf = time.perf_counter_ns
        origin = perf()
        k = 0
        while True:
            if not self.running and not self.pending:
                self._wake.clear()
                await self._wake.wait()
                # A fresh schedule starts at the next whole step after the idle gap.
                now = perf()
                k = max(k, (now - origin) // self.itl_ns + 1)
            k += 1
            jitter = 0
            if self.jitter_ns:
                limit = 0.7 * self.itl_ns
                jitter = int(max(-limit, min(limit, self.rng.gauss(0.0, self.jitter_ns))))
            intended = origin + k * self.itl_ns + jitter
            now = perf()
            if intended - now > self.spin_ns:
                await asyncio.sleep((intended - now - self.spin_ns) / 1e9)
            while perf() < intended:
                pass
            actual = perf()
            self._step(actual)
            done = perf()
            self.step_intended.append(intended)
            self.step_actual.append(actual)
            self.step_write.append(done - actual)
            self.steps += 1
            if done - origin > (k + 1) * self.itl_ns:
                # An overrun step: skip the ticks it covered instead of bunching up.
                k = (done - origin) // self.itl_ns
            await asyncio.sleep(0)

    def _step(self, now: int) -> None:
        if self.pending:
            keep = []
            for ready, stream in self.pending:
                if ready <= now:
                    self.running.append(stream)
                else:
                    keep.append((ready, stream))
            self.pending = keep
        if not self.running:
            return
        perf = time.perf_counter_ns
        tpe = self.config.tokens_per_event
        still = []
        for s in self.running:
            proto = s.proto
            if proto.closed:
                continue
            n = tpe if s.left > tpe else s.left
            s.left -= n
            last = s.left == 0
            if s.mid and not last:
                # The usual event (neither first nor last, no token ids): one prebuilt
                # prefix, the emission stamp, one write.
                s.sent += n
                ts = b"%d" % perf()
                proto.write(b"%x\r\n%s%s}\n\n\r\n" % (len(s.mid) + len(ts) + 3, s.mid, ts))
                still.append(s)
                self.events += 1
                self.tokens += n
                continue
            if not s.stream:
                s.sent += n
                if last:
                    proto.finish_plain(s, perf())
                else:
                    still.append(s)
                continue
            text = b" x" * n
            ids = b',"token_ids":[%s]' % b",".join(b"%d" % ((s.sent + i) % 997 + 16)
                                                  for i in range(n)) if s.token_ids else b""
            fin = b'"length"' if last else b"null"
            if s.chat:
                role = b'"role":"assistant",' if s.first else b""
                body = b'%s%s"content":"%s"}%s,"finish_reason":%s}]' % (s.head, role, text,
                                                                        ids, fin)
            else:
                body = b'%s"text":"%s","logprobs":null%s,"finish_reason":%s}]' % (
                    s.head, text, ids, fin)
            arrive = b',"t_arrive_ns":%d' % s.arrive_ns if s.first else b""
            if not s.first and not s.token_ids and not last and n == tpe:
                s.mid = b'%s,"t_emit_ns":' % body
            s.first = False
            s.sent += n
            t = perf()
            payload = b'%s%s,"t_emit_ns":%d}\n\n' % (body, arrive, t)
            if last:
                tail = b""
                if s.include_usage:
                    tail = _chunk(b'data: {"id":"emu-%d","object":"%s","created":0,"model":'
                                  b'"%s","choices":[],"usage":{"prompt_tokens":%d,'
                                  b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
                                      s.seq, b"chat.completion.chunk" if s.chat
                                      else b"text_completion", self.model_bytes,
                                      s.prompt_tokens, s.total, s.prompt_tokens + s.total))
                proto.write(_chunk(payload) + tail + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                proto.stream_done()
            else:
                proto.write(_chunk(payload))
                still.append(s)
            self.events += 1
            self.tokens += n
        self.running = still
        if len(still) > self.max_running:
            self.max_running = len(still)

    # -- books ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Emission schedule accuracy, throughput and own CPU, for the client benchmark."""
        lag = [a - i for a, i in zip(self.step_actual, self.step_intended, strict=True)]
        lag.sort()
        writes = sorted(self.step_write)

        def q(values: list[int], p: float) -> float | None:
            if not values:
                return None
            return values[min(len(values) - 1, int(p * len(values)))] / 1e6

        cpu_max = max(self.cpu_samples) if self.cpu_samples else None
        cpu_mean = (sum(self.cpu_samples) / len(self.cpu_samples)) if self.cpu_samples else None
        saturated = cpu_max is not None and cpu_max > MAX_EMULATOR_CPU
        return {
            "name": EMULATOR_NAME,
            "config": asdict(self.config),
            "pid": os.getpid(),
            "requests": self.requests,
            "events": self.events,
            "tokens": self.tokens,
            "steps": self.steps,
            "max_running_streams": self.max_running,
            "step_lag_p50_ms": q(lag, 0.5),
            "step_lag_p99_ms": q(lag, 0.99),
            "step_lag_max_ms": (lag[-1] / 1e6) if lag else None,
            "step_write_p50_ms": q(writes, 0.5),
            "step_write_p99_ms": q(writes, 0.99),
            "cpu_mean": cpu_mean,
            "cpu_max": cpu_max,
            "cpu_samples": len(self.cpu_samples),
            "saturated": saturated,
            "verdict": ("saturated: the emulator used more than "
                        f"{MAX_EMULATOR_CPU:.0%} of a core; client figures are not valid"
                        if saturated else "ok"),
        }

    def reset_stats(self) -> None:
        self.events = self.tokens = self.requests = self.steps = self.max_running = 0
        self.step_intended, self.step_actual, self.step_write = (array("q"), array("q"),
                                                                 array("q"))
        self.cpu_samples = []


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):
            return len(prompt[0])
        if prompt and isinstance(prompt[0], str):
            return sum(len(p.split()) for p in prompt)
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt.split())
    return 0


class _Conn(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection."""

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def stream_done(self) -> None:
        self.busy = False
        if self.buf:
            self._parse()

    def finish_plain(self, s: _Stream, now: int) -> None:
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant",
                                                           "content": " x" * s.total},
                                   "finish_reason": "length"} if s.chat else
                                  {"index": 0, "text": " x" * s.total, "finish_reason": "length"})
        body = orjson.dumps({
            "id": f"emu-{s.seq}", "object": "chat.completion" if s.chat else "text_completion",
            "created": int(time.time()), "model": self.emu.config.model, "choices": [choice],
            "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.total,
                      "total_tokens": s.prompt_tokens + s.total},
            "t_arrive_ns": s.arrive_ns, "t_emit_ns": now})
        self.write(_plain(200, body))
        self.stream_done()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._parse()

    def _parse(self) -> None:
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, path, _ = lines[0].split(" ", 2)
            except ValueError:
                self.write(_plain(400, b'{"error":"bad request line"}', close=True))
                self._close()
                return
            length = 0
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip() or 0)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self.write(_plain(400, b'{"error":"chunked request bodies unsupported"}',
                                      close=True))
                    self._close()
                    return
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            self._route(method, path.split("?", 1)[0], body, time.perf_counter_ns())
            if close and not self.busy:
                self._close()
                return

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def _json(self, obj: Any, status: int = 200) -> None:
        self.write(_plain(status, orjson.dumps(obj)))

    def _route(self, method: str, path: str, body: bytes, arrive_ns: int) -> None:
        cfg = self.emu.config
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                self._json({"error": "use POST"}, 405)
                return
            try:
                req = orjson.loads(body)
                if not isinstance(req, dict):
                    raise TypeError
            except (orjson.JSONDecodeError, TypeError):
                self._json({"error": {"message": "body is not a JSON object"}}, 400)
                return
            chat = path.endswith("chat/completions")
            if chat:
                msgs = req.get("messages") or []
                prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in msgs
                                    if isinstance(m, dict))
            else:
                prompt_tokens = _prompt_tokens(req.get("prompt"))
            total = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
            if total < 1:
                self._json({"error": {"message": "max_tokens must be at least 1"}}, 400)
                return
            opts = req.get("stream_options") or {}
            self.emu.seq += 1
            stream = _Stream(self, self.emu.seq, chat, total, prompt_tokens,
                             bool(opts.get("include_usage")), bool(req.get("stream")),
                             bool(req.get("return_token_ids")), cfg.model, arrive_ns)
            self.busy = True
            if stream.stream:
                self.write(_HEAD_OK)
            self.emu.admit(stream)
        elif path == "/health":
            self.write(_plain(200, b""))
        elif path == "/version":
            self._json({"version": EMULATOR_NAME})
        elif path == "/v1/models":
            self._json({"object": "list", "data": [{
                "id": cfg.model, "object": "model", "owned_by": "agentload-emulator",
                "root": cfg.model, "max_model_len": cfg.max_model_len}]})
        elif path == "/tokenize":
            try:
                req = orjson.loads(body)
            except orjson.JSONDecodeError:
                self._json({"error": "bad JSON"}, 400)
                return
            prompt = req.get("prompt")
            if prompt is None and req.get("messages"):
                prompt = " ".join(str(m.get("content", "")) for m in req["messages"])
            words = prompt.split() if isinstance(prompt, str) else list(prompt or [])
            tokens = [w if isinstance(w, int) else (hash(w) % (cfg.vocab - 16)) + 16
                      for w in words]
            self._json({"count": len(tokens), "tokens": tokens,
                        "max_model_len": cfg.max_model_len})
        elif path == "/detokenize":
            req = orjson.loads(body or b"{}")
            self._json({"prompt": " ".join(f"w{t}" for t in req.get("tokens") or [])})
        elif path == "/metrics":
            self.write(_plain(200, b"# agentload emulator: no vLLM metrics\n",
                              b"text/plain; version=0.0.4"))
        elif path == "/_emulator/stats":
            self._json(self.emu.stats())
        elif path == "/_emulator/reset":
            self.emu.reset_stats()
            self._json({"reset": True})
        else:
            self._json({"error": f"no route {path}"}, 404)


def install_uvloop() -> str:
    """Use uvloop's event loop when it is installed; returns which loop runs."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def serve(config: EmulatorConfig, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Serve until ``stop`` is set (or the task is cancelled); return the final stats."""
    emu = Emulator(config)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(emu), config.host, config.port,
                                      backlog=4096, reuse_address=True,
                                      reuse_port=config.reuse_port or None)
    servers = [server]
    if config.control_port is not None:
        servers.append(await loop.create_server(lambda: _Conn(emu), config.host,
                                                config.control_port, reuse_address=True))
    emu.start()
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    try:
        await stop.wait()
    finally:
        for one in servers:
            one.close()
        await emu.stop()
    return emu.stats()


def main(argv: list[str] | None = None) -> None:
    """``python -m agentload.replay.bench.emulator``: serve until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="agentload-emulator", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--tokens-per-event", type=int, default=1)
    p.add_argument("--model", default=EMULATOR_MODEL)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spin-us", type=float, default=300.0)
    p.add_argument("--stats", default=None, help="Write the final stats JSON here on exit.")
    p.add_argument("--cpu", type=int, default=None, help="Pin to this CPU.")
    p.add_argument("--reuse-port", action="store_true",
                   help="Share --port with other emulator processes (SO_REUSEPORT).")
    p.add_argument("--control-port", type=int, default=None,
                   help="Also answer on this port, so this process's own /_emulator/stats "
                        "can be asked for when several share --port.")
    p.add_argument("--nice", type=int, default=0,
                   help="Scheduling priority change (negative: ahead of the client, so the "
                        "schedule holds on a shared machine; needs privileges).")
    a = p.parse_args(argv)
    if a.itl_ms <= 0 or a.tokens_per_event < 1 or a.ttft_ms < 0:
        p.error("--itl-ms must be > 0, --ttft-ms >= 0, --tokens-per-event >= 1")
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    if a.nice:
        with contextlib.suppress(OSError):
            os.nice(a.nice)
    cfg = EmulatorConfig(host=a.host, port=a.port, ttft_ms=a.ttft_ms, itl_ms=a.itl_ms,
                         jitter_ms=a.jitter_ms, tokens_per_event=a.tokens_per_event,
                         model=a.model, seed=a.seed, spin_us=a.spin_us,
                         reuse_port=a.reuse_port, control_port=a.control_port)
    loop_name = install_uvloop()
    import gc
    gc.collect()
    gc.freeze()

    async def run() -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        ready = asyncio.Event()
        task = asyncio.create_task(serve(cfg, ready, stop))
        await ready.wait()
        print(f"{EMULATOR_NAME} on http://{cfg.host}:{cfg.port} ({loop_name}): TTFT "
              f"{cfg.ttft_ms:g} ms, ITL {cfg.itl_ms:g} ms, jitter {cfg.jitter_ms:g} ms, "
              f"{cfg.tokens_per_event} token(s) per event", flush=True)
        return await task

    stats = asyncio.run(run())
    if a.stats:
        with open(a.stats, "w") as fh:
            json.dump(stats, fh, indent=2)
    print(json.dumps({k: v for k, v in stats.items() if k != "config"}), file=sys.stderr)


if __name__ == "__main__":
    main()


__all__ = ["EMULATOR_MODEL", "EMULATOR_NAME", "EmulatorConfig", "install_uvloop", "main",
           "serve"]
