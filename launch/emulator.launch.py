"""Launch the reach arm emulator: a MuJoCo arm behind the topics of a ros2_control robot.

    ros2 launch launch/emulator.launch.py
    ros2 launch launch/emulator.launch.py namespace:=/arm1 rate:=200 camera:=true

Launch arguments are the options of ``loopgate emulator`` (``python -m
robots.emulator``): ``namespace``, ``rate``, ``interface``, ``camera``,
``camera_rate``, ``image_width``, ``image_height``, ``timestep``, ``clock_skew_s``,
``camera_skew_s``, ``record``, ``domain_id``, ``node_name``, ``log_level``.
"""

from __future__ import annotations

from typing import Any

from robots.launching import LaunchArgument, Process, emulator_process, launch_arguments


def arguments() -> list[LaunchArgument]:
    """``loopgate emulator``'s options."""
    from robots.emulator import build_parser

    return launch_arguments(build_parser())


def processes(values: dict[str, str]) -> list[Process]:
    """What this launch file starts for the launch argument ``values``."""
    return [emulator_process(values)]


def generate_launch_description() -> Any:
    from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction
    from launch.substitutions import LaunchConfiguration

    from launch import LaunchDescription

    declared = arguments()

    def start(context: Any) -> list[Any]:
        values = {a.name: LaunchConfiguration(a.name).perform(context) for a in declared}
        return [
            ExecuteProcess(cmd=p.argv, name=p.name, respawn=p.respawn, output="screen")
            for p in processes(values)
        ]

    return LaunchDescription(
        [DeclareLaunchArgument(a.name, default_value=a.default, description=a.description) for a in declared]
        + [OpaqueFunction(function=start)]
    )
