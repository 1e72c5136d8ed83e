"""Real robots over ROS 2: the ``ros2`` backend, topic maps, safety, and a robot emulator.

Nothing here imports rclpy at import time except the modules that talk to ROS
(:mod:`robots.ros_io`, :mod:`robots.link`, :mod:`robots.emulator`); configs are checked
without ROS 2 installed. See ``docs/ros2.md``.
"""
