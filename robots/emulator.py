"""A ROS 2 robot emulator: the MuJoCo reach arm behind the topics of a ros2_control robot.

Tests and demos use it as "the real robot"; :mod:`robots.ros2` does not know it is one.
It publishes what a ros2_control setup with a joint_state_broadcaster and a camera
driver publishes, and takes commands the way forward controllers do::

    /joint_states                              sensor_msgs/JointState (position, velocity, effort)
    /camera/image_raw                          sensor_msgs/Image, rgb8 (--camera)
    /forward_position_controller/commands      std_msgs/Float64MultiArray (--interface position)
    /forward_velocity_controller/commands      std_msgs/Float64MultiArray (--interface velocity)
    /joint_trajectory_controller/joint_trajectory  trajectory_msgs/JointTrajectory (--interface trajectory)
    /target_pose                               geometry_msgs/PoseStamped: moves the red target marker

All names sit under ``--namespace``. The physics is the arm of
``sim_bridges/assets/reach_arm.xml`` (loaded and checked by
:func:`sim_bridges.mujoco.load_model`), advanced in real time; position commands set
the servos' targets, velocity commands move the targets at that speed, and a command of
the wrong length is refused with a warning, as a forward controller does. Stamps come
from the system clock plus ``--clock-skew-s`` (all topics) and ``--camera-skew-s``
(the camera only), to emulate robots whose clocks disagree. ``--record FILE`` writes
every command and e-stop message received, with its arrival time, as JSON lines: tests
check safety from the robot's side with it.

    python -m robots.emulator --namespace /arm1 --rate 100 --camera
    loopgate emulator --interface velocity --record /tmp/commands.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import IO, Any

import numpy as np

log = logging.getLogger(__name__)

COMMAND_TOPICS = {
    "position": "forward_position_controller/commands",
    "velocity": "forward_velocity_controller/commands",
    "trajectory": "joint_trajectory_controller/joint_trajectory",
}


class ArmEmulator:
    """The physics and the ROS endpoints of one emulated arm (spun by :func:`main`)."""

    def __init__(self, node: Any, args: argparse.Namespace) -> None:
        from geometry_msgs.msg import PoseStamped
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Bool, Float64MultiArray
        from trajectory_msgs.msg import JointTrajectory

        from robots.ros_io import qos_profile
        from robots.topic_map import Qos
        from sim_bridges.mujoco import CAMERA_NAME, load_model
        from sim_bridges.reach import ReachTask
        from sim_bridges.rendering import BatchCamera, import_mujoco

        self.args = args
        self.node = node
        task = ReachTask()
        self.mj = import_mujoco(rendering=args.camera)
        self.model = load_model(self.mj, task, args.timestep)
        self.data = self.mj.MjData(self.model)
        self.data.qpos[:] = task.home_joint_pos
        self.data.ctrl[:] = task.home_joint_pos
        self.mj.mj_forward(self.model, self.data)
        self.names = [self.model.joint(i).name for i in range(self.model.njnt)]
        self.low, self.high = (
            self.model.actuator_ctrlrange[:, 0].copy(),
            self.model.actuator_ctrlrange[:, 1].copy(),
        )
        self.velocity = np.zeros(self.model.nu)
        self.last_sim = time.monotonic()
        self.record: IO[str] | None = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115
        self.commands = 0
        self.refused = 0
        reliable = qos_profile(Qos())
        self._state_msg = JointState
        self.joint_pub = node.create_publisher(JointState, "joint_states", reliable)
        node.create_timer(1.0 / args.rate, self.publish_state)
        self.camera: BatchCamera | None = None
        if args.camera:
            self.camera = BatchCamera(
                self.mj, self.model, camera=CAMERA_NAME, height=args.image_height, width=args.image_width
            )
            self._image_msg = Image
            self.image_pub = node.create_publisher(Image, "camera/image_raw", reliable)
            node.create_timer(1.0 / args.camera_rate, self.publish_image)
        kind = JointTrajectory if args.interface == "trajectory" else Float64MultiArray
        node.create_subscription(kind, COMMAND_TOPICS[args.interface], self.on_command, reliable)
        node.create_subscription(PoseStamped, "target_pose", self.on_target, reliable)
        if self.record is not None:
            node.create_subscription(Bool, "/estop", self.on_estop, reliable)

    # ----------------------------------------------------------------- physics

    def advance(self) -> None:
        """Simulate up to now (real time), at most 0.1 s at once (e.g. after a SIGSTOP)."""
        now = time.monotonic()
        steps = int((now - self.last_sim) / self.model.opt.timestep)
        if steps <= 0:
            return
        self.last_sim += steps * self.model.opt.timestep
        steps = min(steps, int(0.1 / self.model.opt.timestep) + 1)
        if self.args.interface == "velocity":
            dt = steps * self.model.opt.timestep
            self.data.ctrl[:] = np.clip(self.data.ctrl + self.velocity * dt, self.low, self.high)
        self.mj.mj_step(self.model, self.data, nstep=steps)

    def stamp(self, extra: float = 0.0) -> Any:
        from robots.ros_io import time_msg

        return time_msg(time.time() + self.args.clock_skew_s + extra)

    def publish_state(self) -> None:
        self.advance()
        msg = self._state_msg()
        msg.header.stamp = self.stamp()
        msg.name = self.names
        msg.position = self.data.qpos.tolist()
        msg.velocity = self.data.qvel.tolist()
        msg.effort = self.data.actuator_force.tolist()
        self.joint_pub.publish(msg)

    def publish_image(self) -> None:
        assert self.camera is not None
        self.advance()
        self.mj.mj_kinematics(self.model, self.data)
        self.mj.mj_camlight(self.model, self.data)
        image = self.camera.render([self.data])[0]
        msg = self._image_msg()
        msg.header.stamp = self.stamp(self.args.camera_skew_s)
        msg.header.frame_id = "camera"
        msg.height, msg.width = image.shape[:2]
        msg.encoding = "rgb8"
        msg.step = image.shape[1] * 3
        msg.data = image.tobytes()
        self.image_pub.publish(msg)

    # ---------------------------------------------------------------- commands

    def on_command(self, msg: Any) -> None:
        received = time.time()
        if self.args.interface == "trajectory":
            values = list(msg.points[-1].positions) if msg.points else []
            if msg.joint_names and list(msg.joint_names) != self.names:
                log.warning(
                    "trajectory for joints %s refused: this arm has %s", list(msg.joint_names), self.names
                )
                self.refused += 1
                return
        else:
            values = list(msg.data)
        if len(values) != self.model.nu:
            self.refused += 1
            log.warning("command of %d values refused: this arm has %d joints", len(values), self.model.nu)
            return
        self.advance()
        if self.args.interface == "velocity":
            self.velocity[:] = values
        else:
            self.data.ctrl[:] = np.clip(values, self.low, self.high)
        self.commands += 1
        self._log({"t": received, "topic": "command", "data": values, "qpos": self.data.qpos.tolist()})

    def on_target(self, msg: Any) -> None:
        self.data.mocap_pos[0, :2] = (msg.pose.position.x, msg.pose.position.y)

    def on_estop(self, msg: Any) -> None:
        self._log({"t": time.time(), "topic": "estop", "data": bool(msg.data)})

    def _log(self, entry: dict[str, Any]) -> None:
        if self.record is not None:
            self.record.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        if self.camera is not None:
            self.camera.close()
        if self.record is not None:
            self.record.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loopgate emulator",
        description="Emulate the reach arm as a ros2_control robot (MuJoCo physics behind ROS 2 topics).",
        epilog="example: loopgate emulator --namespace /arm1 --rate 100 --camera\n"
        "         (then: loopgate up configs/reach_ros2.yaml --set env.options.namespaces=[/arm1])",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--namespace", default="/", help="ROS namespace of every topic (default /)")
    p.add_argument("--rate", type=float, default=100.0, help="joint_states rate (Hz)")
    p.add_argument(
        "--interface", choices=sorted(COMMAND_TOPICS), default="position", help="command interface"
    )
    p.add_argument("--camera", action="store_true", help="publish camera/image_raw")
    p.add_argument("--camera-rate", type=float, default=15.0, help="camera rate (Hz)")
    p.add_argument("--image-width", type=int, default=84, help="camera image width (pixels)")
    p.add_argument("--image-height", type=int, default=84, help="camera image height (pixels)")
    p.add_argument("--timestep", type=float, default=0.002, help="physics timestep (s)")
    p.add_argument("--clock-skew-s", type=float, default=0.0, help="added to every header stamp (s)")
    p.add_argument("--camera-skew-s", type=float, default=0.0, help="added to the camera's stamps only (s)")
    p.add_argument("--record", help="append every command and e-stop received to this file (JSON lines)")
    p.add_argument("--domain-id", type=int, help="ROS domain (default: ROS_DOMAIN_ID)")
    p.add_argument("--node-name", default="reach_arm_emulator", help="node name")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("rate", "camera_rate", "timestep"):
        if not getattr(args, name) > 0:
            log.error("--%s must be > 0, got %s", name.replace("_", "-"), getattr(args, name))
            return 2
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

    # The default context: this process is the node, and rclpy's SIGINT/SIGTERM handling
    # ends spin() with ExternalShutdownException.
    with rclpy.init(args=None, domain_id=args.domain_id):
        context = rclpy.get_default_context()
        node = rclpy.create_node(args.node_name, namespace=args.namespace, start_parameter_services=False)
        emulator = None
        try:
            emulator = ArmEmulator(node, args)
            executor = SingleThreadedExecutor(context=context)
            executor.add_node(node)
            log.info(
                "emulating the reach arm in namespace %s: joint_states at %.0f Hz, %s commands%s",
                node.get_namespace(),
                args.rate,
                args.interface,
                ", camera" if args.camera else "",
            )
            executor.spin()
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        finally:
            if emulator is not None:
                log.info("stopping: %d commands applied, %d refused", emulator.commands, emulator.refused)
                emulator.close()
            node.destroy_node()
    return 0


if __name__ == "__main__":
    sys.exit(main())
