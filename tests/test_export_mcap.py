# ruff: noqa: F811 - pytest fixtures imported from test_export are test parameters here
"""``loopgate export --format mcap``: every message at its step's capture time, one
namespace per env, read back with ``mcap_ros2``'s own decoder. The runs are those of
:mod:`tests.test_export` (a synthetic one and a real camera run, 2 workers x 4 envs).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_export import (  # noqa: F401 - pytest fixtures used as test parameters
    ENVS,
    EPISODES,
    WORKERS,
    camera_run,
    env_of,
    export,
    ns_of,
    read_mcap,
    synthetic_run,
)
from trainer.replay.export import run_episodes

pytestmark = pytest.mark.integration


def test_mcap_export_reads_back_as_ros2_messages(synthetic_run, tmp_path):
    result, _ = export(synthetic_run, "mcap", tmp_path / "out.mcap")
    episodes = run_episodes(synthetic_run)
    messages, metadata = read_mcap(result["path"])
    assert len(messages) == result["messages"]
    envs = {ns: json.loads(v) for ns, v in metadata["loopgate.envs"].items()}
    ns = {(v["worker"], v["env"]): k for k, v in envs.items()}
    assert sorted(ns) == sorted({env_of(ep) for ep in episodes})
    by_topic: dict[str, list] = {}
    for topic, schema, _, _, decoded in messages:
        by_topic.setdefault(topic, []).append((schema, decoded))
    expected = {}
    for env, space in ns.items():
        steps = sum(ep.num_steps for ep in episodes if env_of(ep) == env)
        expected[f"{space}/episode"] = EPISODES
        for topic in ("joint_states", "camera/image/image_raw", "observation/target_rel", "action", "reward"):
            expected[f"{space}/{topic}"] = steps
    assert {t: len(v) for t, v in by_topic.items()} == expected
    for ep in episodes:
        space = ns[env_of(ep)]
        assert by_topic[f"{space}/joint_states"][0][0] == "sensor_msgs/msg/JointState"
        assert by_topic[f"{space}/camera/image/image_raw"][0][0] == "sensor_msgs/msg/Image"
        joint_states = [d for _, d in by_topic[f"{space}/joint_states"] if d.header.frame_id == ep.episode_id]
        images = [
            d for _, d in by_topic[f"{space}/camera/image/image_raw"] if d.header.frame_id == ep.episode_id
        ]
        # an env's episodes follow one another, so its messages without a header do too
        base = sum(e.num_steps for e in episodes[: episodes.index(ep)] if env_of(e) == env_of(ep))
        actions = [d for _, d in by_topic[f"{space}/action"]][base : base + ep.num_steps]
        rewards = [d for _, d in by_topic[f"{space}/reward"]][base : base + ep.num_steps]
        assert len(joint_states) == len(images) == ep.num_steps
        for s in range(ep.num_steps):
            joints, image = joint_states[s], images[s]
            np.testing.assert_allclose(joints.position, ep.arrays["obs/joint_pos"][s])
            np.testing.assert_allclose(joints.velocity, ep.arrays["obs/joint_vel"][s], rtol=1e-6)
            img = np.frombuffer(bytes(image.data), np.uint8).reshape(image.height, image.width, 3)
            np.testing.assert_array_equal(img, ep.arrays["obs/image"][s])
            assert image.encoding == "rgb8"
            np.testing.assert_array_equal(np.asarray(actions[s].data, np.float32), ep.arrays["action"][s])
            assert rewards[s].data == pytest.approx(float(ep.arrays["reward"][s]))
    infos = [json.loads(d.data) for t, v in by_topic.items() if t.endswith("/episode") for _, d in v]
    assert {i["episode_id"] for i in infos if i["eval"]} == {f"w{w}-3-1" for w in range(WORKERS)}
    assert {i["episode_id"]: i["end"] for i in infos}["w1-0-0"] == "terminated"


@pytest.mark.parametrize("run_name", ["synthetic_run", "camera_run"])
def test_mcap_stamps_every_message_with_its_steps_capture_time_one_env_per_namespace(
    run_name, request, tmp_path
):
    run = request.getfixturevalue(run_name)
    result, _ = export(run, "mcap", tmp_path / "out.mcap")
    episodes = run_episodes(run)
    by_id = {ep.episode_id: ep for ep in episodes}
    messages, metadata = read_mcap(result["path"])
    assert len(messages) == result["messages"] > 0
    envs = {ns: tuple(json.loads(v).values()) for ns, v in metadata["loopgate.envs"].items()}
    assert len(envs) == len({env_of(ep) for ep in episodes}) == WORKERS * ENVS
    times = [m[2] for m in messages]
    assert times == sorted(times)  # written in time order, parallel envs interleaved
    per_topic: dict[str, list[tuple[str, int]]] = {}
    for topic, _, log_time, publish_time, decoded in messages:
        space = "/" + topic.split("/")[1]
        assert space in envs, topic
        assert publish_time == log_time
        if hasattr(decoded, "header"):
            assert decoded.header.stamp.sec * 10**9 + decoded.header.stamp.nanosec == log_time
            episode_id = decoded.header.frame_id
            assert env_of(by_id[episode_id]) == envs[space]  # no other env on this namespace
        per_topic.setdefault(topic, []).append(log_time)
    for space, env in envs.items():
        mine = sorted((ep for ep in episodes if env_of(ep) == env), key=lambda ep: ep.arrays["t_capture"][0])
        captured = list(np.concatenate([ns_of(ep.arrays["t_capture"]) for ep in mine]))
        starts = [ns_of(ep.arrays["t_capture"][0])[0] for ep in mine]
        assert per_topic[f"{space}/episode"] == starts
        for topic in ("joint_states", "camera/image/image_raw", "action", "reward"):
            assert per_topic[f"{space}/{topic}"] == captured, f"{space}/{topic}"


# ------------------------------------------------------------------------- the CLI
