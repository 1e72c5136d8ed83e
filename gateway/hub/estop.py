"""The control socket's own thread: an e-stop is taken there, never behind the gateway's loop.

The gateway's loop can be busy for tens of milliseconds at a time (a chunk of camera
frames gathered for the sink, a spool segment rolled), and every command on the control
socket used to wait for it. :class:`ControlLine` owns the control socket on a thread of
its own instead and forwards every command to the loop over an in-process pair, except
an e-stop being engaged, which it applies at once:

1. it sets :attr:`Collection.estopped` (under :attr:`ControlLine.lock`), so no further
   observation is answered with an action and no script's step is taken;
2. it publishes the e-stop on the gateway's e-stop bus, a PUB socket every worker
   subscribes to (its address comes in the WELCOME), so the workers hand it to their
   backends (a robot's hold) without waiting for the loop either;
3. it answers the caller, and then asks the loop to send the same COMMAND to each worker
   over the workers' socket, the path that reaches a worker that joined before its
   subscription took effect.

Numpy copies and socket I/O release the GIL, so the thread answers within a scheduling
slice however long the loop's turn is. Under ``loopgate up`` the gateway runs at a
real-time priority where the system allows it (``run.realtime_priority``,
:mod:`gateway.priority`): this thread and the loop, whose GIL it may need, then get a
core the moment they are woken, however busy simulators and browsers keep the cores. Every e-stop command (engaged or released) gets
an epoch, in the order the control socket received them; a worker applies a command only
if its epoch is newer than the last it applied, so the bus and the workers' socket may
deliver the same command in either order, and a release the loop handles after a later
engage (already applied here) is answered as superseded and changes nothing.

The e-stop is latched in the run folder too (``estop.json``, :mod:`gateway.latch`): written
when it is engaged (after the answer, so the caller never waits for the disk), removed when
it is released. A gateway that starts on a run folder whose e-stop is engaged (a restart
after a crash, a continued run) starts e-stopped: only a release lets anything move::

    line = ControlLine(ctx, "tcp://127.0.0.1:0", state, sessions=lambda: 3)
    line.start()
    loop_side = line.sock    # what the gateway's poller watches, ROUTER-framed
    line.bus_address          # what workers subscribe to
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from gateway.hub.state import Collection
from gateway.latch import read_latch, write_latch
from gateway.protocol import Message, MsgType, decode, send
from gateway.protocol.codec import encode
from gateway.transport import CurveKeys, bind, inproc_address, make_socket

log = logging.getLogger(__name__)

INTERNAL = b"\x00loopgate-control-line"
"""The routing frame of the line's own notices to the loop (no peer has this identity:
ZeroMQ's generated ones start with a zero byte and are five bytes long)."""
POLL_MS = 100


def bus_address(control: str) -> str:
    """Where the e-stop bus binds, next to the control socket's ``control`` address."""
    if control.startswith("tcp://"):
        return control.rpartition(":")[0] + ":0"
    return control + "-estop"


def estop_command(engaged: bool, reason: str, epoch: int) -> Message:
    return Message(
        MsgType.COMMAND, meta={"cmd": "estop", "engaged": engaged, "reason": reason, "epoch": epoch}
    )


def _drain(sock: zmq.Socket[Any], most: int, handle: Callable[[list[Any]], object]) -> None:
    """Hand up to ``most`` waiting messages of ``sock`` to ``handle``, never blocking."""
    for _ in range(most):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        handle(frames)


