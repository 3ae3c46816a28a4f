"""Seeded trace synthesizer: agent-shaped sessions, fixed-length benchmarks, the demo trace.

Agent presets (``demo``, ``agentx-coding``) build coding-agent conversations: a system
and tool prefix shared by every session, a first user message, then main turns that
each resend the whole context so far plus the previous answer and a new tool result,
after a think/tool pause. After one main turn a session may fan out into subagents:
chains of their own (their own shared prefix, fresh context) that run beside each other
and are joined before the parent's next turn, which can carry their reports back.
Optional aux requests (side calls nobody waits for) hang off main turns. Prompt lengths
are whole blocks, so a prefix cache with the same block size matches exactly what the
trace says it should.

The ``fixed`` preset builds the fixed-length decode benchmarks vendors publish (say ISL 1,
OSL 1000 at batch 1): one-request sessions with unique blocks, so nothing is a cache hit,
and the exact ISL, the last block partial when it must be.

Every random parameter is a distribution (``Constant``, ``Uniform``, ``LogNormal``)
sampled from one seeded ``random.Random``, so the same config always gives the same
trace. ``make_config`` layers a preset, a TOML file and command-line values, in that
order of precedence, validating each at the boundary with messages that name the file
and key.
"""

from __future__ import annotations

import difflib
import math
import random
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Literal, TypeAlias

from agentload.traces.errors import TraceError
from agentload.traces.model import Block, Request, Session, Trace

DEMO_TRACE_NAME = "demo_agentx.jsonl"
PRESETS = ("demo", "agentx-coding", "fixed")
# Presets are written for 64-token blocks (the WEKA traces' block size); another block
# size re-expresses their block counts so the token lengths stay what was measured.
PRESET_BLOCK_SIZE = 64


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


# ---------------------------------------------------------------------------------------
# Configurations


