"""rclpy plumbing shared by the ROS 2 backend and the robot emulator.

Importing this module imports rclpy; the rest of loopgate imports it only when a config
asks for a ROS 2 robot. Each user owns an explicit :class:`rclpy.context.Context`
(several backends, or a backend and a test's probe, can live in one process without
sharing global state) and spins its nodes on executor threads it stops itself::

    session = RosSession("loopgate_robot", domain_id=7)
    node = session.node("loopgate_robot")
    safety = session.node("loopgate_robot_safety")   # its own executor thread
    session.start()
    with session.borrow(node) as spin:              # this thread spins the node meanwhile
        while not arrived():
            spin(0.01)                               # callbacks run here, not on the thread
    session.close()                                  # stops threads, destroys nodes, shuts down

Borrowing takes a step's wait off a thread hand-over: the message the control loop waits
for is dispatched on the control loop's own thread, which goes on at once, instead of on
the executor thread, which then has to wake it. The executor thread parks meanwhile
(never two threads in one executor) and spins again when the borrower is done, so the
node is served whether or not anyone borrows it.

``ROS_DOMAIN_ID`` and ``ROS_AUTOMATIC_DISCOVERY_RANGE`` are read by ROS itself; an
explicit ``domain_id`` overrides the former.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import rclpy
from builtin_interfaces.msg import Time
from rclpy.context import Context
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.task import Future

from robots.topic_map import Qos

log = logging.getLogger(__name__)


def qos_profile(qos: Qos) -> QoSProfile:
    """The rclpy profile of a topic map's :class:`~robots.topic_map.Qos`."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=qos.depth,
        reliability=ReliabilityPolicy.RELIABLE
        if qos.reliability == "reliable"
        else ReliabilityPolicy.BEST_EFFORT,
        durability=(
            DurabilityPolicy.TRANSIENT_LOCAL
            if qos.durability == "transient_local"
            else DurabilityPolicy.VOLATILE
        ),
    )


def time_msg(seconds: float) -> Time:
    """A ``builtin_interfaces/Time`` for ``seconds`` since the epoch."""
    sec, nanosec = divmod(round(seconds * 1e9), 1_000_000_000)
    return Time(sec=sec, nanosec=nanosec)


def resolve_topic(namespace: str, topic: str) -> str:
    """``topic`` under ``namespace`` unless it is absolute."""
    if topic.startswith("/"):
        return topic
    ns = namespace.strip("/")
    return f"/{ns}/{topic}" if ns else f"/{topic}"


def message_class(type_name: str) -> Any:
    """``"sensor_msgs/JointState"`` -> the message class."""
    import importlib

    package, _, name = type_name.partition("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


def make_executor(context: Context, kind: str) -> Any:
    """``events``: rclpy's C++ EventsExecutor (dispatches a message to its Python
    callback without the Python executor's per-wake bookkeeping, which holds the GIL
    while the control thread waits for that message); ``single_threaded``: the classic one."""
    if kind == "events":
        from rclpy.experimental.events_executor import EventsExecutor

        return EventsExecutor(context=context)
    return SingleThreadedExecutor(context=context)


class RosSession:
    """A context, its nodes and one executor thread per node."""

    def __init__(self, name: str, *, domain_id: int | None = None, executor: str = "events") -> None:
        self.name = name
        self.executor = executor
        self.context = Context()
        # Signal handling stays with the process's owner (the env worker's own handlers).
        rclpy.init(
            context=self.context,
            domain_id=domain_id,
            signal_handler_options=rclpy.signals.SignalHandlerOptions.NO,
        )
        self._executors: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._lends: list[_Lend] = []
        self.nodes: list[Node] = []
        self.failure: Exception | None = None
        """An exception that ended an executor thread (re-raised by :meth:`check`)."""
        self._stop = threading.Event()

    def node(self, name: str, namespace: str | None = None) -> Node:
        node = rclpy.create_node(
            name,
            context=self.context,
            namespace=namespace,
            enable_rosout=False,
            start_parameter_services=False,
        )
        executor = make_executor(self.context, self.executor)
        executor.add_node(node)
        self.nodes.append(node)
        self._executors.append(executor)
        self._lends.append(_Lend())
        return node

    def start(self) -> None:
        for node, executor, lend in zip(self.nodes, self._executors, self._lends):
            thread = threading.Thread(
                target=self._spin, args=(executor, lend), name=f"ros-{node.get_name()}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _spin(self, executor: Any, lend: _Lend) -> None:
        try:
            while not self._stop.is_set() and self.context.ok():
                if not lend.free.wait(0.05):
                    continue  # lent to another thread
                with lend.lock:
                    # Spins until a borrower completes ``yielded`` (both executors stop
                    # at once then; a wake() does not stop the events executor's spin).
                    lend.yielded = Future()
                    if lend.free.is_set():
                        executor.spin_until_future_complete(lend.yielded, timeout_sec=0.05)
        except ExternalShutdownException:
            pass
        except Exception as exc:
            # A callback failed: the owner re-raises it on its own thread at its next call.
            self.failure = exc
            log.error("%s: executor thread stopped: %r", self.name, exc)

    @contextlib.contextmanager
    def borrow(self, node: Node, within: float = 0.002) -> Iterator[Callable[[float], None] | None]:
        """Spin ``node`` on the calling thread: yields ``spin(timeout_s)`` (runs at most
        one ready callback, waiting up to ``timeout_s`` for one), or None when its
        executor thread did not let go within ``within`` seconds (it goes on spinning;
        wait for its callbacks as before)."""
        i = self.nodes.index(node)
        executor, lend = self._executors[i], self._lends[i]
        lend.free.clear()
        lend.yielded.set_result(True)  # the thread's spin returns, and it parks
        if not lend.lock.acquire(timeout=within):
            lend.free.set()
            yield None
            return
        try:
            yield lambda timeout_s: executor.spin_once(timeout_sec=max(0.0, timeout_s))
        finally:
            lend.lock.release()
            lend.free.set()

    def check(self) -> None:
        """Re-raise an exception that stopped an executor thread."""
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Stop the executor threads, destroy the nodes, shut the context down; idempotent."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for executor in self._executors:
            executor.shutdown(timeout_sec=1.0)
        for node in self.nodes:
            node.destroy_node()
        self._threads.clear()
        self._executors.clear()
        self._lends.clear()
        self.nodes.clear()
        if self.context.ok():
            self.context.try_shutdown()


class _Lend:
    """Who spins an executor: its thread while ``free`` is set, else the borrower holding ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free = threading.Event()
        self.free.set()
        self.yielded: Future[bool] = Future()
        """Completed by a borrower to end the thread's current spin."""
