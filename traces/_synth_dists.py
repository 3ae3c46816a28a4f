"""The synthesizer's distributions: ``Constant``, ``Uniform`` and ``LogNormal``, each
sampled from one seeded ``random.Random``, scaled for smaller models, and parsed from a
TOML value (a number, ``[low, high]`` or a ``{dist = "lognormal", ...}`` table)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TypeAlias

from agentload.traces.errors import TraceError

# ---------------------------------------------------------------------------------------
# Distributions


def _finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise TraceError(f"{what} must be a finite number, got {value}")


def _scaled_count(value: float, factor: float) -> int:
    # A prompt part never vanishes when scaled down: at least one block survives.
    return max(1, round(value * factor))


@dataclass(frozen=True, slots=True)
class Constant:
    """Always ``value`` (a bare number in TOML)."""

    value: float

    def __post_init__(self) -> None:
        _finite(self.value, "constant")

    def sample(self, rng: random.Random) -> float:
        return float(self.value)

    def sample_int(self, rng: random.Random) -> int:
        return round(self.value)

    @property
    def lowest(self) -> float:
        return self.value

    def bounds(self) -> tuple[float, ...]:
        return (self.value,)

    def scaled(self, factor: float) -> Constant:
        return Constant(_scaled_count(self.value, factor))

    def describe(self) -> str:
        return f"{self.value:g}"


@dataclass(frozen=True, slots=True)
class Uniform:
    """Uniform on ``[lo, hi]`` (``[lo, hi]`` in TOML): ``randint`` for counts, else ``uniform``."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        _finite(self.lo, "uniform low")
        _finite(self.hi, "uniform high")
        if self.lo > self.hi:
            raise TraceError(f"uniform needs low <= high, got [{self.lo:g}, {self.hi:g}]")

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.lo, self.hi)

    def sample_int(self, rng: random.Random) -> int:
        return rng.randint(int(self.lo), int(self.hi))

    @property
    def lowest(self) -> float:
        return self.lo

    def bounds(self) -> tuple[float, ...]:
        return (self.lo, self.hi)

    def scaled(self, factor: float) -> Uniform:
        lo = _scaled_count(self.lo, factor)
        return Uniform(lo, max(lo, _scaled_count(self.hi, factor)))

    def describe(self) -> str:
        return f"uniform {self.lo:g}..{self.hi:g}"


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Log-normal with the given ``median`` and log-space ``sigma``, clamped to [min, max].

    In TOML: ``{dist = "lognormal", median = 300, sigma = 0.9, min = 16, max = 4000}``.
    Counts are rounded to the nearest whole number before clamping.
    """

    median: float
    sigma: float
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise TraceError(f"lognormal needs median > 0, got {self.median:g}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise TraceError(f"lognormal needs sigma >= 0, got {self.sigma:g}")
        for bound, what in ((self.min, "min"), (self.max, "max")):
            if bound is not None:
                _finite(bound, f"lognormal {what}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise TraceError(f"lognormal needs min <= max, got {self.min:g} > {self.max:g}")

    def _clamp(self, value: float) -> float:
        if self.min is not None:
            value = max(self.min, value)
        if self.max is not None:
            value = min(self.max, value)
        return value

    def sample(self, rng: random.Random) -> float:
        return self._clamp(rng.lognormvariate(math.log(self.median), self.sigma))

    def sample_int(self, rng: random.Random) -> int:
        return round(self._clamp(round(rng.lognormvariate(math.log(self.median), self.sigma))))

    @property
    def lowest(self) -> float:
        return self.min if self.min is not None else 0.0

    def bounds(self) -> tuple[float, ...]:
        return tuple(b for b in (self.min, self.max) if b is not None)

    def scaled(self, factor: float) -> LogNormal:
        lo = None if self.min is None else _scaled_count(self.min, factor)
        hi = None if self.max is None else max(lo or 1, _scaled_count(self.max, factor))
        return LogNormal(self.median * factor, self.sigma, lo, hi)

    def describe(self) -> str:
        clamp = "" if self.min is None and self.max is None else (
            f", {'' if self.min is None else f'{self.min:g}'}.."
            f"{'' if self.max is None else f'{self.max:g}'}")
        return f"lognormal(median {self.median:g}, sigma {self.sigma:g}{clamp})"


Dist: TypeAlias = Constant | Uniform | LogNormal


def parse_dist(value: object) -> Dist:
    """A distribution from its TOML form: a number, ``[lo, hi]`` or a ``{dist = ...}`` table.

    Raises ``TraceError`` saying what is wrong (the caller adds the file and key).
    """
    if _is_number(value):
        return Constant(_number(value))
    if isinstance(value, list):
        if len(value) != 2 or not all(_is_number(v) for v in value):
            raise TraceError(f"a range is [low, high] (two numbers), got {_show(value)}")
        return Uniform(_number(value[0]), _number(value[1]))
    if isinstance(value, dict):
        kind = value.get("dist")
        takes = {"constant": ("value",), "uniform": ("min", "max"),
                 "lognormal": ("median", "sigma", "min", "max")}
        if kind not in takes:
            raise TraceError(f"a distribution table needs dist = one of "
                             f"{', '.join(map(repr, takes))}, got {_show(kind)}")
        extra = sorted(set(value) - {"dist", *takes[kind]})
        if extra:
            raise TraceError(f"{kind} takes {', '.join(takes[kind])}; unexpected {extra[0]!r}")
        needs = {"constant": ("value",), "uniform": ("min", "max"),
                 "lognormal": ("median", "sigma")}[kind]
        for key in needs:
            if key not in value:
                raise TraceError(f"{kind} needs {' and '.join(needs)}; {key!r} is missing")
        for key in set(value) - {"dist"}:
            if not _is_number(value[key]):
                raise TraceError(f"{kind} {key} must be a number, got {_show(value[key])}")
        if kind == "constant":
            return Constant(_number(value["value"]))
        if kind == "uniform":
            return Uniform(_number(value["min"]), _number(value["max"]))
        opt = {k: _number(value[k]) for k in ("min", "max") if k in value}
        return LogNormal(_number(value["median"]), _number(value["sigma"]), **opt)
    raise TraceError("must be a number, [low, high] or a {dist = ...} table, "
                     f"got {_show(value)}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: object) -> float:
    assert isinstance(value, int | float)
    return value


def _show(value: object) -> str:
    kind = {str: "a string", bool: "a boolean", dict: "a table", list: "an array"}.get(
        type(value))
    return f"{kind} {value!r}" if kind else repr(value)


