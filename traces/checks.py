"""Problems found in a trace, and the structural checks every session must pass.

A ``Problem`` names where it is (file line, session, request, field) and what is wrong.
The same checks serve three callers: building a ``Session`` in code (the first error is
raised), reading a native file (the first error is raised with its line), and
``agentload traces validate`` (every problem is listed). Keeping one implementation is
what makes "the file loads" and "validate says it is clean" the same statement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a trace; ``where`` fields are None when they do not apply."""

    message: str
    session: str | None = None
    request: str | None = None
    field: str | None = None
    line: int | None = None
    severity: Severity = "error"

    def describe(self, path: str | None = None) -> str:
        """``path:line: session 's' request 'r' field f: message`` (parts that apply)."""
        head = ":".join(str(p) for p in (path, self.line) if p is not None)
        parts = []
        if self.session is not None:
            parts.append(f"session {self.session!r}")
        if self.request is not None:
            parts.append(f"request {self.request!r}")
        if self.field is not None:
            parts.append(f"field {self.field}")
        where = " ".join(parts)
        body = f"{where}: {self.message}" if where else self.message
        if self.severity == "warning":
            body = f"warning: {body}"
        return f"{head}: {body}" if head else body

    def at_line(self, line: int | None) -> Problem:
        return Problem(self.message, self.session, self.request, self.field, line,
                       self.severity)


class _Node(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def depends_on(self) -> tuple[str, ...]: ...


def is_count(value: object) -> bool:
    """An int that is not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_seconds(value: object) -> bool:
    """A finite, non-negative number of seconds."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def structure_problems(session_id: str, nodes: Sequence[_Node]) -> list[Problem]:
    """Duplicate ids, dangling or self dependencies, cycles, and dependencies listed late.

    Requests must be listed so that each one's dependencies come before it (that is
    the order a replay walks them in); a dependency on a later request is either a
    cycle, which is reported with its path, or an ordering error.
    """
    problems: list[Problem] = []
    index: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.id in index:
            problems.append(Problem("request id appears twice in the session",
                                    session_id, node.id, "id"))
        else:
            index[node.id] = i
    reported_cycles: set[frozenset[str]] = set()
    for i, node in enumerate(nodes):
        for dep in node.depends_on:
            if dep == node.id:
                problems.append(Problem("depends on itself", session_id, node.id, "deps"))
            elif dep not in index:
                problems.append(Problem(f"depends on {dep!r}, which is not a request of "
                                        "the session (dangling dependency)",
                                        session_id, node.id, "deps"))
            elif index[dep] > i:
                cycle = _cycle_through(node.id, nodes, index)
                if cycle is None:
                    problems.append(Problem(f"depends on {dep!r}, which is listed after it; "
                                            "list dependencies first",
                                            session_id, node.id, "deps"))
                elif frozenset(cycle) not in reported_cycles:
                    reported_cycles.add(frozenset(cycle))
                    problems.append(Problem("dependency cycle " + " -> ".join(cycle),
                                            session_id, node.id, "deps"))
    return problems


def _cycle_through(start: str, nodes: Sequence[_Node], index: dict[str, int]) -> list[str] | None:
    """A dependency path from ``start`` back to itself, if there is one."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    visited: set[str] = set()
    while stack:
        current, path = stack.pop()
        for dep in nodes[index[current]].depends_on:
            if dep == start:
                return [*path, start]
            if dep in index and dep not in visited:
                visited.add(dep)
                stack.append((dep, [*path, dep]))
    return None


def first_error(problems: Iterable[Problem]) -> Problem | None:
    return next((p for p in problems if p.severity == "error"), None)
