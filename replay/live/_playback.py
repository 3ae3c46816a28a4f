"""Playback of a run directory's journal through a live board (finished or not)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import orjson

from agentload.replay.client.diagnostics import worst_of_workers
from agentload.replay.journal import JOURNAL_NAME, RequestRecord, shard_journals
from agentload.replay.live._board import LiveBoard
from agentload.replay.live._snapshot import CLIENT_KEYS, Header, LiveSnapshot

# --------------------------------------------------------------------------- playback


def header_from_run(meta: dict[str, Any], run_dir: Path | None = None,
                    mode: Literal["live", "playback"] = "playback") -> Header:
    """The header of a run from its ``run.json`` (or the journal's run line)."""
    target = meta.get("target") or {}
    options = meta.get("options") or {}
    trace = meta.get("trace") or {}
    users = int(options.get("users") or 1)
    total = int(trace.get("requests") or 0)
    if options.get("recycle"):
        total = int(options.get("max_requests") or 0)
    elif options.get("max_requests"):
        total = min(total, int(options["max_requests"]))
    return Header(label=str(target.get("label") or target.get("base_url") or "?"),
                  trace=str(trace.get("name") or trace.get("path") or "?"),
                  gpus=int(target.get("gpus") or 1), users=users, requests_total=total,
                  duration_s=options.get("duration_s"), mode=mode,
                  run_dir=None if run_dir is None else str(run_dir),
                  recycle=bool(options.get("recycle")),
                  slo=tuple((str(k), float(v)) for k, v in (meta.get("slo_s") or {}).items()))


def worst_client(by_worker: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The client figures of several workers as one: each figure the worst worker's, the
    reasons of all (named by worker), final once every worker's is."""
    out = worst_of_workers(by_worker, (k for k in CLIENT_KEYS if k != "kernel_stamps"))
    out["final"] = all(c.get("final") for c in by_worker.values())
    return out


_Item = tuple[int, int, str, Any]  # (t_ns, order, kind, payload)


def _item_key(item: _Item) -> tuple[int, int]:
    return item[0], item[1]
_RECORD_FIELDS = frozenset(RequestRecord.__dataclass_fields__)


class JournalPlayback:
    """Plays a run directory's journal through a :class:`LiveBoard` at ``speed`` x.

    Request lines carry every time the board needs (dependencies done, sent, first
    and last token, done), so lane states are rebuilt exactly; events and server
    samples come back at their own times. A journal that is still growing (a run in
    progress, or one that was killed) is read on as lines arrive, and the clock never
    runs past the last line while the run has not ended.
    """

    live = False

    def __init__(self, run_dir: Path, speed: float = 1.0, clock: Callable[[], float]
                 = time.monotonic, start_s: float = 0.0, *,
                 paths: Sequence[Path] | None = None, board: LiveBoard | None = None,
                 ) -> None:
        """``paths``: the journals to read (default: the run's, and any worker journals
        of a ``--workers`` run still in progress); ``board``: feed this board instead of
        a new one (the driver of a ``--workers`` run tails its workers' journals into its
        own board; a worker's journal ends with ``worker_end``, never the run's end)."""
        run_dir = Path(run_dir)
        self.path = run_dir / JOURNAL_NAME
        if not self.path.is_file():
            from agentload.replay.errors import ReplayError

            raise ReplayError(f"{run_dir} holds no run journal ({JOURNAL_NAME})")
        if speed <= 0:
            from agentload.replay.errors import ReplayError

            raise ReplayError(f"--speed must be positive, got {speed:g}")
        self.run_dir = run_dir
        self.speed = speed
        self._clock = clock
        self._clients: dict[int, dict[str, Any]] = {}  # each worker's latest client figures
        if paths is None:
            paths = [self.path, *shard_journals(run_dir)]
        # Journals are read as they grow; a worker's may not exist yet when this starts.
        self._paths = list(paths)
        self._fhs: dict[Path, IO[bytes]] = {}
        self._partial: dict[Path, bytes] = {}
        # Pending timeline items, sorted by time from ``_pos`` on; lines read later are
        # merged in with one sort (Timsort: near-linear on the mostly-sorted list).
        self._items: list[_Item] = []
        self._pos = 0
        self._new: list[_Item] = []
        self._order = 0
        self._plays: dict[tuple[int, int], int] = {}
        self._max_t = 0
        self._ended = False
        self._virtual_ns = start_s * 1e9
        self._wall = clock()
        self._paused = False
        run_json = run_dir / "run.json"
        meta: dict[str, Any] = {}
        if run_json.is_file():
            try:
                meta = orjson.loads(run_json.read_bytes())
            except orjson.JSONDecodeError:
                meta = {}
        self._meta = meta
        self._read()
        self.board = board if board is not None else LiveBoard(header_from_run(self._meta,
                                                                               run_dir))

    def close(self) -> None:
        for fh in self._fhs.values():
            fh.close()

    def _push(self, t: int, kind: str, payload: Any) -> None:
        self._order += 1
        self._new.append((t, self._order, kind, payload))
        if t > self._max_t:
            self._max_t = t

    def _read(self) -> None:
        for path in self._paths:
            fh = self._fhs.get(path)
            if fh is None:
                try:
                    fh = self._fhs[path] = open(path, "rb")  # noqa: SIM115 - kept open
                except FileNotFoundError:
                    continue
            self._read_lines(path, fh)
        if self._new:
            items = self._items[self._pos:] + self._new
            items.sort(key=_item_key)
            self._items, self._pos, self._new = items, 0, []

    def _read_lines(self, path: Path, fh: IO[bytes]) -> None:
        data = self._partial.get(path, b"") + fh.read()
        lines = data.split(b"\n")
        self._partial[path] = lines.pop()
        for line in lines:
            if line.startswith((b'{"type":"chunks"', b'{"type":"gpu"')):
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            self._line(obj)

    def _pending(self) -> bool:
        return self._pos < len(self._items)

    def _line(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "run":
            if not self._meta:
                self._meta = obj
        elif kind == "request":
            rec = RequestRecord(**{k: v for k, v in obj.items() if k in _RECORD_FIELDS})
            start = self._plays.get((rec.lane, rec.play), rec.intended_ns)
            who = (rec.lane, rec.request_id, rec.agent_kind, rec.phase)
            if rec.ready_ns is not None:
                self._push(min(start, rec.ready_ns), "state", (*who, "waiting"))
                self._push(rec.ready_ns, "state", (*who, "pausing"))
            else:
                self._push(min(start, rec.sent_ns), "state", (*who, "pausing"))
            self._push(rec.sent_ns, "state", (*who, "prefilling"))
            if rec.first_token_ns is not None:
                self._push(rec.first_token_ns, "state", (*who, "decoding"))
            self._push(rec.done_ns, "done", rec)
        elif kind == "server_metrics":
            values = {k: v for k, v in obj.items() if k not in ("type", "t_ns")}
            self._push(int(obj["t_ns"]), "server", values)
        elif kind == "event":
            t = int(obj.get("t_ns", 0))
            ev = obj.get("kind")
            if ev == "play":
                self._plays[(obj["lane"], obj["play"])] = t
                self._push(t, "play", obj)
            elif ev in ("stop", "backoff"):
                self._push(t, ev, obj)
            elif ev == "replay_end":
                self._ended = True
                self._push(t, "end", obj)
            elif ev == "client":
                self._push(t, "client", obj)

    def _apply(self, kind: str, p: Any, t: int) -> None:
        b = self.board
        if kind == "state":
            lane, rid, agent, phase, state = p
            b.transition(t, lane, rid, agent, state, phase)
        elif kind == "done":
            b.transition(t, p.lane, p.request_id, p.agent_kind, "done", p.phase)
            b.finished(p)
        elif kind == "server":
            b.server_sample(t, p)
        elif kind == "play":
            b.begin_play(t, p["lane"], p["play"], str(p.get("session_id")),
                         int(p.get("start_turn") or 0), int(p.get("main_turns") or 0),
                         int(p.get("warmup_requests") or 0))
        elif kind == "stop":
            b.stopping(t, str(p.get("reason")))
        elif kind == "backoff":
            b.event(t, "backoff", f"lane {p.get('lane')} backs off {p.get('s')} s: "
                    f"{p.get('reason')}", "warn")
        elif kind == "client":
            if p.get("worker") is not None:  # one of several workers: show the worst
                self._clients[p["worker"]] = p
                p = worst_client(self._clients)
            b.client_sample(t, p, bool(p.get("final")))
        elif kind == "end":
            b.finish(t, p.get("stop_reason"))
            if b.client is None:
                self._client_from_summary(t)

    def _client_from_summary(self, t_ns: int) -> None:
        """A journal from before client lines: summary.json's figures, at the end."""
        path = self.run_dir / "summary.json"
        try:
            client = orjson.loads(path.read_bytes()).get("client")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(client, dict) and client:
            self.board.client_sample(t_ns, client, final=True)

    def advance(self, t_ns: float) -> None:
        """Apply everything that happened up to ``t_ns``."""
        self._read()
        limit = t_ns if self._ended else min(t_ns, self._max_t)
        items, pos, end = self._items, self._pos, len(self._items)
        while pos < end and items[pos][0] <= limit:
            t, _, kind, payload = items[pos]
            pos += 1
            self._apply(kind, payload, t)
        self._pos = pos
        if pos > 100_000 and pos * 2 > end:  # drop what was applied, now and then
            self._items, self._pos = items[pos:], 0
        self._virtual_ns = max(self._virtual_ns, limit)

    def clock_ns(self) -> float:
        now = self._clock()
        if not self._paused:
            self._virtual_ns += (now - self._wall) * 1e9 * self.speed
        self._wall = now
        return self._virtual_ns

    def snapshot(self) -> LiveSnapshot | None:
        t = self.clock_ns()
        self.advance(t)
        if self.board._finished and not self._pending():
            self.board.note = "end of the recorded run"
        elif not self._ended and not self._pending() and t >= self._max_t:
            self.board.note = "end of the journal so far (the run has not ended)"
        else:
            self.board.note = None
        return self.board.publish(int(self._virtual_ns))

    def request_stop(self) -> None:
        pass

    def hold(self, paused: bool) -> None:
        self.clock_ns()
        self._paused = paused
