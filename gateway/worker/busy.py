"""Heartbeats while a backend call blocks and does not say so itself.

A backend that blocks for long (a robot homing) calls the worker's ``keepalive``; a
user's Gymnasium env with a slow step, or one reset that takes seconds, cannot. Its
worker then said nothing for longer than ``gateway.worker_timeout_s``: the gateway
declared it gone, closed its episodes as interrupted, and the worker had to register
again. :class:`BusyBeat` is a thread that sends the heartbeat instead while a call has
been running for at least the heartbeat interval::

    beat = BusyBeat(1.0, send_heartbeat)   # send_heartbeat runs under beat.lock
    beat.start()
    beat.enter()
    try:
        backend.step(action)               # takes 8 s: a heartbeat about every second
    finally:
        beat.leave()

The worker's socket is only ever used by one thread at a time: the thread sends only
between :meth:`BusyBeat.enter` and :meth:`BusyBeat.leave`, while the worker's own thread
is in the backend, and holds :attr:`BusyBeat.lock` as it does; :meth:`leave` takes the
lock, and the backend's ``keepalive`` (on the worker's thread, inside the call) takes it
too. Outside a call it costs a lock taken and released per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BusyBeat:
    def __init__(self, interval_s: float, beat: Callable[[], None]) -> None:
        self.interval_s = interval_s
        self.beat = beat
        """Sends a heartbeat; called with :attr:`lock` held."""
        self.lock = threading.Lock()
        self._since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="worker-busy-beat", daemon=True)
            self._thread.start()

    def enter(self) -> None:
        """A backend call starts."""
        self._since = time.monotonic()

    def leave(self) -> None:
        """It ended: no heartbeat is sent from here on until the next :meth:`enter`."""
        with self.lock:
            self._since = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            with self.lock:
                since = self._since
                if since is None or time.monotonic() - since < self.interval_s:
                    continue
                try:
                    self.beat()
                except Exception as exc:  # a socket closing under a stopping worker
                    log.debug("heartbeat during a long backend call not sent: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=2.0)
