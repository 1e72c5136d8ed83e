"""Episodes as ROS 2 messages in one MCAP file (readable by ``mcap`` + ``mcap-ros2-support``, Foxglove).

Topics, one message per step at the step's capture time (``t_capture``):

| topic | type | contents |
| --- | --- | --- |
| ``/joint_states`` | ``sensor_msgs/msg/JointState`` | ``joint_pos`` / ``joint_vel`` observations |
| ``/camera/<key>/image_raw`` | ``sensor_msgs/msg/Image`` (``rgb8``) | camera observations (u8 [H, W, 3]) |
| ``/observation/<key>`` | ``std_msgs/msg/Float32MultiArray`` | every other observation |
| ``/action`` | ``std_msgs/msg/Float32MultiArray`` | the action taken |
| ``/reward`` | ``std_msgs/msg/Float32`` | the reward that followed |
| ``/episode`` | ``std_msgs/msg/String`` | JSON at each episode's first step: id, task, end, eval |

Header ``frame_id`` is the episode id, so a viewer can tell episodes apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gateway.trajectory import Episode

SEP = "=" * 80 + "\n"
TIME = "int32 sec\nuint32 nanosec\n"
HEADER = "builtin_interfaces/Time stamp\nstring frame_id\n"
LAYOUT = "MultiArrayDimension[] dim\nuint32 data_offset\n"
DIMENSION = "string label\nuint32 size\nuint32 stride\n"

MSGDEFS: dict[str, str] = {
    "sensor_msgs/msg/JointState": (
        "std_msgs/Header header\nstring[] name\nfloat64[] position\nfloat64[] velocity\nfloat64[] effort\n"
        f"{SEP}MSG: std_msgs/Header\n{HEADER}{SEP}MSG: builtin_interfaces/Time\n{TIME}"
    ),
    "sensor_msgs/msg/Image": (
        "std_msgs/Header header\nuint32 height\nuint32 width\nstring encoding\nuint8 is_bigendian\n"
        f"uint32 step\nuint8[] data\n{SEP}MSG: std_msgs/Header\n{HEADER}{SEP}MSG: builtin_interfaces/Time\n{TIME}"
    ),
    "std_msgs/msg/Float32MultiArray": (
        f"MultiArrayLayout layout\nfloat32[] data\n{SEP}MSG: std_msgs/MultiArrayLayout\n{LAYOUT}"
        f"{SEP}MSG: std_msgs/MultiArrayDimension\n{DIMENSION}"
    ),
    "std_msgs/msg/Float32": "float32 data\n",
    "std_msgs/msg/String": "string data\n",
}

CAMERA_TOPIC = "/camera/{key}/image_raw"


def _stamp(t: float) -> dict[str, int]:
    ns = round(t * 1e9)
    return {"sec": ns // 1_000_000_000, "nanosec": ns % 1_000_000_000}


def _array(values: np.ndarray, label: str) -> dict[str, Any]:
    flat = np.asarray(values, np.float32).ravel()
    return {
        "layout": {"dim": [{"label": label, "size": len(flat), "stride": len(flat)}], "data_offset": 0},
        "data": flat.tolist(),
    }


def is_camera(arr: np.ndarray) -> bool:
    return arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[-1] == 3


def write_mcap(episodes: list[Episode], out: Path) -> dict[str, Any]:
    """Write ``episodes`` to ``out`` (a file, or a folder that gets ``episodes.mcap``)."""
    from mcap_ros2.writer import Writer

    path = out / "episodes.mcap" if out.suffix != ".mcap" else out
    path.parent.mkdir(parents=True, exist_ok=True)
    messages = 0
    with open(path, "wb") as f:
        writer = Writer(f)
        schemas = {name: writer.register_msgdef(name, text) for name, text in MSGDEFS.items()}
        t_prev = 0.0
        for ep in episodes:
            obs = {k[4:]: v for k, v in ep.arrays.items() if k.startswith("obs/")}
            joints = {k: v for k, v in obs.items() if k in ("joint_pos", "joint_vel")}
            for i in range(ep.num_steps):
                # Strictly increasing times even where capture clocks tie.
                t = max(float(ep.arrays["t_capture"][i]), t_prev + 1e-6)
                t_prev = t
                ns = round(t * 1e9)
                header = {"stamp": _stamp(t), "frame_id": ep.episode_id}

                def put(topic: str, kind: str, msg: dict[str, Any], ns: int = ns) -> None:
                    writer.write_message(topic, schemas[kind], msg, log_time=ns, publish_time=ns)

                if i == 0:
                    info = {"episode_id": ep.episode_id, "task": ep.meta.get("task"), "end": ep.end}
                    info["eval"] = bool(ep.meta.get("eval"))
                    put("/episode", "std_msgs/msg/String", {"data": json.dumps(info)})
                    messages += 1
                if joints:
                    n = len(next(iter(joints.values()))[i])
                    put(
                        "/joint_states",
                        "sensor_msgs/msg/JointState",
                        {
                            "header": header,
                            "name": [f"joint_{j}" for j in range(n)],
                            "position": np.asarray(
                                joints.get("joint_pos", np.zeros((ep.num_steps, 0)))[i], np.float64
                            ).tolist(),
                            "velocity": np.asarray(
                                joints.get("joint_vel", np.zeros((ep.num_steps, 0)))[i], np.float64
                            ).tolist(),
                            "effort": [],
                        },
                    )
                    messages += 1
                for key, arr in obs.items():
                    if key in joints:
                        continue
                    if is_camera(arr):
                        h, w = arr.shape[1:3]
                        image = {
                            "header": header,
                            "height": h,
                            "width": w,
                            "encoding": "rgb8",
                            "is_bigendian": 0,
                            "step": w * 3,
                            "data": np.ascontiguousarray(arr[i]).tobytes(),
                        }
                        put(CAMERA_TOPIC.format(key=key), "sensor_msgs/msg/Image", image)
                    else:
                        put(f"/observation/{key}", "std_msgs/msg/Float32MultiArray", _array(arr[i], key))
                    messages += 1
                put("/action", "std_msgs/msg/Float32MultiArray", _array(ep.arrays["action"][i], "action"))
                put("/reward", "std_msgs/msg/Float32", {"data": float(ep.arrays["reward"][i])})
                messages += 2
        writer.finish()  # type: ignore[no-untyped-call]
    return {"path": str(path), "episodes": len(episodes), "messages": messages}