class ControlLine:
    """Owns the control socket on its own thread; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context[Any],
        address: str,
        state: Collection,
        *,
        sessions: Callable[[], int],
        keys: CurveKeys | None = None,
        latch: Path | None = None,
    ) -> None:
        self.state = state
        self.sessions = sessions
        self.latch = latch
        """Where the engaged e-stop is kept across this process's end (None: nowhere)."""
        self.lock = threading.Lock()
        """Held while the e-stop state and its epoch change (here and in the loop)."""
        self.front = make_socket(ctx, zmq.ROUTER)
        self.address = bind(self.front, address, keys)
        self.bus = make_socket(ctx, zmq.PUB, sndhwm=1000)
        self.bus_address = bind(self.bus, bus_address(self.address), keys)
        pair = inproc_address("control-line")
        self.sock = ctx.socket(zmq.PAIR)
        """The loop's end: ROUTER-framed (peer id first), read and answered by the loop."""
        self.sock.linger = 0
        self.sock.sndhwm = self.sock.rcvhwm = 0
        self.sock.bind(pair)
        self._relay = ctx.socket(zmq.PAIR)
        self._relay.linger = 0
        self._relay.sndhwm = self._relay.rcvhwm = 0
        self._relay.connect(pair)
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-control", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self._relay, zmq.POLLIN)
        while not self._quit.is_set():
            events = dict(poller.poll(POLL_MS))
            if self.front in events:
                _drain(self.front, 64, self._from_peer)
            if self._relay in events:
                _drain(self._relay, 256, lambda frames: self.front.send_multipart(frames, copy=False))

    def _from_peer(self, frames: list[Any]) -> None:
        """An e-stop command is applied here; everything else goes to the loop as it came."""
        try:
            msg = decode(frames[1:])
        except Exception:  # the loop answers it with the error that names what is wrong
            self._relay.send_multipart(frames, copy=False)
            return
        meta = msg.meta
        if msg.type is not MsgType.COMMAND or meta.get("cmd") != "estop":
            self._relay.send_multipart(frames, copy=False)
            return
        engaged, reason = bool(meta.get("engaged", True)), str(meta.get("reason", ""))
        epoch = self.next_epoch(engaged)
        if not engaged:  # the loop releases (resubmits what waits); the epoch says which came first
            released = Message(MsgType.COMMAND, seq=msg.seq, meta={**meta, "epoch": epoch})
            self._relay.send_multipart([frames[0], *encode(released)], copy=False)
            return
        command = estop_command(True, reason, epoch)
        send(self.bus, command)
        # When it took effect (unix s): a caller measures press-to-engaged from it.
        reply = {"estopped": True, "workers": self.sessions(), "epoch": epoch, "t_engaged": time.time()}
        send(self.front, Message(MsgType.REPLY, seq=msg.seq, meta=reply), route=[frames[0]])
        send(self._relay, command, route=[INTERNAL])
        self.keep_engaged(reason)

    def next_epoch(self, engaged: bool) -> int:
        """The next e-stop command's epoch; engaging sets the state at once."""
        with self.lock:
            self.state.estop_epoch += 1
            if engaged:
                self.state.estopped = True
                self.state.estops += 1
            return self.state.estop_epoch

    # -------------------------------------------------------------------- loop

    def release(self, epoch: int | None) -> bool:
        """The loop lifts the e-stop unless a later e-stop command came in (False then)."""
        with self.lock:
            if epoch is None:
                self.state.estop_epoch += 1
            elif epoch != self.state.estop_epoch:
                return False
            self.state.estopped = False
            if self.latch is not None:
                try:
                    self.latch.unlink(missing_ok=True)
                except OSError as exc:  # fails safe: the next start holds again
                    log.error("could not lift the e-stop's latch %s: %s", self.latch, exc)
            return True

    def keep_engaged(self, reason: str) -> None:
        """Latch an engaged e-stop in the run folder (:mod:`gateway.latch`)."""
        if self.latch is None:
            return
        with self.lock:  # a release that came in meanwhile has removed it: leave it so
            if not self.state.estopped:
                return
            try:
                write_latch(self.latch, reason)
            except OSError as exc:  # a full disk must not take the e-stop down with it
                log.error(
                    "could not latch the e-stop in %s: %s (it holds while this gateway runs)", self.latch, exc
                )

    def restore(self) -> dict[str, Any] | None:
        """Engage the e-stop a previous gateway on this run folder left engaged; what it
        latched (``reason``, ``t_engaged``), or None. An unreadable latch engages too."""
        latched = None if self.latch is None else read_latch(self.latch)
        if latched is None:
            return None
        with self.lock:
            self.state.estopped = True
            self.state.estop_epoch += 1  # workers apply only epochs above the last (0 when they join)
        return latched

    def close(self) -> None:
        self._quit.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for sock in (self.front, self.bus, self.sock, self._relay):
            sock.close(linger=0)
