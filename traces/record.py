"""``agentload record``: a recording proxy that turns a live agent's traffic into a trace.

Point a coding agent's OpenAI base URL at the proxy (``http://127.0.0.1:8100/v1``); it
forwards everything to ``--upstream`` unchanged and writes the agent's model calls to
``--output`` as a native trace: per request its prompt as block ids (chained hashes of
``--block-size``-token pieces), its input and output token counts, its timing, the
session it belongs to and the request it waited for. Text is kept only with
``--keep-content``; API keys are forwarded and never written.

The pieces: ``record_proxy`` (the pass-through and token counting), ``record_trace``
(sessions, dependencies, blocks, the atomically rewritten file) and ``record_bench``
(``agentload bench proxy``, the added-latency measurement).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import aiohttp
import orjson
import typer

from agentload.traces.errors import TraceError
from agentload.traces.headers import SESSION_HEADER
from agentload.traces.record_proxy import RecordingProxy
from agentload.traces.record_trace import Recorder

DEFAULT_LISTEN = "127.0.0.1:8100"
Say = Callable[[str], None]


def say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_upstream(url: str) -> str:
    """The upstream's base URL (no trailing slash or ``/v1``), or ``TraceError``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TraceError(f"--upstream must be an http(s) URL such as http://127.0.0.1:8000, "
                         f"got {url!r}")
    try:
        _ = parts.port
    except ValueError:
        raise TraceError(f"--upstream has an invalid port: {url!r}") from None
    if parts.query or parts.fragment:
        raise TraceError(f"--upstream must be a base URL without query or fragment: {url!r}")
    base = url.strip().rstrip("/")
    # Agents are configured with .../v1 and send /v1/... paths; the proxy adds the path.
    return base[: -len("/v1")] if base.endswith("/v1") else base


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (or a bare port, on 127.0.0.1) -> (host, port); ``TraceError`` if not."""
    text = value.strip()
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    else:
        host, sep, port_text = text.rpartition(":")
        host = host.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not sep or not host or not port_text.isdigit():
            raise TraceError(f"--listen must be HOST:PORT such as {DEFAULT_LISTEN}, "
                             f"got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise TraceError(f"--listen port must be 0-65535 (0 picks a free one), got {port}")
    return host, port


@dataclass(frozen=True, slots=True)
class RecordConfig:
    upstream: str
    host: str
    port: int
    output: Path
    session_header: str = SESSION_HEADER
    block_size: int = 64
    keep_content: bool = False
    force: bool = False


def _prepare_output(cfg: RecordConfig) -> Recorder:
    if cfg.output.exists() and not cfg.force:
        raise TraceError(f"{cfg.output} already exists; choose another --output or pass "
                         "--force to replace it")
    if cfg.output.is_dir():
        raise TraceError(f"--output {cfg.output} is a directory; give a file name "
                         "(.jsonl or .parquet)")
    recorder = Recorder(cfg.output, block_size=cfg.block_size)
    try:
        recorder.save()  # an empty, valid trace at once: the file is never missing or partial
    except OSError as exc:
        raise TraceError(f"cannot write {cfg.output}: {exc.strerror or exc}") from None
    return recorder


async def _upstream_models(proxy: RecordingProxy) -> str:
    """A short note on what the upstream serves, or why it does not answer (yet)."""
    try:
        async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3.0)) as client,
                    client.get(proxy.upstream + "/v1/models") as resp):
            if resp.status != 200:
                return f"upstream answered /v1/models with HTTP {resp.status}"
            obj = orjson.loads(await resp.read())
        models = [m["id"] for m in obj.get("data", []) if isinstance(m, dict) and "id" in m]
        return f"upstream serves {', '.join(models) or 'no models'}"
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError,
            AttributeError) as exc:
        reason = str(exc) or type(exc).__name__
        return f"warning: the upstream does not answer yet ({reason}); forwarding anyway"


async def _serve(cfg: RecordConfig, recorder: Recorder, say: Say) -> None:
    proxy = RecordingProxy(cfg.upstream, recorder, session_header=cfg.session_header,
                           keep_content=cfg.keep_content, say=say)
    try:
        await proxy.start(cfg.host, cfg.port)
    except OSError as exc:
        raise TraceError(f"cannot listen on {cfg.host}:{cfg.port}: "
                         f"{exc.strerror or exc}") from None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # Ctrl-C and SIGTERM end a recording normally: finish what is in flight, write.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        say(f"agentload record: listening on {proxy.url} (agents: base URL {proxy.url}/v1), "
            f"upstream {cfg.upstream}, writing {cfg.output}; Ctrl-C stops")
        say(await _upstream_models(proxy))
        await stop.wait()
        say("agentload record: stopping (finishing calls in flight)")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await proxy.close()


def run_recording(cfg: RecordConfig, say: Say = say_stderr) -> Recorder:
    """Record until SIGINT or SIGTERM; the trace at ``cfg.output`` is complete at return."""
    recorder = _prepare_output(cfg)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(_serve(cfg, recorder, say))
    except KeyboardInterrupt:
        pass  # a Ctrl-C that landed before the loop's own handler was in place
    finally:
        for sig, handler in previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(sig, handler)
    try:
        recorder.save()
    except OSError as exc:
        raise TraceError(f"cannot write {cfg.output}: {exc.strerror or exc}") from None
    return recorder


def summary_lines(recorder: Recorder) -> list[str]:
    c = recorder.counts
    lines = [f"recorded {recorder.num_requests} requests in {recorder.num_sessions} sessions "
             f"to {recorder.path}"]
    if recorder.num_requests:
        lines.append(f"  prompt lengths: {c['isl_exact']} exact (token ids), "
                     f"{c['isl_tokenize']} from /tokenize, {c['isl_usage']} from server usage, "
                     f"{c['isl_estimate']} estimated (4 characters a token)")
        lines.append(f"  output lengths: {c['osl_usage']} from server usage, "
                     f"{c['osl_tokenize']} re-tokenized, "
                     f"{c['osl_chunks'] + c['osl_estimate']} estimated (chunks or characters)")
    skipped = {k: v for k, v in sorted(c.items())
               if v and (k.startswith(("not_recorded_", "upstream_"))
                         or k in ("probes_skipped", "aborted"))}
    if skipped:
        lines.append("  not recorded: " + ", ".join(f"{v} {k.replace('_', ' ')}"
                                                    for k, v in skipped.items()))
    return lines


def record_command(
    upstream: Annotated[str, typer.Option(
        "--upstream", help="Base URL of the OpenAI-compatible server to forward to, e.g. "
        "http://127.0.0.1:8000 (a trailing /v1 is fine).", show_default=False)],
    output: Annotated[Path, typer.Option(
        "--output", "-o", help="Trace file to write: .jsonl, or .parquet for one request a "
        "row. Rewritten atomically after each recorded request.", show_default=False)],
    listen: Annotated[str, typer.Option(
        "--listen", help="HOST:PORT to listen on (port 0 picks a free one).")
    ] = DEFAULT_LISTEN,
    session_header: Annotated[str, typer.Option(
        "--session-header", help="Request header naming the session (any case); requests "
        "without it are grouped by prefix continuity.")] = SESSION_HEADER,
    block_size: Annotated[int, typer.Option(
        "--block-size", min=1, help="Tokens per prompt block (the hash granularity).")] = 64,
    keep_content: Annotated[bool, typer.Option(
        "--keep-content", help="Also store the prompts' text (chat messages or the "
        "completion prompt).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace --output if it exists.")] = False,
) -> None:
    """Record an agent's traffic through an OpenAI-compatible pass-through proxy.

    Point the agent at http://HOST:PORT/v1. Every request goes to --upstream
    unchanged, and the agent receives exactly what the upstream sent, streamed
    as it arrives. Successful POST /v1/completions and /v1/chat/completions
    calls are written to --output as a native trace; requests carrying the
    X-Agentload-Probe header are forwarded but not recorded.

    Recorded per request: its session (--session-header, else prefix
    continuity), the request it waited for and the pause after it, the prompt
    as block ids (chained hashes of --block-size-token pieces; token ids are
    exact, text and chat are counted by the upstream's /tokenize, else
    estimated at 4 characters a token), output tokens (server usage, else
    re-tokenized, else estimated), the model, and timing (send time, latency,
    TTFT).

    Not recorded: prompt or output text (unless --keep-content), API keys
    and other headers (they are forwarded, never written), sampling
    parameters, and requests that failed or were cut off.

    Ctrl-C or SIGTERM stops: calls in flight finish, the file is written and
    a summary printed.

    Example: agentload record --upstream http://127.0.0.1:8000 -o s.jsonl
    """
    host, port = parse_listen(listen)
    cfg = RecordConfig(upstream=check_upstream(upstream), host=host, port=port,
                       output=output, session_header=session_header.strip() or SESSION_HEADER,
                       block_size=block_size, keep_content=keep_content, force=force)
    recorder = run_recording(cfg)
    for line in summary_lines(recorder):
        say_stderr(line)

