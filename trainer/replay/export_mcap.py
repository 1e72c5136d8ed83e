"""Episodes as ROS 2 messages in one MCAP file (readable by ``mcap`` + ``mcap-ros2-support``, Foxglove).

Every env gets its own namespace, as ROS 2 namespaces several robots: ``/env_<n>``, ``n``
numbering the (worker, env) pairs of the run in the order they first captured a step.
Parallel envs therefore never share a topic, and each namespace's messages form that
env's timeline. Every message is stamped (header and log time) with the capture time
(``t_capture``) of the step it belongs to, and the file is written in time order:

| topic | type | contents |
| --- | --- | --- |
| ``/env_<n>/joint_states`` | ``sensor_msgs/msg/JointState`` | ``joint_pos`` / ``joint_vel`` observations |
| ``/env_<n>/camera/<key>/image_raw`` | ``sensor_msgs/msg/Image`` (``rgb8``) | camera observations (u8 [H, W, 3]) |
| ``/env_<n>/observation/<key>`` | ``std_msgs/msg/Float32MultiArray`` | every other observation |
| ``/env_<n>/action`` | ``std_msgs/msg/Float32MultiArray`` | the action taken |
| ``/env_<n>/reward`` | ``std_msgs/msg/Float32`` | the reward that followed |
| ``/env_<n>/intervention`` | ``std_msgs/msg/Bool`` | ``true`` at each step whose action came from a takeover (the console's teleoperation); absent at the policy's |
| ``/env_<n>/episode`` | ``std_msgs/msg/String`` | JSON at each episode's first step (:data:`EPISODE_FIELDS`) |

Header ``frame_id`` is the episode id, so a viewer can tell episodes apart. The file's
metadata record ``loopgate.envs`` maps each namespace to its worker and env.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gateway.trajectory import Episode

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``, called by the writers (MCAP, LeRobot) as work gets done."""

RosMessage = tuple[str, str, dict[str, Any]]
"""``(topic within an env namespace, message type, message)``."""

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
    "std_msgs/msg/Bool": "bool data\n",
    "std_msgs/msg/String": "string data\n",
}

NAMESPACE = "/env_{index}"
CAMERA_TOPIC = "/camera/{key}/image_raw"
JOINT_KEYS = ("joint_pos", "joint_vel")
EPISODE_FIELDS = (
    "episode_id",
    "task",
    "end",
    "eval",
    "source",
    "worker",
    "env",
    "steps",
    "interventions",
    "label",
    "note",
)
"""Keys of the JSON on ``/env_<n>/episode``."""


def stamp(t: float) -> tuple[int, int]:
    """``(sec, nanosec)`` nearest to unix time ``t``: exact to the nanosecond a float holds."""
    sec = math.floor(t)
    nanosec = round((t - sec) * 1e9)  # t - sec is exact, so no precision is lost here
    return (sec + 1, 0) if nanosec == 1_000_000_000 else (sec, nanosec)


def _array(values: np.ndarray, label: str) -> dict[str, Any]:
    flat = np.asarray(values, np.float32).ravel()
    return {
        "layout": {"dim": [{"label": label, "size": len(flat), "stride": len(flat)}], "data_offset": 0},
        "data": flat.tolist(),
    }


def is_camera(arr: np.ndarray) -> bool:
    return arr.dtype == np.uint8 and arr.ndim == 4 and arr.shape[-1] == 3


def namespaces(episodes: list[Episode]) -> dict[tuple[str, int], str]:
    """``(worker, env)`` -> ``/env_<n>``, numbered by the time each pair first captured a step."""
    first: dict[tuple[str, int], float] = {}
    for ep in episodes:
        key = (str(ep.meta.get("worker", "")), int(ep.meta.get("env", 0)))
        t0 = float(ep.arrays["t_capture"][0]) if ep.num_steps else math.inf
        first[key] = min(first.get(key, math.inf), t0)
    ordered = sorted(first, key=lambda k: (first[k], k))
    return {key: NAMESPACE.format(index=i) for i, key in enumerate(ordered)}


def _step_order(episodes: list[Episode]) -> np.ndarray:
    """``(episode, step)`` rows of every step, sorted by capture time (ties: episode order)."""
    ep_index = np.concatenate([np.full(ep.num_steps, i) for i, ep in enumerate(episodes)])
    step = np.concatenate([np.arange(ep.num_steps) for ep in episodes])
    t = np.concatenate([np.asarray(ep.arrays["t_capture"], np.float64) for ep in episodes])
    order = np.lexsort((step, ep_index, t))
    return np.stack([ep_index[order], step[order]], axis=1)


