"""The ROS 2 processes of the ROS 2 latency benchmark (:mod:`benchmarks.ros2_latency`).

Two roles, each ``python -m benchmarks.ros2_peers ROLE ...``:

- ``robot``: a stand-in ros2_control robot. It publishes ``joint_states`` at ``--rate``
  from a timer (reliable QoS) and listens on
  ``forward_position_controller/commands``. The round trip of a state is the time from
  its publication to the first command that arrives after it, on this process's clock.
  A timer tick that finds the last state unanswered publishes nothing (the rate is at
  most ``--rate``), so a late command is never paired with a later state
  (``--free-run``: publish on every tick, for measuring the controller's own loop); the first ``--warmup`` are discarded and the
  next ``--steps`` are written to ``--out`` (``.npz``, ``rtt_us``).
- ``echo``: the baseline controller, raw rclpy: every joint state is answered at once
  with a command holding its positions.

The same ``robot`` measures both paths: the ``echo`` (raw rclpy) and the ``ros2``
backend driven through a gateway, so the two figures use one estimator::

    python -m benchmarks.ros2_peers robot --rate 500 --steps 5000 --warmup 500 --out rtt.npz
    python -m benchmarks.ros2_peers echo
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

JOINTS = ["joint0", "joint1", "joint2"]
COMMANDS = "forward_position_controller/commands"


def run_robot(args: argparse.Namespace) -> int:
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    from robots.ros_io import time_msg

    rtts: list[float] = []
    state = {"sent": 0.0, "answered": True}
    want = args.warmup + args.steps
    with rclpy.init(args=None):
        node = rclpy.create_node("bench_robot", namespace=args.namespace, start_parameter_services=False)
        publisher = node.create_publisher(JointState, "joint_states", 10)
        msg = JointState(name=JOINTS, position=[0.0, 0.6, 0.6], velocity=[0.0] * 3, effort=[0.0] * 3)

        def publish() -> None:
            now = time.perf_counter()
            if not args.free_run and not state["answered"] and now - state["sent"] < 0.5:
                return  # at most one state unanswered: every command pairs with its own state
            msg.header.stamp = time_msg(time.time())
            state["sent"], state["answered"] = now, False
            publisher.publish(msg)

        def on_command(_: Any) -> None:
            now = time.perf_counter()
            if not state["answered"]:
                state["answered"] = True
                rtts.append((now - state["sent"]) * 1e6)

        node.create_subscription(Float64MultiArray, COMMANDS, on_command, 10)
        node.create_timer(1.0 / args.rate, publish)
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        deadline = time.monotonic() + args.timeout_s
        try:
            while len(rtts) < want and time.monotonic() < deadline:
                executor.spin_once(timeout_sec=0.1)
        except (KeyboardInterrupt, ExternalShutdownException):
            return 1
        finally:
            node.destroy_node()
    if len(rtts) < want:
        log.error("only %d of %d round trips within %.0f s", len(rtts), want, args.timeout_s)
        return 1
    np.savez(args.out, rtt_us=np.asarray(rtts[args.warmup : want], dtype=np.float64))
    return 0


def run_echo(args: argparse.Namespace) -> int:
    import rclpy
    from rclpy.executors import ExternalShutdownException
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    with rclpy.init(args=None):
        node = rclpy.create_node("bench_echo", namespace=args.namespace, start_parameter_services=False)
        publisher = node.create_publisher(Float64MultiArray, COMMANDS, 10)

        def on_state(msg: Any) -> None:
            publisher.publish(Float64MultiArray(data=list(msg.position)))

        node.create_subscription(JointState, "joint_states", on_state, 10)
        try:
            rclpy.spin(node)
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        finally:
            node.destroy_node()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ros2_peers",
        description="Peers of the ROS 2 latency benchmark.",
        epilog="example: python -m benchmarks.ros2_peers robot --rate 100 --steps 1000 --warmup 100 --out r.npz",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("role", choices=("robot", "echo"))
    p.add_argument("--namespace", default="/bench")
    p.add_argument("--rate", type=float, default=100.0, help="joint_states rate (Hz)")
    p.add_argument("--steps", type=int, default=1000, help="round trips recorded")
    p.add_argument("--warmup", type=int, default=100, help="round trips discarded first")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up after this long")
    p.add_argument(
        "--free-run", action="store_true", help="publish on every tick, answered or not (a steady robot)"
    )
    p.add_argument("--out", default="rtt.npz")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_robot(args) if args.role == "robot" else run_echo(args)


if __name__ == "__main__":
    sys.exit(main())
