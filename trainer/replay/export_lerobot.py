"""Episodes as a LeRobotDataset v3.0 folder laid out as LeRobot 0.6 writes one.

::

    OUT/meta/info.json                               codebase_version v3.0, fps, features
    OUT/meta/stats.json                              every feature's statistics (below)
    OUT/meta/tasks.parquet                           task (index) -> task_index
    OUT/meta/episodes/chunk-000/file-000.parquet     one row per episode: length, offsets,
                                                     video spans, stats/<feature>/<stat>
    OUT/data/chunk-000/file-000.parquet              one row per frame, a row group per episode
    OUT/videos/observation.images.<key>/chunk-000/file-000.mp4   camera frames, episodes in a row

Frame columns: ``observation.state`` (the float observations concatenated, names in
``info.json``), ``action``, ``next.reward``, ``next.done``, ``next.success``,
``policy_version``, ``timestamp``, ``frame_index``, ``episode_index``, ``index``,
``task_index``, and ``intervention`` (the action came from a takeover, e.g. the
console's teleoperation) when any exported step is one. Camera observations (u8 [H, W, 3]) become videos
(:mod:`trainer.replay.export_video`), each episode's span in them given by
``videos/<key>/from_timestamp`` / ``to_timestamp``.

Statistics (``min``, ``max``, ``mean``, ``std``, ``count``, ``q01`` … ``q99``) are
computed per episode for every feature, the index columns and flags included, and
aggregated into ``stats.json`` by LeRobot's rules (:mod:`trainer.replay.export_stats`),
so LeRobot's tools that rebuild ``stats.json`` from the episodes get the same numbers.
Episode rows also carry loopgate's own ``loopgate/*`` columns (id, end, eval, worker,
env, source, the number of intervention steps, and the operator's label and note from
the console: ``success``, ``failure`` or empty), which LeRobot keeps and ignores.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.trajectory import Episode
from trainer.replay.export_mcap import ProgressFn, is_camera
from trainer.replay.export_stats import Stats, aggregate_stats, feature_stats, image_stats, to_json

if TYPE_CHECKING:
    from trainer.replay.export_video import VideoEncoder

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Columns LeRobot adds to every dataset, after the dataset's own features."""
SCALARS = {
    "next.reward": "float32",
    "next.done": "bool",
    "next.success": "bool",
    "policy_version": "int64",
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}


def _task(ep: Episode) -> str:
    return str(ep.meta.get("task") or "task")


def _tasks_table(tasks: list[str]) -> Any:
    import pyarrow as pa

    # LeRobot reads tasks.parquet with pandas and uses the "task" index as the task text.
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
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
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    table = pa.table(
        {"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())}
    )
    return table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})


def _hf_features(features: dict[str, Any]) -> dict[str, Any]:
    """The ``huggingface`` schema metadata of the frames file (how ``datasets`` types it)."""
    out: dict[str, Any] = {}
    for key, ft in features.items():
        if ft["dtype"] == "video":
            continue
        value = {"dtype": ft["dtype"], "_type": "Value"}
        out[key] = (
            value if ft["shape"] == [1] else {"feature": value, "length": ft["shape"][0], "_type": "List"}
        )
    return out


def _frame_columns(
    ep: Episode, index: int, offset: int, state_keys: list[str], fps: float, task: int, interventions: bool
) -> dict[str, np.ndarray]:
    n = ep.num_steps
    done = np.zeros(n, bool)
    done[-1] = ep.end in ("terminated", "truncated")
    own = {
        "observation.state": np.concatenate(
            [np.asarray(ep.arrays[f"obs/{k}"], np.float32).reshape(n, -1) for k in state_keys], axis=1
        ),
        "action": np.asarray(ep.arrays["action"], np.float32).reshape(n, -1),
        "next.reward": np.asarray(ep.arrays["reward"], np.float32),
        "next.done": done,
        "next.success": np.asarray(ep.arrays["success"], bool),
        "policy_version": np.asarray(ep.arrays["policy_version"], np.int64),
    }
    if interventions:
        own["intervention"] = _interventions(ep)
    return own | {
        "timestamp": (np.arange(n) / fps).astype(np.float32),
        "frame_index": np.arange(n, dtype=np.int64),
        "episode_index": np.full(n, index, np.int64),
        "index": np.arange(offset, offset + n, dtype=np.int64),
        "task_index": np.full(n, task, np.int64),
    }


