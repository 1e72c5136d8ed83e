# ruff: noqa: F811 - pytest fixtures imported from test_ros2_backend are test parameters here
"""rclpy plumbing (:mod:`robots.ros_io`): who runs a node's callbacks.

Real rclpy contexts and Fast DDS in this process: a talker session publishes, a listener
session's node is spun by its executor thread or, while borrowed, by the test's thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.test_ros2_backend import WHY_NOT, domain  # noqa: F401 - fixture

pytestmark = [
    pytest.mark.ros2,
    pytest.mark.integration,
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
]

TOPIC = "/borrow_probe"


@pytest.fixture
def pair(domain: int) -> Any:
    """(listener session, its node, what its callback saw, gate, publish(n)); the
    listener's callback records (thread, value) and blocks while ``gate`` is clear."""
    from std_msgs.msg import Int32

    from robots.ros_io import RosSession

    listener = RosSession("borrow_listener", domain_id=domain)
    talker = RosSession("borrow_talker", domain_id=domain)
    seen: list[tuple[int, int]] = []
    gate = threading.Event()
    gate.set()

    def on_message(msg: Any) -> None:
        seen.append((threading.get_ident(), int(msg.data)))
        gate.wait(30.0)

    try:
        node = listener.node("listener")
        node.create_subscription(Int32, TOPIC, on_message, 10)
        listener.start()
        publisher = talker.node("talker").create_publisher(Int32, TOPIC, 10)
        wait_for(lambda: publisher.get_subscription_count() >= 1, what="the listener's subscription")
        yield listener, node, seen, gate, lambda n: publisher.publish(Int32(data=n))
    finally:
        gate.set()
        talker.close()
        listener.close()


def test_a_borrowed_node_runs_its_callbacks_on_the_borrowers_thread_then_on_its_own_again(pair) -> None:
    listener, node, seen, _, publish = pair
    me = threading.get_ident()
    publish(1)
    wait_for(lambda: len(seen) == 1, what="the first message")
    spinner = seen[0][0]
    assert spinner != me  # the executor thread ran it
    with listener.borrow(node) as spin:
        assert spin is not None
        publish(2)
        deadline = time.monotonic() + 30.0
        while len(seen) < 2 and time.monotonic() < deadline:
            spin(0.1)
        assert seen[1:] == [(me, 2)]  # this thread ran it: no hand-over
    publish(3)
    wait_for(lambda: len(seen) == 3, what="a message after the borrow")
    assert seen[2] == (spinner, 3)  # the executor thread spins again


def test_a_node_whose_thread_is_busy_is_not_borrowed_and_its_thread_keeps_serving(pair) -> None:
    listener, node, seen, gate, publish = pair
    gate.clear()  # the next callback blocks the executor thread inside spin_once
    publish(1)
    wait_for(lambda: len(seen) == 1, what="the blocking message")
    with listener.borrow(node, within=0.05) as spin:
        assert spin is None  # it could not let go: the caller waits for its callbacks instead
    gate.set()
    publish(2)
    wait_for(lambda: len(seen) == 2, what="the next message")
    assert seen[1][0] == seen[0][0] != threading.get_ident()
