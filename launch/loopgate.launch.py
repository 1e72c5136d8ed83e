"""Launch a whole loopgate experiment against ROS 2 robots, the way ``loopgate up`` does.

    ros2 launch launch/loopgate.launch.py config:=configs/reach_ros2.yaml
    ros2 launch launch/loopgate.launch.py config:=configs/reach_ros2.yaml \
        run_dir:=runs/arm1 set:="env.options.namespaces=[/arm1] policy.kind=reach_pd"
    ros2 launch launch/loopgate.launch.py config:=configs/reach_ros2.yaml supervised:=true

Launch arguments are the options of ``loopgate up`` (``config``, ``run_dir``,
``max_env_steps``, ``set``, ``log_level``). Each planned service becomes its own
process, started with the same ``python -m`` entry point and arguments ``loopgate up``
uses: the gateway, the env workers (the ``ros2`` backend drives the robots), and the
inference, replay and trainer services the config enables; launch respawns
the ones ``loopgate up`` would restart. ``supervised:=true`` starts ``loopgate up``
itself instead, which adds the step budget, the drain on shutdown and ``summary.json``.

The file imports ``launch`` only inside :func:`generate_launch_description`, so
:func:`processes` can be inspected (and is tested) where ROS 2's launch is not installed.
"""

from __future__ import annotations

from typing import Any

from robots.launching import LaunchArgument, Process, experiment_processes, launch_arguments


def arguments() -> list[LaunchArgument]:
    """``loopgate up``'s options, and ``supervised``."""
    from gateway.supervisor import build_parser

    supervised = LaunchArgument(
        "supervised", "false", "start `loopgate up` as one process instead of each service"
    )
    return [*launch_arguments(build_parser()), supervised]


def processes(values: dict[str, str]) -> list[Process]:
    """What this launch file starts for the launch argument ``values``."""
    supervised = values.get("supervised", "false").lower() in ("true", "1", "yes")
    return experiment_processes({k: v for k, v in values.items() if k != "supervised"}, supervised=supervised)


def generate_launch_description() -> Any:
    from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction
    from launch.substitutions import LaunchConfiguration

    from launch import LaunchDescription

    declared = arguments()

    def start(context: Any) -> list[Any]:
        values = {a.name: LaunchConfiguration(a.name).perform(context) for a in declared}
        return [
            ExecuteProcess(cmd=p.argv, name=p.name, respawn=p.respawn, additional_env=p.env, output="screen")
            for p in processes(values)
        ]

    return LaunchDescription(
        [DeclareLaunchArgument(a.name, default_value=a.default, description=a.description) for a in declared]
        + [OpaqueFunction(function=start)]
    )
