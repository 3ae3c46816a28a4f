"""The live dashboard in its own process, fed snapshots over a socket pair.

The replay process keeps the measurement loop to itself: the dashboard (rendering,
terminal I/O, Python work that would hold the GIL) runs in a child process started
with ``python -m agentload.tui.remote FD``. In the replay process a small thread
sends ``board.latest`` four times a second when it changed (pickled frozen
dataclasses) and forwards the child's requests ("stop") to the board, an attribute
write the engine's loop reads; nothing there ever waits on the child.

The child reads snapshots on a thread into a one-slot mailbox that the app pulls on
its timer. If the replay process goes away, the socket closes and the child exits, so
a killed replay never leaves a dashboard holding the terminal.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from agentload.replay.live import LiveBoard, LiveSnapshot

SEND_EVERY_S = 0.25


class DashboardProcess:
    """A :class:`~agentload.replay.live.Viewer` running the dashboard in a child process."""

    def __init__(self, refresh_hz: float = 4.0) -> None:
        self.refresh_hz = refresh_hz
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._note: str | None = None
        self._board: LiveBoard | None = None
        self.sent = 0
        """Snapshots sent to the child."""

    def attach(self, board: LiveBoard, stop: Any) -> None:
        parent, child = socket.socketpair()
        fd = child.fileno()
        os.set_inheritable(fd, True)
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "agentload.tui.remote", str(fd), str(self.refresh_hz)],
            pass_fds=(fd,), close_fds=True)
        child.close()
        self._conn = Connection(parent.detach())
        self._board = board
        self._thread = threading.Thread(target=self._serve, args=(board, stop),
                                        name="dashboard-feed", daemon=True)
        self._thread.start()

    def _serve(self, board: LiveBoard, stop: Any) -> None:
        conn = self._conn
        assert conn is not None
        last: LiveSnapshot | None = None
        note: str | None = None
        try:
            while not self._closed.is_set():
                if conn.poll(SEND_EVERY_S):
                    msg = conn.recv()
                    if msg == "stop":
                        stop("stopped from the dashboard")
                    elif msg == "bye":
                        return
                snap = board.latest
                if snap is not None and (snap is not last or self._note != note):
                    note = self._note
                    conn.send(snap if note is None else _with_note(snap, note))
                    self.sent += 1
                    last = snap
        except (EOFError, OSError):
            return  # the child is gone

    def finish(self, note: str) -> None:
        """Show ``note`` (where the run went) and wait for the user to leave."""
        self._note = note
        if self._proc is not None:
            with contextlib.suppress(KeyboardInterrupt):
                self._proc.wait()
        self.close()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _with_note(snap: LiveSnapshot, note: str) -> LiveSnapshot:
    from dataclasses import replace

    return replace(snap, note=note)


class RemoteSource:
    """The child's :class:`~agentload.replay.live.SnapshotSource`: the newest snapshot
    received, and "stop" / "bye" sent back."""

    live = True

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._latest: LiveSnapshot | None = None
        self.gone = False
        """The replay process closed the socket."""
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="snapshots", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                self._latest = self._conn.recv()
        except (EOFError, OSError):
            self.gone = True

    def snapshot(self) -> LiveSnapshot | None:
        return self._latest

    def _send(self, msg: str) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._conn.send(msg)

    def request_stop(self) -> None:
        self._send("stop")

    def hold(self, paused: bool) -> None:
        pass

    def bye(self) -> None:
        self._send("bye")


def main(argv: list[str]) -> None:
    """Child entry point: ``python -m agentload.tui.remote FD [REFRESH_HZ]``."""
    from agentload.tui.app import DashboardApp

    conn = Connection(int(argv[0]))
    source = RemoteSource(conn)
    app = DashboardApp(source, refresh_hz=float(argv[1]) if len(argv) > 1 else 4.0)
    app.exit_when_gone = True
    try:
        app.run()
    finally:
        source.bye()


if __name__ == "__main__":
    main(sys.argv[1:])
