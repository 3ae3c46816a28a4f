"""The per-op loops of attribution and the tables, compiled with numba.

At 10 M kernels every numpy step is an 80 MB temporary and a full pass over memory;
attribution chained a few dozen of them. Each loop here is one pass that keeps its
state in registers: the launch join (a direct-address table on (process,
correlationId)), the innermost-range lookup (a per-thread cursor that gallops forward,
since a thread's launches come in time order), and the per-group sums of the tables.
The numpy-level reasoning (why the lookups are right) stays in
:mod:`agentload.profiler.attribute` and :mod:`agentload.profiler.summary`; these are
only their inner loops.

numba is imported, and each loop compiled, on its first call (so ``agentload`` commands
that never attribute do not pay numba's import), and the machine code is cached next to
this file (``cache=True``): only the first run on a machine compiles (about 3 s).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
F = TypeVar("F", bound=Callable[..., Any])


_JIT = {"cache": True, "nogil": True, "boundscheck": False}
"""nogil: the loops hold no Python objects, so other threads (the dashboard) run on."""


def _read_only(value: Any) -> Any:
    """A read-only view of an array argument (no copy). numba compiles a loop apart
    for read-only and writable arrays, and polars hands out both (zero-copy views of one
    record batch are read-only, copies of several are not): with every input read-only,
    each loop has one machine-code version to load from the cache, not one per mix."""
    if isinstance(value, np.ndarray) and value.flags.writeable:
        value = value.view()
        value.flags.writeable = False
    return value


class LazyJit:
    """Decorators that compile a module's loops with numba on their first call.

    ``helper`` marks a function that compiled loops call: it is compiled, in the
    module's ``namespace`` (where the loops look it up), before the first loop is.
    ``loop`` marks an entry point. With ``read_only_inputs`` its array arguments are
    passed read-only (see :func:`_read_only`), except the last one of a ``fill_*`` loop,
    which it writes; without, arguments pass as they are (loops that fill several
    buffers they were handed).
    """

    def __init__(self, namespace: dict[str, Any], read_only_inputs: bool = True) -> None:
        self._namespace = namespace
        self._helpers: list[str] = []
        self._read_only_inputs = read_only_inputs
        self._lock = threading.Lock()

    def helper(self, fn: F) -> F:
        self._helpers.append(fn.__name__)
        return fn

    def _compile(self, fn: Callable[..., Any]) -> Any:
        import numba

        with self._lock:  # two threads' first calls compile once
            for name in self._helpers:
                if not isinstance(self._namespace[name], numba.core.dispatcher.Dispatcher):
                    self._namespace[name] = numba.njit(**_JIT)(self._namespace[name])
            return numba.njit(**_JIT)(fn)

    def loop(self, fn: F) -> F:
        return self._loop(fn, 1 if fn.__name__.startswith("fill_") else 0)

    def writing(self, outputs: int) -> Callable[[F], F]:
        """``loop``, for an entry point that fills its last ``outputs`` arrays (passed
        as they are, the inputs before them read-only). The caller allocates them with
        numpy, which asks the kernel for huge pages for big arrays (numba's own
        allocations do not): a fresh 80 MB output then faults in 40 pages, not 20,000
        (with the unsigned indexes below, attribution of 10 M ops went from 0.40-0.42 s
        to 0.32-0.37 s)."""
        return lambda fn: self._loop(fn, outputs)

    def _loop(self, fn: F, outputs: int) -> F:
        jitted: list[Any] = []
        read_only = self._read_only_inputs

        def call(*args: Any) -> Any:
            if not jitted:
                compiled = self._compile(fn)
                if not jitted:
                    jitted.append(compiled)
            if not read_only:
                return jitted[0](*args)
            split = len(args) - outputs
            return jitted[0](*[_read_only(a) for a in args[:split]], *args[split:])

        call.__doc__ = fn.__doc__
        call.__name__ = fn.__name__
        return cast(F, call)


_JITTED = LazyJit(globals())
_helper = _JITTED.helper
_compiled = _JITTED.loop
_writing = _JITTED.writing
_U = np.uint64
"""An unsigned index: numba wraps a negative signed index around, a compare and select
on each access (see :mod:`agentload.profiler.sqlitefile`); these indexes never are."""


@_helper
def _code(keys: U64, value: np.uint64) -> int:
    """Index of ``value`` in the sorted, distinct ``keys``; -1 when absent."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    if lo < len(keys) and keys[lo] == value:
        return lo
    return -1