class SynthConfigError(TraceError):
    """One setting of a synthesizer config is out of range; ``key`` names it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"key {key!r}: {problem}")
        self.key = key
        self.problem = problem


FieldKind = Literal["str", "count", "seed", "probability", "bool", "scale", "window",
                    "count_dist", "seconds_dist"]

# The prompt-length settings (in blocks): what --scale-context and a change of block size
# rescale. Output lengths stay, since they are what the decode benchmark measures.
PROMPT_FIELDS = ("system_blocks", "first_message_blocks", "tool_result_blocks",
                 "subagent_system_blocks", "subagent_first_message_blocks",
                 "subagent_first_tool_result_blocks", "subagent_tool_result_blocks",
                 "aux_system_blocks", "aux_prompt_blocks")


@dataclass(frozen=True, slots=True)
class SynthConfig:
    """Shape of an agent-traffic trace. The defaults are the ``demo`` preset.

    Prompt lengths (``*_blocks``) are in blocks of ``block_size`` tokens; outputs are in
    tokens; pauses in seconds. Distributions are sampled per use (per session, turn or
    request); ``system_blocks`` and ``subagent_system_blocks`` are fixed because every
    session shares those prefixes.

    - ``turns``: main-agent requests per session (fewer if ``max_context`` ends it).
    - ``first_message_blocks``: the first user message, after the shared prefix.
    - ``tool_result_blocks``: what each later main turn adds beyond the previous answer.
    - ``output_tokens``, ``pause_s``: main-agent OSL, and think/tool time before a turn.
    - ``subagent_probability``: chance that a session fans out after one main turn (not
      its last), into ``subagent_fanout`` parallel subagents of ``subagent_turns``
      requests each; the parent's next turn waits for all of them.
    - ``subagent_first_tool_result_blocks``: the jump after a subagent's first request
      (its first reads); ``subagent_tool_result_blocks`` the growth after later ones.
    - ``subagent_final_output_tokens``: the report a subagent ends with;
      ``subagent_result_in_parent`` puts the reports into the parent's next prompt.
    - ``aux_probability``: chance of an aux side call after each main turn (its own
      ``aux_system_blocks`` prefix plus ``aux_prompt_blocks``); nothing waits for it.
    - ``scale_context`` (0 < F <= 1): multiply every prompt length by F (at least one
      block each) so long sessions fit a small model.
    - ``max_context``: a context window in tokens. A request whose input plus output
      would not fit is not sent: a main chain ends there (the way an agent compacts), a
      subagent chain stops early, a subagent whose first request does not fit is not
      spawned, and a first message too long is cut to fit.
    """

    name: str = "demo-agentx"
    sessions: int = 8
    turns: Dist = Uniform(4, 7)
    block_size: int = 64
    system_blocks: int = 8
    first_message_blocks: Dist = Uniform(3, 8)
    tool_result_blocks: Dist = Uniform(1, 6)
    output_tokens: Dist = Uniform(24, 120)
    pause_s: Dist = Uniform(1.0, 4.0)
    subagent_probability: float = 0.35
    subagent_turns: Dist = Uniform(2, 3)
    subagent_system_blocks: int = 4
    seed: int = 7
    subagent_fanout: Dist = Constant(1)
    subagent_first_message_blocks: Dist = Uniform(3, 8)
    subagent_first_tool_result_blocks: Dist = Uniform(1, 6)
    subagent_tool_result_blocks: Dist = Uniform(1, 6)
    subagent_output_tokens: Dist = Uniform(24, 120)
    subagent_final_output_tokens: Dist = Uniform(24, 120)
    # Uniform(1, 4) / 2, as the demo has always drawn it (bit for bit the same floats).
    subagent_pause_s: Dist = Uniform(0.5, 2.0)
    subagent_result_in_parent: bool = False
    aux_probability: float = 0.0
    aux_system_blocks: int = 4
    aux_prompt_blocks: Dist = Uniform(1, 4)
    aux_output_tokens: Dist = Uniform(8, 64)
    scale_context: float = 1.0
    max_context: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, _SYNTH_KINDS[f.name], getattr(self, f.name))


@dataclass(frozen=True, slots=True)
class FixedConfig:
    """The ``fixed`` preset: ``requests`` one-request sessions of exactly ``isl`` input
    and ``osl`` output tokens, every block unique (no prefix-cache hits). The name is
    ``fixed-isl{isl}-osl{osl}`` unless given."""

    isl: int = 1
    osl: int = 1000
    requests: int = 10
    block_size: int = 64
    name: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, _FIXED_KINDS[f.name], getattr(self, f.name))


# How each setting is typed and checked, at the TOML boundary and in __post_init__ alike.
_SYNTH_KINDS: dict[str, FieldKind] = {
    "name": "str", "sessions": "count", "turns": "count_dist", "block_size": "count",
    "system_blocks": "count", "first_message_blocks": "count_dist",
    "tool_result_blocks": "count_dist", "output_tokens": "count_dist",
    "pause_s": "seconds_dist", "subagent_probability": "probability",
    "subagent_turns": "count_dist", "subagent_system_blocks": "count", "seed": "seed",
    "subagent_fanout": "count_dist", "subagent_first_message_blocks": "count_dist",
    "subagent_first_tool_result_blocks": "count_dist",
    "subagent_tool_result_blocks": "count_dist", "subagent_output_tokens": "count_dist",
    "subagent_final_output_tokens": "count_dist", "subagent_pause_s": "seconds_dist",
    "subagent_result_in_parent": "bool", "aux_probability": "probability",
    "aux_system_blocks": "count", "aux_prompt_blocks": "count_dist",
    "aux_output_tokens": "count_dist", "scale_context": "scale", "max_context": "window",
}
_FIXED_KINDS: dict[str, FieldKind] = {
    "isl": "count", "osl": "count", "requests": "count", "block_size": "count",
    "name": "str",
}


def _check(key: str, kind: FieldKind, value: object) -> None:
    """Raise ``SynthConfigError`` if ``value`` is not a valid setting of this kind."""
    if kind == "count_dist" or kind == "seconds_dist":
        if not isinstance(value, Constant | Uniform | LogNormal):
            raise SynthConfigError(key, f"must be a distribution, got {_show(value)}")
        if kind == "count_dist":
            if not all(float(b).is_integer() for b in value.bounds()):
                raise SynthConfigError(key, f"counts need whole numbers, got {value.describe()}")
            if value.lowest < 1:
                raise SynthConfigError(key, f"must be >= 1, got {value.describe()}")
        elif value.lowest < 0:
            raise SynthConfigError(key, f"seconds must be >= 0, got {value.describe()}")
        return
    if kind == "str":
        if not isinstance(value, str):
            raise SynthConfigError(key, f"must be a string, got {_show(value)}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise SynthConfigError(key, f"must be true or false, got {_show(value)}")
    elif kind in ("count", "seed") or (kind == "window" and value is not None):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SynthConfigError(key, f"must be a whole number, got {_show(value)}")
        if kind != "seed" and value < 1:
            raise SynthConfigError(key, f"must be >= 1, got {value}")
    elif kind in ("probability", "scale"):
        if not _is_number(value):
            raise SynthConfigError(key, f"must be a number, got {_show(value)}")
        number = _number(value)
        if kind == "probability" and not 0 <= number <= 1:
            raise SynthConfigError(key, f"must be in [0, 1], got {number:g}")
        if kind == "scale" and not 0 < number <= 1:
            raise SynthConfigError(key, f"must be in (0, 1], got {number:g}")


def rescale_prompts(config: SynthConfig, factor: float) -> SynthConfig:
    """``config`` with every prompt length times ``factor`` (rounded, at least 1 block)."""
    changes: dict[str, object] = {}
    for key in PROMPT_FIELDS:
        value = getattr(config, key)
        changes[key] = (_scaled_count(value, factor) if isinstance(value, int)
                        else value.scaled(factor))
    return replace(config, **changes)  # type: ignore[arg-type]


def _with_block_size(config: SynthConfig, block_size: int) -> SynthConfig:
    if block_size == config.block_size:
        return config
    return replace(rescale_prompts(config, config.block_size / block_size),
                   block_size=block_size)


# ---------------------------------------------------------------------------------------
# Presets


def demo(block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig:
    """The bundled demo trace: 8 short sessions that fit the embedded tiny model.

    A 512-token shared prefix, 4-7 turns, prompts growing by 1-6 blocks plus the answer,
    24-120 output tokens, 1-4 s pauses, and a 2-3 request subagent in about a third of
    the sessions. The largest prompt is about 3k tokens.
    """
    return _with_block_size(SynthConfig(), block_size)


def agentx_coding(block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig:
    """Coding-agent traffic fitted to the WEKA / SemiAnalysis Claude Code traces.

    Measured on the four sessions in ``tests/data/weka`` (traces 0107, 0146, 0291,
    0504: 34 main requests, 2 Explore subagents with 12 requests; 64-token blocks):

    - Shared prefix (tool_tokens + system_tokens): 15,215 / 15,418 / 15,484 tokens in
      three sessions, 10,757 in the fourth -> 240 blocks (15,360 tokens).
    - First-turn ISL 11,133 / 17,869 / 112,127 / 115,360; beyond the prefix 376, 2,385,
      96,912, 99,942 (two sessions resume a ~100k conversation) -> log-normal, median
      150 blocks (9.6k tokens, the geometric mean), sigma 2.4, clamped 1..1,600 blocks.
    - Main turns per session 3 / 4 / 7 / 20 -> log-normal median 6, sigma 0.72, 2..64.
    - Context growth per main turn: median 504 tokens, P90 4,024, 4 of 30 above 3.5k,
      up to 58,211 (a whole-file read). Beyond the previous answer the tool results add
      a median 228 tokens (sigma 2.06), but answers come back without their thinking,
      so growth is fitted as a whole: tool results log-normal, median 2 blocks, sigma
      2.2, 1..1,024 blocks, give growth median 640, P90 3.8k, 11% above 3.5k.
    - Main OSL: median 284, geometric mean 307, sigma 0.88, 66..3,035, P90 885 ->
      log-normal median 284, sigma 0.88, clamped 16..4,096.
    - Pauses (think_time): median 9.5 s before tool-result turns, 88 s before user
      turns; all 27 together median 16 s, sigma 1.63, 4 s..3,058 s -> log-normal median
      16 s, sigma 1.6, clamped 1..600 s (an idle hour is not worth replaying).
    - Subagents: 1 session of 4 fanned out, into 2 parallel Explore subagents after one
      main request, both joined before the next -> probability 0.25, fan-out 1-2.
      Their own prefix is 8,866 tokens (7,401 + 1,465) -> 139 blocks; the task message
      2,475 / 2,487 tokens -> 36-42 blocks; 5 and 7 requests -> 5-7; after the first
      request the context jumps by 50,039 / 50,491 tokens beyond the answer -> 782-789
      blocks; later growth median 1,969 tokens (geometric mean 1,295, sigma 1.07) ->
      median 20 blocks, sigma 1.07, 1..256; OSL 139..394 (median 148, sigma 0.31) and a
      final report of 2,185 / 2,693 tokens; pauses 3 s (9 of 10; one 24 s) -> median
      3 s, sigma 0.6, 1..60 s. The parent's next turn grew by 5,440 tokens, its own
      795-token answer plus the two reports, so the reports go into the parent prompt.
    - No aux side calls appear in these traces, so aux_probability is 0.
    - ``max_context`` 200,000: the sessions came from a 200k-token window (the largest
      prompt measured is 116,568 tokens), so no synthesized request exceeds it either.
    - Theoretical prefix-cache hit rate of the four sessions alone: 0.65 / 0.75 / 0.85 /
      0.90 (short sessions whose first prompt is all misses); 200 synthesized sessions
      give 0.87-0.89 (seeds 1-3), the misses being first messages, tool results and the
      subagents' first reads.
    """
    return _with_block_size(SynthConfig(
        name="agentx-coding",
        sessions=32,
        turns=LogNormal(6, 0.72, 2, 64),
        system_blocks=240,
        first_message_blocks=LogNormal(150, 2.4, 1, 1600),
        tool_result_blocks=LogNormal(2, 2.2, 1, 1024),
        output_tokens=LogNormal(284, 0.88, 16, 4096),
        pause_s=LogNormal(16.0, 1.6, 1.0, 600.0),
        subagent_probability=0.25,
        subagent_fanout=Uniform(1, 2),
        subagent_turns=Uniform(5, 7),
        subagent_system_blocks=139,
        subagent_first_message_blocks=Uniform(36, 42),
        subagent_first_tool_result_blocks=Uniform(782, 789),
        subagent_tool_result_blocks=LogNormal(20, 1.07, 1, 256),
        subagent_output_tokens=LogNormal(148, 0.31, 16, 1024),
        subagent_final_output_tokens=Uniform(2185, 2693),
        subagent_pause_s=LogNormal(3.0, 0.6, 1.0, 60.0),
        subagent_result_in_parent=True,
        max_context=200_000,
    ), block_size)


def fixed(block_size: int = PRESET_BLOCK_SIZE) -> FixedConfig:
    """Fixed-length decode benchmark: ISL 1, OSL 1000, 10 requests, nothing cached.

    The headline numbers vendors publish (batch 1, often with speculative decoding) are
    this shape; replay it with one user to reproduce them with the same tool.
    """
    return FixedConfig(block_size=block_size)


_PRESETS: dict[str, Callable[[int], SynthConfig | FixedConfig]] = {
    "demo": demo, "agentx-coding": agentx_coding, "fixed": fixed,
}


def preset(name: str, block_size: int = PRESET_BLOCK_SIZE) -> SynthConfig | FixedConfig:
    """The named preset's config, its prompt lengths expressed in ``block_size`` blocks."""
    if name not in _PRESETS:
        raise TraceError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return _PRESETS[name](block_size)