def _episode_info(ep: Episode) -> str:
    info = {
        "episode_id": ep.episode_id,
        "task": ep.meta.get("task"),
        "end": ep.end,
        "eval": bool(ep.meta.get("eval")),
        "source": ep.meta.get("source", "online"),
        "worker": ep.meta.get("worker"),
        "env": ep.meta.get("env"),
        "steps": ep.num_steps,
        "interventions": int(np.count_nonzero(ep.arrays.get("intervention", ()))),
        "label": ep.meta.get("label"),
        "note": ep.meta.get("note"),
    }
    return json.dumps(info)


def _step_messages(
    ep: Episode, obs: dict[str, np.ndarray], i: int, header: dict[str, Any]
) -> list[RosMessage]:
    """``(topic in the env's namespace, type, message)`` of step ``i`` of ``ep``."""
    out: list[RosMessage] = []
    if i == 0:
        out.append(("/episode", "std_msgs/msg/String", {"data": _episode_info(ep)}))
    joints = {k: obs[k] for k in JOINT_KEYS if k in obs}
    if joints:
        width = len(next(iter(joints.values()))[i])
        values = {k: np.asarray(v[i], np.float64).tolist() for k, v in joints.items()}
        state = {
            "header": header,
            "name": [f"joint_{j}" for j in range(width)],
            "position": values.get("joint_pos", []),
            "velocity": values.get("joint_vel", []),
            "effort": [],
        }
        out.append(("/joint_states", "sensor_msgs/msg/JointState", state))
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
            out.append((CAMERA_TOPIC.format(key=key), "sensor_msgs/msg/Image", image))
        else:
            out.append((f"/observation/{key}", "std_msgs/msg/Float32MultiArray", _array(arr[i], key)))
    out.append(("/action", "std_msgs/msg/Float32MultiArray", _array(ep.arrays["action"][i], "action")))
    out.append(("/reward", "std_msgs/msg/Float32", {"data": float(ep.arrays["reward"][i])}))
    if "intervention" in ep.arrays and ep.arrays["intervention"][i]:
        out.append(("/intervention", "std_msgs/msg/Bool", {"data": True}))
    return out


def write_mcap(episodes: list[Episode], out: Path, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Write ``episodes`` to ``out`` (a file, or a folder that gets ``episodes.mcap``)."""
    from mcap_ros2.writer import Writer

    path = out / "episodes.mcap" if out.suffix != ".mcap" else out
    path.parent.mkdir(parents=True, exist_ok=True)
    episodes = [ep for ep in episodes if ep.num_steps]
    spaces = namespaces(episodes)
    ns_of = [spaces[(str(ep.meta.get("worker", "")), int(ep.meta.get("env", 0)))] for ep in episodes]
    obs = [{k[4:]: v for k, v in ep.arrays.items() if k.startswith("obs/")} for ep in episodes]
    steps = _step_order(episodes) if episodes else np.zeros((0, 2), np.int64)
    written: dict[str, int] = {}
    with open(path, "wb") as f:
        writer = Writer(f)
        schemas = {name: writer.register_msgdef(name, text) for name, text in MSGDEFS.items()}
        for done, (e, i) in enumerate(steps, 1):
            ep = episodes[e]
            sec, nanosec = stamp(float(ep.arrays["t_capture"][i]))
            log_time = sec * 1_000_000_000 + nanosec
            header = {"stamp": {"sec": sec, "nanosec": nanosec}, "frame_id": ep.episode_id}
            for suffix, kind, msg in _step_messages(ep, obs[e], int(i), header):
                topic = ns_of[e] + suffix
                writer.write_message(topic, schemas[kind], msg, log_time=log_time, publish_time=log_time)
                written[topic] = written.get(topic, 0) + 1
            if progress is not None:
                progress("steps", done, len(steps))
        envs = {ns: json.dumps({"worker": w, "env": e}) for (w, e), ns in spaces.items()}
        writer.add_metadata("loopgate.envs", envs)
        writer.finish()  # type: ignore[no-untyped-call]
    return {
        "path": str(path),
        "episodes": len(episodes),
        "envs": len(spaces),
        "topics": len(written),
        "messages": sum(written.values()),
    }
