"""Service-level objectives: goodput, and the share of users and sessions that met them.

``--slo ttft=2s,itl=50ms,e2e_norm=40ms`` bounds a request's TTFT, its ITL (TPOT), its
whole latency (``e2el``) and its latency per output token (``e2e_norm`` = E2EL / OSL, the
inverse of E2E-normalized interactivity). A request meets the SLO when it succeeded and
every bound holds (vllm bench serve's ``--goodput`` and guidellm's rule); goodput is the
requests, and their output tokens, that met it, per second of the run's window.

No peer reports what agent users feel: whether *their* traffic met the SLO. A user (lane)
or a played session meets a bound when the P90 of its requests does; the summary gives the
share of users and of sessions meeting each bound and all of them.
"""

from __future__ import annotations

import re
from typing import Any

import polars as pl

from agentload.replay.errors import ReplayError

# Bound name -> the per-request column it limits (seconds).
COLUMNS = {"ttft": "ttft_s", "itl": "itl_s", "e2el": "e2el_s", "e2e_norm": "e2e_norm_s"}
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BOUND = re.compile(r"^\s*([a-z_0-9]+)\s*=\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)\s*$")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=2s,itl=50ms`` -> ``{"ttft": 2.0, "itl": 0.05}`` (seconds)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        match = _BOUND.match(part)
        if match is None:
            raise ReplayError(f"--slo takes NAME=VALUE with a unit (s, ms, us), comma-"
                              f"separated, e.g. ttft=2s,itl=50ms; got {part.strip()!r}")
        name, value, unit = match.groups()
        if name not in COLUMNS:
            raise ReplayError(f"--slo: unknown bound {name!r} (known: {', '.join(COLUMNS)})")
        if name in out:
            raise ReplayError(f"--slo names {name} twice")
        out[name] = float(value) * _UNITS[unit]
    return out


def describe(slo: dict[str, float]) -> str:
    """``ttft <= 2 s, itl <= 50 ms``."""
    def fmt(seconds: float) -> str:
        return f"{seconds:g} s" if seconds >= 1 else f"{seconds * 1e3:g} ms"
    return ", ".join(f"{name} <= {fmt(bound)}" for name, bound in slo.items())


def _met(frame: pl.DataFrame, slo: dict[str, float]) -> pl.DataFrame:
    """Per measured request: a ``met_<bound>`` column each and ``met_all``."""
    frame = frame.with_columns(e2e_norm_s=pl.when(pl.col("osl") > 0)
                               .then(pl.col("e2el_s") / pl.col("osl")))
    met = {f"met_{name}": (pl.col("ok") & (pl.col(COLUMNS[name]) <= bound)).fill_null(False)
           for name, bound in slo.items()}
    return frame.with_columns(**met).with_columns(
        met_all=pl.all_horizontal(list(met)) if met else pl.lit(True))


def _groups_meeting(frame: pl.DataFrame, slo: dict[str, float],
                    keys: list[str]) -> dict[str, Any]:
    """Share of groups (users, sessions) whose P90 of each bounded metric met it."""
    p90 = frame.group_by(keys).agg(
        failed=(~pl.col("ok")).any(),
        **{name: pl.col(COLUMNS[name]).filter(pl.col("ok")).quantile(0.9, "linear")
           for name in slo})
    if not p90.height:
        return {"count": 0}
    out: dict[str, Any] = {"count": p90.height}
    every = pl.lit(True)
    for name, bound in slo.items():
        meets = (pl.col(name) <= bound).fill_null(False) & ~pl.col("failed")
        out[f"share_meeting_{name}"] = float(p90.select(meets.mean()).item())
        every = every & meets
    out["share_meeting_all"] = float(p90.select(every.mean()).item())
    return out


def slo_summary(measured: pl.DataFrame, slo: dict[str, float],
                window_s: float | None) -> dict[str, Any]:
    """``summary.json``'s ``slo``: goodput and who met the objectives.

    ``measured`` holds the measured requests with their metrics (``with_request_metrics``).
    """
    frame = _met(measured, slo)
    met = frame.filter(pl.col("met_all"))
    n = frame.height
    return {
        "objectives_s": dict(slo),
        "described": describe(slo),
        "requests_meeting_share": met.height / n if n else None,
        **{f"requests_meeting_{name}_share": (frame[f"met_{name}"].sum() / n if n else None)
           for name in slo},
        "goodput_req_s": met.height / window_s if window_s else None,
        "goodput_tok_s": (float(met["osl"].fill_null(0).sum()) / window_s
                          if window_s else None),
        "users": _groups_meeting(frame, slo, ["lane"]),
        "sessions": _groups_meeting(frame, slo, ["lane", "play", "session_id"]),
        "definitions": {
            "meets": "the request succeeded and every bound holds",
            "goodput_req_s": "requests meeting the SLO / the run's window",
            "goodput_tok_s": "their output tokens / the run's window",
            "users": "a user (lane) meets a bound when the P90 of its successful requests "
                     "does, and none of its requests failed; likewise each played session",
        },
    }


def slo_line(slo: dict[str, Any] | None) -> str | None:
    """The console's one line on the SLO, or None without one."""
    if not slo:
        return None
    users = slo["users"].get("share_meeting_all")
    sessions = slo["sessions"].get("share_meeting_all")
    req = slo.get("goodput_req_s")
    tok = slo.get("goodput_tok_s")
    parts = [f"{slo['requests_meeting_share']:.1%} of requests"
             if slo.get("requests_meeting_share") is not None else "no requests"]
    if req is not None and tok is not None:
        parts.append(f"goodput {req:.3g} req/s, {tok:,.{1 if tok < 100 else 0}f} tok/s")
    if users is not None:
        parts.append(f"users {users:.0%}")
    if sessions is not None:
        parts.append(f"sessions {sessions:.0%}")
    return f"SLO ({slo['described']}): " + ", ".join(parts) + " met it"