# ---------------------------------------------------------------------------------------
# Layering: preset < TOML file < command line


def make_config(preset_name: str | None = None, config_file: str | Path | None = None, *,
                sessions: int | None = None, seed: int | None = None,
                scale_context: float | None = None, max_context: int | None = None,
                isl: int | None = None, osl: int | None = None,
                requests: int | None = None,
                block_size: int | None = None) -> SynthConfig | FixedConfig:
    """The config ``agentload traces synth`` builds: a preset, then the TOML file's keys
    (field names of ``SynthConfig`` or ``FixedConfig``, plus ``preset`` to pick the base
    when none is given), then the values given here. None means "not given"."""
    path = None if config_file is None else Path(config_file)
    data = _read_toml(path) if path is not None else {}
    where = str(path)
    toml_preset = data.pop("preset", None)
    if toml_preset is not None and not (isinstance(toml_preset, str)
                                        and toml_preset in PRESETS):
        raise TraceError(f"{where}: key 'preset': must be one of "
                         f"{', '.join(PRESETS)}, got {_show(toml_preset)}")
    name = preset_name or toml_preset or "demo"
    if block_size is not None and block_size < 1:
        raise TraceError(f"--block-size must be >= 1, got {block_size}")
    toml_bs = data.get("block_size")
    bs = block_size if block_size is not None else (
        toml_bs if isinstance(toml_bs, int) and not isinstance(toml_bs, bool) and toml_bs >= 1
        else PRESET_BLOCK_SIZE)  # a bad TOML value is reported below, with its key
    base = preset(name, bs)

    kinds = _FIXED_KINDS if isinstance(base, FixedConfig) else _SYNTH_KINDS
    overrides: dict[str, object] = {}
    for key, value in data.items():
        if key not in kinds:
            raise TraceError(f"{where}: key {key!r}: {_unknown_key(key, name, kinds)}")
        try:
            overrides[key] = parse_dist(value) if kinds[key].endswith("_dist") else value
        except TraceError as exc:
            raise TraceError(f"{where}: key {key!r}: {exc}") from None
    config = _layer(base, overrides, lambda key: f"{where}: key {key!r}")

    given = {"sessions": sessions, "seed": seed, "scale_context": scale_context,
             "max_context": max_context, "isl": isl, "osl": osl, "requests": requests}
    flags = {k: v for k, v in given.items() if v is not None}
    wrong = sorted(set(flags) - set(kinds))
    if wrong:
        hint = ("--isl, --osl and --requests are for --preset fixed"
                if isinstance(config, SynthConfig) else
                "the fixed preset takes --isl, --osl, --requests and --block-size")
        raise TraceError(f"--{wrong[0].replace('_', '-')} does not apply to preset "
                         f"{name!r} ({hint})")
    config = _layer(config, flags, lambda key: f"--{key.replace('_', '-')}")
    if isinstance(config, SynthConfig) and isinstance(base, SynthConfig) and "name" not in data:
        config = replace(config, name=_suffixed(config.name, config, base))
    return config


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise TraceError(f"{path}: config file not found") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read config file ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TraceError(f"{path}: not valid TOML: {exc}") from None