@_helper
def _code_in_run(keys: U64, value: np.uint64, last: np.uint64, code: int
                 ) -> tuple[int, np.uint64]:
    """``(code of value, value)``, reusing ``code`` while ``value`` repeats ``last``:
    events of one process (or thread) come in long runs. ``code`` -2: none yet."""
    if code != -2 and value == last:
        return code, last
    return _code(keys, value), value


@_helper
def _copy_launch(r: int, i: int, tid: U64, start: I64, end: I64, o_tid: U64, o_start: I64,
                 o_end: I64) -> int:
    """Launch row ``r``'s thread, start and end into op ``i``'s slots (0 when ``r`` is
    -1: no launch); 1 when there was none, else 0."""
    if r < 0:
        o_tid[i] = 0
        o_start[i] = 0
        o_end[i] = 0
        return 1
    o_tid[i] = tid[_U(r)]
    o_start[i] = start[_U(r)]
    o_end[i] = end[_U(r)]
    return 0


@_compiled
def correlation_bounds(proc: U64, corr: I64, procs: U64) -> tuple[I64, I64]:
    """Per process (index into sorted ``procs``) the lowest and highest correlation id
    (``lo > hi`` for a process without launches); negative ids are skipped."""
    lo = np.full(len(procs), np.iinfo(np.int64).max, np.int64)
    hi = np.full(len(procs), -1, np.int64)
    last = np.uint64(0)
    code = -2
    for i in range(len(proc)):
        code, last = _code_in_run(procs, proc[i], last, code)
        c = corr[i]
        if c < 0 or code < 0:
            continue
        lo[code] = min(lo[code], c)
        hi[code] = max(hi[code], c)
    return lo, hi


@_compiled
def fill_launch_table(proc: U64, corr: I64, procs: U64, lo: I64, size: I64, base: I64,
                      table: I64) -> int:
    """``table[base[p] + corr - lo[p]] = row + 1`` for each launch (0: none, so a fresh
    zeroed table needs no fill; the first of repeated keys wins); returns how many
    launches repeat a key. An id outside its process's ``lo .. lo + size`` is skipped
    (the bounds come from these launches, so only a caller's error makes one)."""
    last = np.uint64(0)
    code = -2
    dup = 0
    for i in range(len(proc)):
        code, last = _code_in_run(procs, proc[i], last, code)
        c = corr[i]
        if c < 0 or code < 0:
            continue
        rel = c - lo[_U(code)]
        if not 0 <= rel < size[_U(code)]:
            continue
        slot = _U(base[_U(code)] + rel)
        if table[slot]:
            dup += 1
        else:
            table[slot] = i + 1
    return dup


@_writing(4)
def launch_rows(proc: U64, corr: I64, procs: U64, lo: I64, size: I64, base: I64,
                table: I64, l_tid: U64, l_start: I64, l_end: I64, rows: I64, tid: U64,
                t0: I64, t1: I64) -> int:
    """Per op its launch row through the table into ``rows`` (-1: none) and the
    launch's thread, start and end into ``tid``, ``t0``, ``t1`` (0 without a launch),
    in one pass; returns how many ops have no launch."""
    last = np.uint64(0)
    code = -2
    missing = 0
    for i in range(len(proc)):
        code, last = _code_in_run(procs, proc[i], last, code)
        r = -1
        if code >= 0:
            rel = corr[i] - lo[_U(code)]
            if 0 <= rel < size[_U(code)]:
                r = table[_U(base[_U(code)] + rel)] - 1
        rows[i] = r
        missing += _copy_launch(r, i, l_tid, l_start, l_end, tid, t0, t1)
    return missing


