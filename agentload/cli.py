"""The ``agentload`` command: the front door that mounts each room's own sub-app.

Any ``AgentloadError`` becomes one line on stderr and exit status 2 (no traceback);
Ctrl-C and SIGTERM unwind normally, so servers agentload started are stopped and runs
are finalized on the way out.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import click
import typer

import agentload._hugepages  # noqa: F401  (first: polars' allocator reads it on import)
from agentload import AgentloadError, __version__
from agentload.kernels.cli import ceilings_command, kernels_command
from agentload.profiler.bench import profiler_speed
from agentload.profiler.cli import app as profile_app
from agentload.replay.bench.cli import (
    agree_command,
    client_command,
    emulator_command,
    replay_fidelity,
)
from agentload.replay.cli import app as replay_app
from agentload.replay.export_cli import register as register_export
from agentload.replay.serve.gpu_bundle import bundle_command
from agentload.traces.bench import import_speed
from agentload.traces.cli import app as traces_app
from agentload.traces.record import record_command
from agentload.traces.record_bench import bench_proxy_command
from agentload.tui.bench import dashboard_bench
from agentload.tui.cli import dashboard as dashboard_command
from agentload.tui.cli import register as register_dashboard

app = typer.Typer(
    name="agentload",
    no_args_is_help=True,
    add_completion=False,
    help="Replay agentic LLM traffic against vLLM and measure what each user experiences.",
)
app.add_typer(replay_app)  # serve, replay, demo at the top level
app.add_typer(traces_app, name="traces")
# Export fits traces as replay does, so the replay room supplies it (traces cannot).
register_export(traces_app)
app.add_typer(profile_app, name="profile")
app.command("record")(record_command)
app.command("dashboard")(dashboard_command)
gpu_app = typer.Typer(no_args_is_help=True, help="Bring real vLLM and agentload to a GPU box.")
app.add_typer(gpu_app, name="gpu")
gpu_app.command("bundle")(bundle_command)
# Replays on a terminal open the dashboard (agentload.tui), which replay cannot import.
register_dashboard()

# Benchmarks from every room, under one roof: ``agentload bench NAME``.
bench_app = typer.Typer(no_args_is_help=True,
                        help="Benchmarks that print side-by-side measurements.")
app.add_typer(bench_app, name="bench")
bench_app.command("proxy")(bench_proxy_command)
bench_app.command("import")(import_speed)
bench_app.command("replay")(replay_fidelity)
bench_app.command("profiler")(profiler_speed)
bench_app.command("emulator", help="Run the loopback SSE emulator: test equipment for "
                  "measuring clients, never a server under test.")(emulator_command)
bench_app.command("client")(client_command)
bench_app.command("agree")(agree_command)
bench_app.command("dashboard")(dashboard_bench)
bench_app.command("ceilings")(ceilings_command)
bench_app.command("kernels")(kernels_command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"agentload {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Replay agentic LLM traffic against vLLM and measure what each user experiences."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    signal.signal(signal.SIGTERM, _terminate)
    try:
        # Without standalone mode click returns (not raises) the code of a typer.Exit.
        code = app(args=argv, prog_name="agentload", standalone_mode=False)
    except AgentloadError as exc:
        print(f"agentload: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:
        # typer vendors click: its usage errors (a bad or missing parameter) are not
        # click.ClickException, but show themselves the same way.
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(exc, "exit_code", 2))
    except (KeyboardInterrupt, click.exceptions.Abort):
        print("agentload: interrupted", file=sys.stderr)
        sys.exit(130)
    if isinstance(code, int) and code:
        sys.exit(code)