def _unknown_key(key: str, preset_name: str, kinds: Mapping[str, FieldKind]) -> str:
    other = _SYNTH_KINDS if kinds is _FIXED_KINDS else _FIXED_KINDS
    if key in other:
        return f"not a setting of preset {preset_name!r}"
    close = difflib.get_close_matches(key, list(kinds), n=1)
    return "unknown setting" + (f" (did you mean {close[0]!r}?)" if close else "")


def _layer(config: SynthConfig | FixedConfig, changes: Mapping[str, object],
           where: Callable[[str], str]) -> SynthConfig | FixedConfig:
    try:
        return replace(config, **changes)  # type: ignore[arg-type]
    except SynthConfigError as exc:
        raise TraceError(f"{where(exc.key)}: {exc.problem}") from None


def _suffixed(name: str, config: SynthConfig, base: SynthConfig) -> str:
    # The file name is often all that travels with a trace, so a trace scaled or cut for
    # a small model says so in its name.
    if config.scale_context != base.scale_context:
        name += f"-scale{config.scale_context:g}"
    if config.max_context != base.max_context and config.max_context is not None:
        name += f"-max{config.max_context}"
    return name


# ---------------------------------------------------------------------------------------
# Synthesis


def synthesize(config: SynthConfig | FixedConfig = SynthConfig()) -> Trace:
    """Build the trace ``config`` describes (the same config always gives the same trace)."""
    if isinstance(config, FixedConfig):
        return _fixed_trace(config)
    return _AgentSynth(config).trace()


