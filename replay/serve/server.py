"""Start, health-check and stop a vLLM OpenAI server as a managed child process.

The server runs from an argv list (never a shell string) in its own process group, with
its output captured to a log file in the run directory. Stopping sends SIGINT to the
whole group (vLLM's API server, engine core and workers), waits, then SIGKILLs whatever
is left, so no engine process outlives agentload: not on normal exit, not on Ctrl-C,
not when start-up fails. Linux's parent-death signal covers agentload itself being
killed with ``kill -9``.

``embedded_server_spec`` describes the default target on machines without a GPU: real
vLLM's CPU build serving the tiny local Llama from ``tiny_model``.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from agentload.replay.errors import ServerError

DEFAULT_HOST = "127.0.0.1"
# vLLM's CPU KV blocks default to 128 tokens; agent traces hash 64-token blocks, and the
# server's prefix cache can only match what its own blocks align with.
EMBEDDED_BLOCK_SIZE = 64
EMBEDDED_MAX_MODEL_LEN = 16384

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """Everything needed to start one server and to describe it in a run's metadata."""

    argv: tuple[str, ...]
    host: str
    port: int
    served_model: str
    label: str
    env: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 1
    device: str = "gpu"
    vocab_size: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise ``ServerError`` naming the port if something already listens on it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ServerError(
                f"port {port} on {host} is already in use ({exc.strerror}); "
                "choose another with --port or leave it out to pick a free one"
            ) from None


def embedded_server_spec(
    port: int | None = None,
    host: str = DEFAULT_HOST,
    kv_cache_gib: float = 1.0,
    max_num_seqs: int = 64,
) -> ServerSpec:
    """The embedded CPU server: vLLM's CPU build serving the locally built tiny Llama."""
    # The embedded server is the built-in embedded arm; arms builds on this module.
    from agentload.replay.serve.arms import Arm, arm_server_spec

    arm = Arm("embedded", "built-in", {"embedded": True, "kv_cache_gib": kv_cache_gib,
                                       "max_num_seqs": max_num_seqs})
    return arm_server_spec(arm, host, port, label="embedded tiny Llama on vLLM CPU")


def embedded_env(kv_cache_gib: float = 1.0) -> dict[str, str]:
    """Environment of the embedded CPU server: its KV cache size, and nothing fetched."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        # Nothing may be fetched: the model is local and usage reporting stays off.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning",
    }


# vLLM's documented Nsight Systems set-up: follow the forked workers, trace CUDA graphs
# node by node (so replayed kernels can be attributed), and record only between
# cudaProfilerStart/Stop, which the server calls on POST /start_profile and /stop_profile.
NSYS_FLAGS = ("--trace=cuda,nvtx,osrt", "--trace-fork-before-exec=true",
              "--cuda-graph-trace=node")
NSYS_WINDOW_FLAGS = ("--capture-range=cudaProfilerApi", "--capture-range-end=repeat")


def nsys_wrap(spec: ServerSpec, output: Path, whole_run: bool = False) -> ServerSpec:
    """``spec`` run under ``nsys profile``, writing ``output`` (.nsys-rep).

    By default only the profiling windows are captured (``/start_profile`` ..
    ``/stop_profile``); vLLM captures its CUDA graphs at start-up, outside such a window,
    so ``whole_run`` records from process start when graph nodes must be mapped to layers.
    """
    flags = [*NSYS_FLAGS] if whole_run else [*NSYS_FLAGS, *NSYS_WINDOW_FLAGS]
    argv = ["nsys", "profile", "-o", str(output), "--force-overwrite=true", *flags,
            *spec.argv]
    if not whole_run:
        argv += ["--profiler-config", '{"profiler":"cuda"}']
    # vLLM's docs: with fork, nsys saw empty or partial profiles of the workers.
    env = {**spec.env, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    return replace(spec, argv=tuple(argv), env=env, label=spec.label + " under nsys")


_NON_DEFAULT = re.compile(r"non-default args: (\{.*\})\s*$")
_ENGINE_CONFIG = re.compile(r"Initializing a .*engine \((v[^)]*)\) with config: (.*)$")


def effective_config(log_path: Path) -> dict[str, Any]:
    """What the server says it runs with, from its start-up log.

    vLLM logs the arguments that differ from its defaults as a dict repr and its engine
    configuration as one line; both are kept (the dict parsed where it is literal).
    """
    found: dict[str, Any] = {}
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        if (m := _NON_DEFAULT.search(line)) and "non_default_args" not in found:
            try:
                found["non_default_args"] = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                found["non_default_args"] = m.group(1)
        elif (m := _ENGINE_CONFIG.search(line)) and "engine_config" not in found:
            found["engine_version"] = m.group(1)
            found["engine_config"] = m.group(2)[:8000]
    return found


def _set_parent_death_signal() -> None:
    """In the child, before exec: get SIGTERM if agentload dies (Linux only)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _child_setup(nice: int) -> Callable[[], None] | None:
    """What the server's process runs before exec: the parent-death signal (Linux) and,
    with ``nice`` > 0, a lower CPU priority that its processes and threads inherit."""
    linux = sys.platform == "linux"
    if not linux and nice <= 0:
        return None

    def setup() -> None:
        if linux:
            _set_parent_death_signal()
        if nice > 0:
            with contextlib.suppress(OSError):
                os.nice(nice)

    return setup


