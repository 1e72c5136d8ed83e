"""Episodes as a LeRobotDataset v3.0 folder: Parquet frames, episode and task metadata, videos.

::

    OUT/meta/info.json                               codebase_version v3.0, fps, features
    OUT/meta/stats.json                              min / max / mean / std per feature
    OUT/meta/tasks.parquet                           task (index) -> task_index
    OUT/meta/episodes/chunk-000/file-000.parquet     one row per episode (length, offsets)
    OUT/data/chunk-000/file-000.parquet              one row per frame, every episode
    OUT/videos/observation.images.<key>/chunk-000/file-000.mp4   camera frames, episodes in a row

Frame columns: ``observation.state`` (the float observations concatenated, names in
``info.json``), ``action``, ``next.reward``, ``next.done``, ``next.success``,
``policy_version``, ``timestamp``, ``frame_index``, ``episode_index``, ``index``,
``task_index``. Camera observations (u8 [H, W, 3]) become videos (``libsvtav1`` as
LeRobot records them when PyAV has it, else H.264), with each episode's
``from_timestamp`` / ``to_timestamp`` in the episode metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gateway.trajectory import Episode
from trainer.replay.export_mcap import is_camera

CHUNK = "chunk-000/file-000"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
CODECS = ("libsvtav1", "libx264", "mpeg4")


def _codec() -> str:
    import av

    for name in CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # PyAV raises several types for a codec it lacks
            continue
    raise RuntimeError(f"PyAV has none of the video encoders {CODECS}")


def _stats(values: np.ndarray) -> dict[str, Any]:
    v = np.asarray(values, np.float64)
    axis = 0 if v.ndim <= 2 else (0, 1, 2)  # images: per channel
    return {
        "min": np.min(v, axis=axis).tolist(),
        "max": np.max(v, axis=axis).tolist(),
        "mean": np.mean(v, axis=axis).tolist(),
        "std": np.std(v, axis=axis).tolist(),
        "count": [len(v)],
    }


def _encode(frames: np.ndarray, path: Path, fps: float, codec: str) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames.shape[1:3]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=round(fps))
        stream.width, stream.height = w + w % 2, h + h % 2  # yuv420p needs even sizes
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "18", "g": "2"}
        elif codec == "libsvtav1":
            stream.options = {"crf": "30", "g": "2", "preset": "12"}
        for frame in frames:
            if frame.shape[0] % 2 or frame.shape[1] % 2:
                frame = np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            ):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _tasks_table(tasks: list[str]) -> Any:
    import pyarrow as pa

    # LeRobot reads tasks.parquet with pandas and uses the "task" index as the task text.
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": "task",
                "field_name": "task",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    table = pa.table(
        {"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())}
    )
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})


def write_lerobot(
    episodes: list[Episode], out: Path, spec: dict[str, Any] | None, robot_type: str = "loopgate"
) -> dict[str, Any]:
    """Write a LeRobotDataset v3.0 under ``out``; return a summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not episodes:
        raise ValueError("no episodes to export")
    fps = float((spec or {}).get("control_hz") or 20.0)
    first = episodes[0]
    obs_keys = sorted(k[4:] for k in first.arrays if k.startswith("obs/"))
    cameras = [k for k in obs_keys if is_camera(first.arrays[f"obs/{k}"])]
    state_keys = [k for k in obs_keys if k not in cameras]
    names: list[str] = []
    for key in state_keys:
        width = int(np.prod(first.arrays[f"obs/{key}"].shape[1:]))
        names += [f"{key}_{i}" for i in range(width)] if width > 1 else [key]
    tasks = sorted({str(ep.meta.get("task") or "task") for ep in episodes})
    task_index = {t: i for i, t in enumerate(tasks)}

    columns: dict[str, list[np.ndarray]] = {}
    episode_rows: list[dict[str, Any]] = []
    video_frames: dict[str, list[np.ndarray]] = {k: [] for k in cameras}
    offset = 0
    t_video = 0.0
    for index, ep in enumerate(episodes):
        n = ep.num_steps
        state = np.concatenate(
            [np.asarray(ep.arrays[f"obs/{k}"], np.float32).reshape(n, -1) for k in state_keys], axis=1
        )
        done = np.zeros(n, bool)
        done[-1] = ep.end in ("terminated", "truncated")
        part = {
            "observation.state": state,
            "action": np.asarray(ep.arrays["action"], np.float32).reshape(n, -1),
            "next.reward": np.asarray(ep.arrays["reward"], np.float32),
            "next.done": done,
            "next.success": np.asarray(ep.arrays["success"], bool),
            "policy_version": np.asarray(ep.arrays["policy_version"], np.int64),
            "timestamp": (np.arange(n) / fps).astype(np.float32),
            "frame_index": np.arange(n, dtype=np.int64),
            "episode_index": np.full(n, index, np.int64),
            "index": np.arange(offset, offset + n, dtype=np.int64),
            "task_index": np.full(n, task_index[str(ep.meta.get("task") or "task")], np.int64),
        }
        for key, value in part.items():
            columns.setdefault(key, []).append(value)
        row: dict[str, Any] = {
            "episode_index": index,
            "tasks": [str(ep.meta.get("task") or "task")],
            "length": n,
            "data/chunk_index": 0,
            "data/file_index": 0,
            "dataset_from_index": offset,
            "dataset_to_index": offset + n,
            "meta/episodes/chunk_index": 0,
            "meta/episodes/file_index": 0,
            "loopgate/episode_id": ep.episode_id,
            "loopgate/end": ep.end or "",
            "loopgate/eval": bool(ep.meta.get("eval")),
        }
        for key in cameras:
            video_frames[key].append(np.asarray(ep.arrays[f"obs/{key}"]))
            vkey = f"observation.images.{key}"
            row[f"videos/{vkey}/chunk_index"] = 0
            row[f"videos/{vkey}/file_index"] = 0
            row[f"videos/{vkey}/from_timestamp"] = t_video
            row[f"videos/{vkey}/to_timestamp"] = t_video + n / fps
        t_video += n / fps
        episode_rows.append(row)
        offset += n

    data = {k: np.concatenate(v) for k, v in columns.items()}
    arrow: dict[str, Any] = {}
    for key, value in data.items():
        if value.ndim == 2:
            arrow[key] = pa.FixedSizeListArray.from_arrays(pa.array(value.ravel()), value.shape[1])
        else:
            arrow[key] = pa.array(value)
    (out / "data" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(arrow), out / "data" / f"{CHUNK}.parquet")
    (out / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(episode_rows), out / "meta" / "episodes" / f"{CHUNK}.parquet")
    pq.write_table(_tasks_table(tasks), out / "meta" / "tasks.parquet")

    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [len(names)], "names": names},
        "action": {"dtype": "float32", "shape": [data["action"].shape[1]], "names": None},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        "policy_version": {"dtype": "int64", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    stats = {k: _stats(v) for k, v in data.items() if k in ("observation.state", "action", "next.reward")}
    codec = _codec() if cameras else None
    for key in cameras:
        frames = np.concatenate(video_frames[key])
        vkey = f"observation.images.{key}"
        _encode(
            frames, out / VIDEO_PATH.format(video_key=vkey, chunk_index=0, file_index=0), fps, codec or ""
        )
        h, w, c = frames.shape[1:]
        features[vkey] = {
            "dtype": "video",
            "shape": [h, w, c],
            "names": ["height", "width", "channels"],
            "info": {
                "video.height": h,
                "video.width": w,
                "video.codec": {"libsvtav1": "av1", "libx264": "h264"}.get(codec or "", codec),
                "video.pix_fmt": "yuv420p",
                "video.is_depth_map": False,
                "video.fps": fps,
                "video.channels": c,
                "has_audio": False,
            },
        }
        stats[vkey] = _stats(frames[:: max(1, len(frames) // 256)] / 255.0)
    info = {
        "codebase_version": "v3.0",
        "robot_type": robot_type,
        "total_episodes": len(episodes),
        "total_frames": offset,
        "total_tasks": len(tasks),
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 500,
        "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if cameras else None,
        "features": features,
    }
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    (out / "meta" / "stats.json").write_text(json.dumps(stats, indent=2))
    return {"path": str(out), "episodes": len(episodes), "frames": offset, "cameras": cameras, "codec": codec}