def _fixed_trace(config: FixedConfig) -> Trace:
    bs = config.block_size
    full, rest = divmod(config.isl, bs)
    sizes = [bs] * full + ([rest] if rest else [])
    sessions = []
    for i in range(config.requests):
        sid = f"s{i:02d}"
        first = 1 + i * len(sizes)
        blocks = tuple(Block(first + k, n) for k, n in enumerate(sizes))
        sessions.append(Session(id=sid, requests=(Request(
            id=f"{sid}/0", session_id=sid, blocks=blocks, output_tokens=config.osl),)))
    return Trace(name=config.name or f"fixed-isl{config.isl}-osl{config.osl}",
                 sessions=tuple(sessions), block_size=bs, source="synth",
                 meta={"preset": "fixed", "isl": str(config.isl), "osl": str(config.osl)})


def _count(rng: random.Random, dist: Dist) -> int:
    # Validation keeps constants and ranges >= 1; an unclamped log-normal can round to 0.
    return max(1, dist.sample_int(rng))


def _seconds(rng: random.Random, dist: Dist) -> float:
    return round(dist.sample(rng), 2)


class _AgentSynth:
    """One synthesis run: the RNG, the block-id counter and the shared prefixes.

    The order of RNG calls is part of the output: the bundled demo trace is this code's
    output for ``SynthConfig()``, so draws happen in the order the demo always made them
    (including the tool result drawn after a chain's last request, which nothing uses).
    """

    def __init__(self, config: SynthConfig) -> None:
        self.cfg = (rescale_prompts(config, config.scale_context)
                    if config.scale_context != 1 else config)
        self.rng = random.Random(config.seed)
        self.bs = config.block_size
        self.next_id = 1
        self.system = self.fresh(self.cfg.system_blocks)
        self.subagent_system = self.fresh(self.cfg.subagent_system_blocks)
        # Drawn only when used, so traces without aux calls keep the demo's block ids.
        self.aux_system = (self.fresh(self.cfg.aux_system_blocks)
                           if self.cfg.aux_probability > 0 else [])

    def fresh(self, n: int) -> list[Block]:
        blocks = [Block(id=self.next_id + i, tokens=self.bs) for i in range(n)]
        self.next_id += n
        return blocks

    def answer(self, output_tokens: int) -> list[Block]:
        # The previous answer comes back as context, rounded up to whole blocks.
        return self.fresh(-(-output_tokens // self.bs))

    def fits(self, context: list[Block], output_tokens: int) -> bool:
        window = self.cfg.max_context
        return window is None or len(context) * self.bs + output_tokens <= window

    def trace(self) -> Trace:
        sessions = tuple(self.session(f"s{s:02d}") for s in range(self.cfg.sessions))
        meta = {"seed": str(self.cfg.seed), "scale_context": f"{self.cfg.scale_context:g}"}
        if self.cfg.max_context is not None:
            meta["max_context"] = str(self.cfg.max_context)
        return Trace(name=self.cfg.name, sessions=sessions, block_size=self.bs,
                     source="synth", meta=meta)

    def session(self, sid: str) -> Session:
        cfg, rng = self.cfg, self.rng
        requests: list[Request] = []
        context = self.system + self.fresh(_count(rng, cfg.first_message_blocks))
        n_turns = _count(rng, cfg.turns)
        spawn_after = (rng.randrange(0, n_turns - 1)
                       if n_turns > 1 and rng.random() < cfg.subagent_probability else None)
        waits_on: list[str] = []  # what the next main turn waits for
        n_agents = 0
        for turn in range(n_turns):
            out = _count(rng, cfg.output_tokens)
            pause = _seconds(rng, cfg.pause_s) if turn else 0.0
            if turn == 0:
                context, out = self.fit_first(sid, context, out)
            elif not self.fits(context, out):
                break  # the agent would have to compact: the session ends here
            rid = f"{sid}/{turn}"
            requests.append(Request(id=rid, session_id=sid, blocks=tuple(context),
                                    output_tokens=out, depends_on=tuple(waits_on),
                                    pause_s=pause))
            waits_on = [rid]
            reports: list[int] = []  # output tokens of each joined subagent
            if turn == spawn_after:
                for _ in range(_count(rng, cfg.subagent_fanout)):
                    joined = self.subagent(sid, n_agents, rid, requests)
                    n_agents += 1
                    if joined is not None:
                        waits_on.append(joined[0])
                        reports.append(joined[1])
            if cfg.aux_probability > 0 and rng.random() < cfg.aux_probability:
                self.aux(sid, turn, rid, requests)
            context = context + self.answer(out)
            if cfg.subagent_result_in_parent:
                # The reports are the tool results of the call that spawned the subagents.
                for report in reports:
                    context += self.answer(report)
            context += self.fresh(_count(rng, cfg.tool_result_blocks))
        return Session(id=sid, requests=tuple(requests))

    def fit_first(self, sid: str, context: list[Block], out: int) -> tuple[list[Block], int]:
        """Make a session's first request fit the window: cut the first message (as an
        agent compacts a resumed conversation), then the answer (as ``max_tokens``
        would); an error only if the shared prefix leaves no room at all."""
        if self.fits(context, out):
            return context, out
        window = self.cfg.max_context
        assert window is not None
        prefix = len(self.system)
        keep = max(1, (window - out) // self.bs - prefix)
        out = min(out, window - (prefix + keep) * self.bs)
        if out < 1:
            raise TraceError(
                f"a max_context of {window} tokens leaves no room in session {sid!r}: the "
                f"shared prefix alone is {prefix * self.bs} tokens; raise --max-context or "
                "lower --scale-context")
        return context[:prefix + keep], out

    def subagent(self, sid: str, index: int, parent: str,
                 requests: list[Request]) -> tuple[str, int] | None:
        """Append a subagent chain spawned after ``parent``; return its last request id
        and output tokens, or None if not even its first request fits the window."""
        cfg, rng = self.cfg, self.rng
        agent = f"{sid}-sa{index}"
        context = self.subagent_system + self.fresh(_count(rng, cfg.subagent_first_message_blocks))
        n = _count(rng, cfg.subagent_turns)
        last: tuple[str, int] | None = None
        for k in range(n):
            out = _count(rng, cfg.subagent_final_output_tokens if k == n - 1
                         else cfg.subagent_output_tokens)
            pause = _seconds(rng, cfg.subagent_pause_s)
            if not self.fits(context, out):
                break
            rid = f"{sid}/sa{index}/{k}"
            requests.append(Request(
                id=rid, session_id=sid, blocks=tuple(context), output_tokens=out,
                depends_on=(last[0] if last else parent,), pause_s=pause,
                agent_id=agent, agent_kind="subagent",
            ))
            last = (rid, out)
            grow = (cfg.subagent_first_tool_result_blocks if k == 0
                    else cfg.subagent_tool_result_blocks)
            context = context + self.answer(out) + self.fresh(_count(rng, grow))
        return last

    def aux(self, sid: str, turn: int, parent: str, requests: list[Request]) -> None:
        cfg, rng = self.cfg, self.rng
        blocks = self.aux_system + self.fresh(_count(rng, cfg.aux_prompt_blocks))
        out = _count(rng, cfg.aux_output_tokens)
        if self.fits(blocks, out):
            requests.append(Request(id=f"{sid}/aux{turn}", session_id=sid,
                                    blocks=tuple(blocks), output_tokens=out,
                                    depends_on=(parent,), agent_id=f"{sid}-aux",
                                    agent_kind="aux"))


def demo_trace_path() -> Path:
    """The bundled demo trace (``SynthConfig()`` written as native JSONL)."""
    return Path(str(resources.files("agentload.traces") / "data" / DEMO_TRACE_NAME))
