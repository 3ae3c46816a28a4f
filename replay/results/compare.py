"""``agentload compare``: the same workload against each arm in turn, then a comparison.

Every arm gets the same trace, seed, users, duration and cache salt (so the prompts are
byte-identical); its server is started, replayed against and stopped before the next
arm's starts. Arms of different GPU counts are refused unless the user allows it. All
arms' GPU checks run before any server starts, so a bad arm fails the comparison at once
rather than after an hour of the others.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentload.replay.errors import ReplayError
from agentload.replay.results.compare_report import write_comparison
from agentload.replay.results.finalize import RunResult
from agentload.replay.run import run_replay
from agentload.replay.serve.arms import (
    Arm,
    ArmError,
    check_gpu_count,
    check_same_gpus,
    load_arms,
    serve_argv,
)


@dataclass(slots=True)
class CompareResult:
    out_dir: Path
    runs: list[tuple[str, RunResult]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    report_md: Path | None = None
    report_html: Path | None = None
    interrupted: bool = False


def select_arms(path: Path, only: Sequence[str] | None) -> list[Arm]:
    """The arms of ``path`` to compare, in the order asked for (file order by default)."""
    arms = load_arms(path)
    if not only:
        return list(arms.values())
    unknown = [name for name in only if name not in arms]
    if unknown:
        raise ArmError(f"{path} has no arm {', '.join(map(repr, unknown))} (it has: "
                       f"{', '.join(arms)})")
    if len(set(only)) != len(only):
        raise ArmError(f"--only names an arm twice: {','.join(only)}")
    return [arms[name] for name in only]


def dry_run_lines(arms: Sequence[Arm]) -> list[str]:
    """Each arm's exact server command line, with a placeholder for what is chosen at launch."""
    lines = []
    for arm in arms:
        model = "<tiny-model-dir>" if arm.embedded else None
        argv = serve_argv(arm, "127.0.0.1", 0, model)
        port_at = argv.index("--port") + 1
        argv[port_at] = "<free-port>"
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in arm.get("env", {}).items())
        lines.append(f"# arm {arm.name}: {arm.gpus} "
                     f"{'CPU device' if arm.embedded else 'GPU'}"
                     + (f" — {arm.synthetic_acceptance}" if arm.synthetic_acceptance else ""))
        lines.append((env + " " if env else "") + shlex.join(argv))
    return lines


def compare_arms(
    arms: Sequence[Arm],
    trace: Path,
    out_dir: Path,
    *,
    allow_gpu_count_change: bool = False,
    say: Callable[[str], None] = print,
    **replay_kwargs: Any,
) -> CompareResult:
    """Replay ``trace`` against each arm into ``out_dir/<arm>``, then compare them."""
    if len(arms) < 2:
        raise ArmError("compare needs at least two arms (pick them with --only a,b)")
    check_same_gpus(arms, allow_gpu_count_change)
    for arm in arms:
        check_gpu_count(arm)
    result = CompareResult(Path(out_dir))
    for i, arm in enumerate(arms, 1):
        say(f"arm {i}/{len(arms)}: {arm.name} ({arm.gpus} "
            f"{'CPU device' if arm.embedded else 'GPU'})")
        try:
            run = run_replay(trace, result.out_dir / arm.name, arm=arm, say=say,
                             **replay_kwargs)
        except ReplayError as exc:  # one arm's server failing must not lose the others
            say(f"arm {arm.name} failed: {exc}")
            result.failed.append((arm.name, str(exc)))
            continue
        result.runs.append((arm.name, run))
        if run.interrupted:
            result.interrupted = True
            say("interrupted: the remaining arms are not run")
            break
    if len(result.runs) >= 2:
        _, result.report_md, result.report_html = write_comparison(
            result.out_dir, [run.run_dir for _, run in result.runs])
    return result