def _interventions(ep: Episode) -> np.ndarray:
    return np.asarray(ep.arrays.get("intervention", np.zeros(ep.num_steps, bool)), bool)


def _arrow_frames(columns: dict[str, np.ndarray]) -> Any:
    import pyarrow as pa

    arrow: dict[str, Any] = {}
    for key, value in columns.items():
        if value.ndim == 2:
            arrow[key] = pa.FixedSizeListArray.from_arrays(pa.array(value.ravel()), value.shape[1])
        else:
            arrow[key] = pa.array(value)
    return pa.table(arrow)


def _features(
    first: Episode,
    state_keys: list[str],
    cameras: list[str],
    encoder: VideoEncoder | None,
    fps: float,
    interventions: bool = False,
) -> dict[str, Any]:
    """``info.json``'s features, in the order LeRobot lists them."""
    names: list[str] = []
    for key in state_keys:
        width = int(np.prod(first.arrays[f"obs/{key}"].shape[1:]))
        names += [f"{key}_{i}" for i in range(width)] if width > 1 else [key]
    action = [int(np.prod(first.arrays["action"].shape[1:]))]
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [len(names)], "names": names},
        "action": {"dtype": "float32", "shape": action, "names": None},
    }
    own = {k: t for k, t in SCALARS.items() if k not in DEFAULT_FEATURES}
    features |= {k: {"dtype": t, "shape": [1], "names": None} for k, t in own.items()}
    if interventions:
        features["intervention"] = {"dtype": "bool", "shape": [1], "names": None}
    for key in cameras:
        assert encoder is not None
        shape = first.arrays[f"obs/{key}"].shape[1:]
        features[f"observation.images.{key}"] = {
            "dtype": "video",
            "shape": list(shape),
            "names": ["height", "width", "channels"],
            "info": encoder.info(shape, fps),
        }
    return features | {k: {"dtype": SCALARS[k], "shape": [1], "names": None} for k in DEFAULT_FEATURES}


def _episode_stats(columns: dict[str, np.ndarray], ep: Episode, cameras: list[str]) -> dict[str, Stats]:
    """Every feature's statistics over one episode, in the order of the features."""
    stats = {k: feature_stats(v) for k, v in columns.items() if k not in DEFAULT_FEATURES}
    stats |= {f"observation.images.{k}": image_stats(ep.arrays[f"obs/{k}"]) for k in cameras}
    return stats | {k: feature_stats(columns[k]) for k in DEFAULT_FEATURES}


def _episode_row(
    ep: Episode,
    index: int,
    offset: int,
    t_video: float,
    fps: float,
    cameras: list[str],
    stats: dict[str, Stats],
) -> dict[str, Any]:
    """The episode's row of ``meta/episodes``, columns in LeRobot's order, then loopgate's."""
    n = ep.num_steps
    row: dict[str, Any] = {
        "episode_index": index,
        "tasks": [_task(ep)],
        "length": n,
        "data/chunk_index": 0,
        "data/file_index": 0,
        "dataset_from_index": offset,
        "dataset_to_index": offset + n,
    }
    for key in cameras:
        vkey = f"observation.images.{key}"
        row[f"videos/{vkey}/chunk_index"] = 0
        row[f"videos/{vkey}/file_index"] = 0
        row[f"videos/{vkey}/from_timestamp"] = t_video
        row[f"videos/{vkey}/to_timestamp"] = t_video + n / fps
    row |= {f"stats/{f}/{s}": v for f, fs in to_json(stats).items() for s, v in fs.items()}
    return row | {
        "meta/episodes/chunk_index": 0,
        "meta/episodes/file_index": 0,
        "loopgate/episode_id": ep.episode_id,
        "loopgate/end": ep.end or "",
        "loopgate/eval": bool(ep.meta.get("eval")),
        "loopgate/worker": str(ep.meta.get("worker", "")),
        "loopgate/env": int(ep.meta.get("env", -1)),
        "loopgate/source": str(ep.meta.get("source", "online")),
        "loopgate/interventions": int(_interventions(ep).sum()),
        "loopgate/label": str(ep.meta.get("label") or ""),
        "loopgate/note": str(ep.meta.get("note") or ""),
    }


