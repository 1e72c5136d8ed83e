"""``loopgate export``: LeRobot v3 and MCAP files read back with their own readers.

The run folder is made the way the replay service makes it (chunks in its durable log,
``spec.json`` beside it) with a camera, joint and extra observations; each export is
read back with pyarrow / PyAV or the ``mcap`` reader with ``mcap-ros2-support`` and
compared to the stored steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gateway.trajectory import StepRows, assemble_episodes
from trainer.replay.log import LOG_DIR, ReplayLog, read_log

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
H, W = 32, 48


def frame(episode: int, step: int) -> np.ndarray:
    """A smooth picture (codecs keep it well) that differs by episode and step."""
    y, x = np.mgrid[0:H, 0:W]
    img = np.stack([x * 4 + step * 3, y * 6 + episode * 40, (x + y) * 2], axis=-1)
    return (img % 256).astype(np.uint8)


def make_run(run_dir: Path, episodes: int = 3, steps: int = 12) -> None:
    replay_log = ReplayLog(run_dir / LOG_DIR, fsync="never")
    chunks = []
    for e in range(episodes):
        rows = StepRows(f"w0-{e}-0", "w0", e, "reach", eval=e == 2)
        for s in range(steps):
            last = s == steps - 1
            rows.add(
                {
                    "joint_pos": np.array([s, e, 0.5], np.float32),
                    "joint_vel": np.array([0.1 * s, 0, -1], np.float32),
                    "target_rel": np.array([e, -s], np.float32),
                    "image": frame(e, s),
                },
                np.array([s, -s, e], np.float32),
                reward=-float(s),
                terminated=last and e == 0,
                truncated=last and e != 0,
                success=last and e == 0,
                policy_version=e,
                t_capture=1_800_000_000.0 + e * 10 + s * 0.05,
                t_action=1_800_000_000.0 + e * 10 + s * 0.05,
                step=s,
            )
            if (s + 1) % 5 == 0 or last:
                fo = {"joint_pos": np.zeros(3, np.float32), "joint_vel": np.zeros(3, np.float32)}
                fo |= {"target_rel": np.zeros(2, np.float32), "image": frame(e, steps)}
                chunks.append(
                    rows.take(len(rows)).to_chunk(
                        end=("terminated" if e == 0 else "truncated") if last else None,
                        final_obs=fo if last else None,
                    )
                )
    replay_log.append_group(chunks)
    replay_log.append_group(chunks[:2])  # resent chunks are stored once
    replay_log.close()
    (run_dir / "spec.json").write_text(json.dumps({"name": "reach", "control_hz": 20.0}))


def export(run_dir: Path, fmt: str, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", str(run_dir), "--format", fmt, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    make_run(run)
    return run


def stored_episodes(run_dir: Path):
    return assemble_episodes(list(read_log(run_dir / LOG_DIR)))


def test_lerobot_export_reads_back_as_the_stored_steps(run_dir, tmp_path):
    import av
    import pyarrow.parquet as pq

    out = tmp_path / "lerobot"
    result = export(run_dir, "lerobot", out)
    episodes = stored_episodes(run_dir)
    assert result["episodes"] == 3 and result["frames"] == 36
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 20.0 and info["total_frames"] == 36
    assert info["features"]["observation.images.image"]["dtype"] == "video"
    names = info["features"]["observation.state"]["names"]
    assert names[:3] == ["joint_pos_0", "joint_pos_1", "joint_pos_2"]

    data = pq.read_table(out / info["data_path"].format(chunk_index=0, file_index=0)).to_pydict()
    meta = pq.read_table(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    tasks = pq.read_table(out / "meta" / "tasks.parquet")
    assert tasks.to_pydict() == {"task_index": [0], "task": ["reach"]}
    # pandas (how LeRobot reads it) takes the task text as the index
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    assert [m["length"] for m in meta] == [ep.num_steps for ep in episodes]
    for index, (ep, m) in enumerate(zip(episodes, meta)):
        rows = slice(m["dataset_from_index"], m["dataset_to_index"])
        assert data["episode_index"][rows] == [index] * ep.num_steps
        state = np.asarray(data["observation.state"][rows], np.float32)
        want = np.concatenate(
            [ep.arrays[f"obs/{k}"] for k in ("joint_pos", "joint_vel", "target_rel")], axis=1
        )
        np.testing.assert_array_equal(state, want)
        np.testing.assert_array_equal(np.asarray(data["action"][rows], np.float32), ep.arrays["action"])
        np.testing.assert_array_equal(np.asarray(data["next.reward"][rows], np.float32), ep.arrays["reward"])
        assert data["next.done"][rows][-1] is True and m["loopgate/eval"] == (index == 2)
    assert data["index"] == list(range(36))

    video = out / info["video_path"].format(video_key="observation.images.image", chunk_index=0, file_index=0)
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 36 and frames[0].shape == (H, W, 3)
    for ep, m in zip(episodes, meta):
        start = round(m["videos/observation.images.image/from_timestamp"] * 20)
        for s in (0, ep.num_steps - 1):
            err = np.abs(frames[start + s].astype(int) - ep.arrays["obs/image"][s].astype(int)).mean()
            assert err < 8, f"frame {start + s} differs by {err:.1f} on average"


def test_mcap_export_reads_back_as_ros2_messages(run_dir, tmp_path):
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    result = export(run_dir, "mcap", tmp_path / "out.mcap")
    episodes = stored_episodes(run_dir)
    by_topic: dict[str, list] = {}
    with open(result["path"], "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        for schema, channel, message, decoded in reader.iter_decoded_messages():
            by_topic.setdefault(channel.topic, []).append((schema.name, message.log_time, decoded))
    total = sum(ep.num_steps for ep in episodes)
    assert {t: len(v) for t, v in by_topic.items()} == {
        "/episode": 3,
        "/joint_states": total,
        "/camera/image/image_raw": total,
        "/observation/target_rel": total,
        "/action": total,
        "/reward": total,
    }
    assert by_topic["/joint_states"][0][0] == "sensor_msgs/msg/JointState"
    assert by_topic["/camera/image/image_raw"][0][0] == "sensor_msgs/msg/Image"
    joints = [d for _, _, d in by_topic["/joint_states"]]
    images = [d for _, _, d in by_topic["/camera/image/image_raw"]]
    actions = [d for _, _, d in by_topic["/action"]]
    rewards = [d for _, _, d in by_topic["/reward"]]
    i = 0
    for ep in episodes:
        for s in range(ep.num_steps):
            assert joints[i].header.frame_id == ep.episode_id
            np.testing.assert_allclose(joints[i].position, ep.arrays["obs/joint_pos"][s])
            np.testing.assert_allclose(joints[i].velocity, ep.arrays["obs/joint_vel"][s], rtol=1e-6)
            img = np.frombuffer(bytes(images[i].data), np.uint8).reshape(images[i].height, images[i].width, 3)
            np.testing.assert_array_equal(img, ep.arrays["obs/image"][s])
            assert images[i].encoding == "rgb8"
            np.testing.assert_array_equal(np.asarray(actions[i].data, np.float32), ep.arrays["action"][s])
            assert rewards[i].data == pytest.approx(float(ep.arrays["reward"][s]))
            i += 1
    first = json.loads(by_topic["/episode"][2][2].data)
    assert first["eval"] is True and first["end"] == "truncated"
    times = [t for _, t, _ in by_topic["/reward"]]
    assert times == sorted(times)


def test_export_of_a_folder_without_data_fails_clearly(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "export",
            str(tmp_path),
            "--format",
            "mcap",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2 and "not a run folder" in done.stderr