@_writing(1)
def innermost(tid: U64, got: npt.NDArray[np.bool_], threads: U64, n_thr: int,
              t0: I64, t1: I64, base: int, seg: I64, s_start: I64, s_end: I64,
              parent_s: I64, order: I64, identity: bool, out: I64) -> None:
    """Per point ``[t0, t1]`` on thread ``tid`` the innermost range holding it (input
    index, -1: none) into ``out``; ``got`` empty means every point is valid.

    Ranges are sorted by (thread, start, -end); thread ``k``'s are ``seg[k]:seg[k+1]``
    and ``parent_s`` is in that order. The candidate is the last range started at or
    before ``t0`` on the thread (found from the thread's previous answer: forward by
    galloping, backward by bisection), then its parents until one holds the point.
    """
    n = len(t0)
    cursor = seg[:n_thr].copy()
    check = len(got) > 0
    last = np.uint64(0)
    found = -2
    for i in range(n):
        if check and not got[i]:
            out[i] = -1
            continue
        found, last = _code_in_run(threads, tid[i], last, found)
        code = found if found < n_thr else -1
        if code < 0:
            out[i] = -1
            continue
        a, b = seg[_U(code)], seg[_U(code + 1)]
        x0, x1 = t0[i] - base, t1[i] - base
        if a == b or s_start[_U(a)] > x0:
            out[i] = -1
            continue
        c = cursor[_U(code)]
        if s_start[_U(c)] <= x0:  # forward: gallop, then bisect (lo holds, hi does not)
            lo, step = c, 1
            while lo + step < b and s_start[_U(lo + step)] <= x0:
                lo += step
                step <<= 1
            hi = min(lo + step, b)
        else:  # backward: s_start[a] <= x0 < s_start[c]
            lo, hi = a, c
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if s_start[_U(mid)] <= x0:
                lo = mid
            else:
                hi = mid
        cursor[_U(code)] = lo
        p = lo
        while p >= 0 and (s_end[_U(p)] < x1 or s_start[_U(p)] > x0):
            p = parent_s[_U(p)]
        out[i] = p if (p < 0 or identity) else order[_U(p)]


@_compiled
def run_groups(gid: I64, start: I64, end: I64, kernel: npt.NDArray[np.bool_], want_g: bool
               ) -> tuple[I64, I64, I64, I64, I64, I64, bool, bool]:
    """The runs of equal ``gid`` as groups, in one pass: where each begins, its kernels,
    summed kernel time, busy (union) time and latest end, and (``want_g``) each row's
    run number; then whether ``start`` never decreases within a run (else the sums are
    not valid: the caller sorts) and whether the run keys strictly increase.

    The union is a running maximum of ends: an op adds only the part after everything
    before it in the group ended (valid when starts do not decrease)."""
    n = len(gid)
    first = np.empty(n, np.int64)
    kernels = np.empty(n, np.int64)
    kernel_ns = np.empty(n, np.int64)
    busy = np.empty(n, np.int64)
    last_end = np.empty(n, np.int64)
    g = np.empty(n if want_g else 0, np.int64)
    ordered = True
    rising = True
    k = -1
    reach = 0
    for i in range(n):
        s, e = start[i], end[i]
        if i == 0 or gid[i] != gid[i - 1]:
            if i and gid[i] < gid[i - 1]:
                rising = False
            k += 1
            first[k] = i
            kernels[k] = 0
            kernel_ns[k] = 0
            busy[k] = 0
            last_end[k] = e
            reach = s
        elif s < start[i - 1]:
            ordered = False
        if kernel[i]:
            kernels[k] += 1
            kernel_ns[k] += e - s
        lo = max(s, reach)
        if e > lo:  # (an op with end < start adds nothing)
            busy[k] += e - lo
        reach = max(reach, e)
        last_end[k] = max(last_end[k], e)
        if want_g:
            g[i] = k
    k += 1
    return (first[:k], kernels[:k], kernel_ns[:k], busy[:k], last_end[:k], g, ordered,
            rising)


@_compiled
def kernel_totals(g: I64, code_of_g: I64, name_id: I64, start: I64, end: I64,
                  kernel: npt.NDArray[np.bool_], width: int, size: int) -> tuple[I64, I64]:
    """Per key ``code_of_g[g] * width + name_id + 1`` (kernel rows only): how many
    kernels, and their summed duration."""
    count = np.zeros(size, np.int64)
    total = np.zeros(size, np.int64)
    for i in range(len(g)):
        if kernel[i]:
            k = code_of_g[g[i]] * width + name_id[i] + 1
            count[k] += 1
            total[k] += end[i] - start[i]
    return count, total