def write_lerobot(
    episodes: list[Episode],
    out: Path,
    spec: dict[str, Any] | None,
    robot_type: str = "loopgate",
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Write a LeRobotDataset v3.0 under ``out``; return a summary.

    ``progress(phase, done, total)`` hears of each episode written and each video frame
    encoded (phases ``episodes`` and ``video observation.images.<key>``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.replay.export_video import encode, pick_encoder

    if not episodes:
        raise ValueError("no episodes to export")
    report: ProgressFn = progress or (lambda phase, done, total: None)
    rate = float((spec or {}).get("control_hz") or 20.0)
    fps: float = int(rate) if rate.is_integer() else rate
    first = episodes[0]
    obs_keys = sorted(k[4:] for k in first.arrays if k.startswith("obs/"))
    cameras = [k for k in obs_keys if is_camera(first.arrays[f"obs/{k}"])]
    state_keys = [k for k in obs_keys if k not in cameras]
    tasks = sorted({_task(ep) for ep in episodes})
    task_index = {t: i for i, t in enumerate(tasks)}
    encoder = pick_encoder() if cameras else None
    interventions = any(_interventions(ep).any() for ep in episodes)
    features = _features(first, state_keys, cameras, encoder, fps, interventions)
    # The frames file carries the schema metadata `datasets` writes, so it types the columns alike.
    hf_meta = {b"huggingface": json.dumps({"info": {"features": _hf_features(features)}}).encode()}

    data_file = out / DATA_PATH.format(chunk_index=0, file_index=0)
    data_file.parent.mkdir(parents=True, exist_ok=True)
    writer: Any = None
    rows: list[dict[str, Any]] = []
    episode_stats: list[dict[str, Stats]] = []
    offset = 0
    try:
        for index, ep in enumerate(episodes):
            columns = _frame_columns(ep, index, offset, state_keys, fps, task_index[_task(ep)], interventions)
            table = _arrow_frames(columns).replace_schema_metadata(hf_meta)
            if writer is None:
                writer = pq.ParquetWriter(data_file, table.schema)
            writer.write_table(table)  # one row group per episode, as LeRobot writes them
            episode_stats.append(_episode_stats(columns, ep, cameras))
            rows.append(_episode_row(ep, index, offset, offset / fps, fps, cameras, episode_stats[-1]))
            offset += ep.num_steps
            report("episodes", index + 1, len(episodes))
    finally:
        if writer is not None:
            writer.close()

    episodes_file = out / EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), episodes_file)
    pq.write_table(_tasks_table(tasks), out / "meta" / "tasks.parquet")
    for key in cameras:
        assert encoder is not None
        vkey = f"observation.images.{key}"
        frames = np.concatenate([np.asarray(ep.arrays[f"obs/{key}"]) for ep in episodes])
        path = out / VIDEO_PATH.format(video_key=vkey, chunk_index=0, file_index=0)
        encode(frames, path, fps=fps, encoder=encoder, progress=partial(report, f"video {vkey}"))
    info = {
        "codebase_version": "v3.0",
        "fps": fps,
        "features": features,
        "total_episodes": len(episodes),
        "total_frames": offset,
        "total_tasks": len(tasks),
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if cameras else None,
        "robot_type": robot_type,
        "splits": {"train": f"0:{len(episodes)}"},
    }
    (out / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    (out / "meta" / "stats.json").write_text(json.dumps(to_json(aggregate_stats(episode_stats)), indent=4))
    return {
        "path": str(out),
        "episodes": len(episodes),
        "frames": offset,
        "cameras": cameras,
        "codec": encoder.codec if encoder else None,
    }
