"""Number formatting shared by the dashboard's panels (no Textual import).

Every formatter takes ``None`` for "no data yet" and shows it as an en dash, so a
panel never has to special-case an empty run.
"""

from __future__ import annotations

import math

NONE = "\u2013"  # an en dash: no data yet


def rate(x: float | None, unit: str = "") -> str:
    """A rate or count per second: 3 significant digits, ``k``/``M`` above 10^4."""
    if x is None or math.isnan(x):
        return NONE
    suffix = f" {unit}" if unit else ""
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M{suffix}"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.1f}k{suffix}"
    if abs(x) >= 100:
        return f"{x:.0f}{suffix}"
    return f"{x:.1f}{suffix}"


def seconds(x: float | None) -> str:
    """A latency: milliseconds under a second, seconds above."""
    if x is None or math.isnan(x):
        return NONE
    if x < 1.0:
        return f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def clock(x: float | None) -> str:
    """Elapsed or remaining time as m:ss or h:mm:ss."""
    if x is None or math.isnan(x):
        return NONE
    total = round(max(0.0, x))
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def percent(x: float | None) -> str:
    """A fraction in [0, 1] as a percentage."""
    if x is None or math.isnan(x):
        return NONE
    return f"{x * 100:.1f}%"


def series_value(x: float | None, unit: str) -> str:
    """The last value of a rolling series, in its unit."""
    if x is None:
        return NONE
    if unit == "s":
        return seconds(x)
    if unit == "%":
        return f"{x:.1f}%"
    if unit == "req":
        return f"{x:.0f}"
    return rate(x)


def fine_seconds(x: float | None) -> str:
    """A small latency (the client's own error): microseconds under 1 ms."""
    if x is None or math.isnan(x):
        return NONE
    if x < 1e-3:
        return f"{x * 1e6:.0f} µs"
    return seconds(x)