class ManagedServer:
    """A server process started from ``spec``; use as a context manager.

    ``start()`` returns once ``/health`` answers 200, raising ``ServerError`` with the
    last lines of the server log if the process exits or the timeout passes first.
    ``stop()`` is idempotent and always leaves no process of the group behind.
    """

    def __init__(
        self,
        spec: ServerSpec,
        log_path: Path,
        startup_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
        progress: Progress | None = None,
        nice: int = 0,
    ) -> None:
        self.spec = spec
        self.nice = nice
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._progress = progress
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> ManagedServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        check_port_free(self.spec.host, self.spec.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # No current directory on the server's sys.path (nor its subprocesses'): started
        # from a checkout, this repo's top-level kernels/ shadowed Hugging Face's package.
        env = {**os.environ, "PYTHONSAFEPATH": "1", **self.spec.env}
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    list(self.spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_child_setup(self.nice),
                )
            except OSError as exc:
                raise ServerError(f"cannot start {self.spec.argv[0]}: {exc.strerror}") from None
        self._wait_healthy(started)
        self.startup_s = time.monotonic() - started

    def _wait_healthy(self, started: float) -> None:
        assert self._proc is not None
        url = self.spec.base_url + "/health"
        last_report = 0.0
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                elapsed = time.monotonic() - started
                code = self._proc.poll()
                if code is not None:
                    raise ServerError(
                        f"{self.spec.label} exited with status {code} during start-up: "
                        f"{last_log_error(self.log_path)} (full log: {self.log_path})"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(url).status_code == 200:
                        self._report(f"{self.spec.label} ready on {self.spec.base_url} "
                                     f"after {elapsed:.0f} s")
                        return
                if elapsed > self.startup_timeout_s:
                    raise ServerError(
                        f"{self.spec.label} did not answer {url} within "
                        f"{self.startup_timeout_s:.0f} s (log: {self.log_path})"
                    )
                if elapsed - last_report >= 5.0:
                    last_report = elapsed
                    self._report(f"starting {self.spec.label} ... {elapsed:.0f} s "
                                 f"(log: {self.log_path})")
                time.sleep(0.5)

    def _report(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)

    def stop(self) -> int | None:
        """Stop the whole process group; return the server's exit status if it ran."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session makes the child its group's leader
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGINT)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                proc.wait()
        # Engine-core and worker processes may linger after the API server exits.
        _signal_group(pgid, signal.SIGKILL)
        return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def last_log_error(log_path: Path, max_chars: int = 300) -> str:
    """The most telling line of a server log: the last error-looking one, else the last."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return "no log was written"
    if not lines:
        return "the log is empty"
    markers = ("Error", "error:", "ERROR", "Exception", "Traceback", "refused")
    for line in reversed(lines):
        if any(m in line for m in markers) and not line.startswith("Traceback"):
            return line[-max_chars:]
    return lines[-1][-max_chars:]


@contextlib.contextmanager
def serving(
    spec: ServerSpec, log_path: Path, progress: Progress | None = None,
    startup_timeout_s: float = 600.0, nice: int = 0,
) -> Iterator[ManagedServer]:
    """``with serving(spec, log) as server:`` — started, healthy, and always stopped.

    ``nice`` > 0 runs the server (all its processes and threads) at that lower CPU
    priority: where it shares cores with the clients, they come first."""
    server = ManagedServer(spec, log_path, startup_timeout_s=startup_timeout_s,
                           progress=progress, nice=nice)
    with server:
        yield server