@_writing(2)
def nesting(s_thr: I64, skey: I64, ekey: I64, thr_first_s: I64, thr_first_e: I64,
            s_end: I64, depth: I64, parent: I64) -> int:
    """Per range (sorted by (thread, start, -end); ``skey``/``ekey``: the packed
    (thread, start) keys in that order and the sorted packed (thread, end) keys) its
    ``depth`` and its ``parent``'s sorted index (-1); returns how many ranges outlive
    their parent.

    Depth = ranges started on the thread so far (itself included) - ranges ended at or
    before its start: the ranges open when it starts. The parent is the last range one
    level up started before it on its thread.
    """
    m = len(skey)
    last_at = np.full(m + 2, -1, np.int64)  # per depth: the last range started there
    last_thr = np.full(m + 2, -1, np.int64)  # ... and its thread
    ended = 0
    not_nested = 0
    for i in range(m):
        t = s_thr[i]
        while ended < len(ekey) and ekey[ended] <= skey[i]:
            ended += 1
        d = max((i - thr_first_s[t] + 1) - (ended - thr_first_e[t]), 1)
        depth[i] = d
        p = last_at[d - 1] if d > 1 and last_thr[d - 1] == t else -1
        parent[i] = p
        if p >= 0 and s_end[p] < s_end[i]:
            not_nested += 1
        last_at[d] = i
        last_thr[d] = t
    return not_nested


@_compiled
def count_unkeyed(key: I64, replay: I64, odd_is_replay: bool) -> int:
    """Rows whose group key is not a global range index on its own: no range (< 0), a
    graph replay (``replay >= 0``; ``replay`` empty: none), or, with ``odd_is_replay``,
    an odd key (step keys: ``2 * step`` or ``2 * replay + 1``)."""
    check = len(replay) > 0
    bad = 0
    for i in range(len(key)):
        k = key[i]
        if k < 0 or (check and replay[i] >= 0) or (odd_is_replay and k & 1):
            bad += 1
    return bad


@_compiled
def repeats_a_key(heads: I64) -> bool:
    """Whether any value occurs twice in ``heads`` (non-negative ints, mostly below a
    few times their count: a seen-table; else a sort)."""
    if not len(heads):
        return False
    top = heads.max()
    if heads.min() < 0 or top > 8 * len(heads) + 1024:
        s = np.sort(heads)
        return bool((s[1:] == s[:-1]).any())
    seen = np.zeros(top + 1, np.bool_)
    for v in heads:
        if seen[v]:
            return True
        seen[v] = True
    return False


@_writing(3)
def gather_launches(rows: I64, tid: U64, start: I64, end: I64, o_tid: U64, o_start: I64,
                    o_end: I64) -> int:
    """Per op its launch's thread, start and end into ``o_*`` (0 where ``rows`` is -1);
    returns how many ops have no launch."""
    missing = 0
    for i in range(len(rows)):
        missing += _copy_launch(rows[i], i, tid, start, end, o_tid, o_start, o_end)
    return missing


@_compiled
def nearest_flagged(flag: npt.NDArray[np.bool_], parent: I64, depth: I64) -> I64:
    """Per range: itself if flagged, else its nearest flagged ancestor, else -1 (ranges
    of depth < 1, unusable ones, get -1). Ranges are visited by depth (a counting
    sort), so a parent's answer is ready before its children's."""
    m = len(flag)
    out = np.full(m, -1, np.int64)
    if not m:
        return out
    top = max(depth.max(), 0)
    count = np.zeros(top + 2, np.int64)
    for i in range(m):
        if depth[i] >= 1:
            count[depth[i] + 1] += 1
    for d in range(1, top + 2):
        count[d] += count[d - 1]
    order = np.empty(count[top + 1], np.int64)
    for i in range(m):
        d = depth[i]
        if d >= 1:
            order[count[d]] = i
            count[d] += 1
    for i in order:
        if flag[i]:
            out[i] = i
        elif parent[i] >= 0:
            out[i] = out[parent[i]]
    return out


@_compiled
def range_lookups(rng: I64, step_of: I64, layer_anc: I64) -> tuple[I64, I64, I64, bool]:
    """Per op (``rng``: its range, -1: none) its step range and step key (``2 *
    step``), and its instance at layer level (the enclosing layer, else the range
    itself); and whether any op lies in a layer."""
    n = len(rng)
    step = np.empty(n, np.int64)
    step_key = np.empty(n, np.int64)
    inst = np.empty(n, np.int64)
    layered = False
    for i in range(n):
        r = rng[i]
        if r < 0:
            step[i] = -1
            step_key[i] = -2
            inst[i] = -1
            continue
        s = step_of[r]
        step[i] = s
        step_key[i] = 2 * s
        a = layer_anc[r]
        if a >= 0:
            inst[i] = a
            layered = True
        else:
            inst[i] = r
    return step, step_key, inst, layered
