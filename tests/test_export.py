"""``loopgate export``: LeRobot v3 and MCAP files read back with their own readers.

Two runs are exported. ``camera_run`` is a real one: ``loopgate up`` with the scripted
PD controller on 2 workers x 4 MuJoCo reach envs with the 84x84 camera, so episodes of
different envs overlap in time and the LeRobot features are those of the LeRobot 0.6.1
reference dataset in ``../shared/fixtures/lerobot_v3_reference`` (12 episodes written
by LeRobot's own writer), which the export's layout is compared against key by key.
``synthetic_run`` is built the way the replay service stores chunks (its durable log,
``spec.json`` beside it, a resent chunk, evaluation episodes), also 2 workers x 4 envs
stepping in parallel, with pictures whose values the tests know.
"""

from __future__ import annotations

import itertools
import json
import os
import pty
import select
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.trajectory import Episode, StepRows
from tests.conftest import REPO, loopgate
from tests.test_export_stats import REFERENCE, STATS, read_parquet
from trainer.replay.export import run_episodes
from trainer.replay.log import LOG_DIR, ReplayLog

pytestmark = pytest.mark.integration

H, W = 32, 48
WORKERS, ENVS, EPISODES, STEPS = 2, 4, 2, 12
T0 = 1_800_000_000.0
ENCODER_INFO_KEYS = {
    f"video.{k}" for k in ("g", "crf", "preset", "fast_decode", "extra_options", "video_backend")
}
"""Video info keys LeRobot ignores when it checks two datasets' features are the same."""


def frame(episode: int, step: int) -> np.ndarray:
    """A smooth picture (codecs keep it well) that differs by episode and step."""
    y, x = np.mgrid[0:H, 0:W]
    img = np.stack([x * 4 + step * 3, y * 6 + episode * 40, (x + y) * 2], axis=-1)
    return (img % 256).astype(np.uint8)


def make_run(run_dir: Path) -> None:
    """Two workers of four envs stepping together; chunks stored one episode after another."""
    replay_log = ReplayLog(run_dir / LOG_DIR, fsync="never")
    chunks = []
    for w in range(WORKERS):
        for env in range(ENVS):
            for e in range(EPISODES):
                n = w * ENVS * EPISODES + env * EPISODES + e
                rows = StepRows(f"w{w}-{env}-{e}", f"w{w}", env, "reach", eval=(env, e) == (3, 1))
                for s in range(STEPS):
                    last = s == STEPS - 1
                    # envs of one worker share a capture time; workers are 13 ms apart
                    t = T0 + w * 0.013 + (e * STEPS + s) * 0.05
                    rows.add(
                        {
                            "joint_pos": np.array([s, n, 0.5], np.float32),
                            "joint_vel": np.array([0.1 * s, 0, -1], np.float32),
                            "target_rel": np.array([n, -s], np.float32),
                            "image": frame(n, s),
                        },
                        np.array([s, -s, n], np.float32),
                        reward=-float(s),
                        terminated=last and env == 0,
                        truncated=last and env != 0,
                        success=last and env == 0,
                        policy_version=e,
                        t_capture=t,
                        t_action=t + 0.002,
                        step=s,
                    )
                    if (s + 1) % 5 == 0 or last:
                        fo = {"joint_pos": np.zeros(3, np.float32), "joint_vel": np.zeros(3, np.float32)}
                        fo |= {"target_rel": np.zeros(2, np.float32), "image": frame(n, STEPS)}
                        chunks.append(
                            rows.take(len(rows)).to_chunk(
                                end=("terminated" if env == 0 else "truncated") if last else None,
                                final_obs=fo if last else None,
                            )
                        )
    replay_log.append_group(chunks)
    replay_log.append_group(chunks[:2])  # resent chunks are stored once
    replay_log.close()
    (run_dir / "spec.json").write_text(json.dumps({"name": "reach", "control_hz": 20.0}))


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("synthetic") / "run"
    make_run(run)
    return run


@pytest.fixture(scope="module")
def camera_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real collection run: 2 workers x 4 envs, camera on, 20-step episodes."""
    run = tmp_path_factory.mktemp("camera") / "run"
    out = loopgate(
        "up", "configs/collect_pd.yaml", "--run-dir", str(run), "--max-env-steps", "480",
        "--set", f"env.workers={WORKERS}", "--set", f"env.num_envs={ENVS}",
        "--set", "env.options.camera=true", "--set", "env.options.max_episode_steps=20",
        env={"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(params=["synthetic_run", "camera_run"])
def any_run(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


def export(run_dir: Path, fmt: str, out: Path, *flags: str) -> tuple[dict[str, Any], str]:
    """Run ``loopgate export``; its JSON summary and its stderr."""
    done = loopgate("export", str(run_dir), "--format", fmt, str(out), *flags, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def env_of(ep: Episode) -> tuple[str, int]:
    return (ep.meta["worker"], ep.meta["env"])


def ns_of(ts: np.ndarray | float) -> np.ndarray:
    """Unix times as integer nanoseconds, rounded from their exact binary values."""
    return np.array([int(Decimal(float(t)).scaleb(9).to_integral_value()) for t in np.atleast_1d(ts)])


# ------------------------------------------------------------------- the run itself


def test_camera_run_has_parallel_envs_whose_episodes_overlap(camera_run):
    episodes = run_episodes(camera_run)
    envs = {env_of(ep) for ep in episodes}
    assert len({w for w, _ in envs}) == WORKERS and len(envs) == WORKERS * ENVS
    spans = sorted((ep.arrays["t_capture"][0], ep.arrays["t_capture"][-1], env_of(ep)) for ep in episodes)
    overlapping = sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1] and a[2] != b[2])
    assert overlapping >= WORKERS * ENVS
    assert "image" in {k[4:] for k in episodes[0].arrays if k.startswith("obs/")}


# ------------------------------------------------------------------------- LeRobot


def test_lerobot_export_reads_back_as_the_stored_steps(any_run, tmp_path):
    import av

    out = tmp_path / "lerobot"
    result, stderr = export(any_run, "lerobot", out)
    episodes = run_episodes(any_run)
    total = sum(ep.num_steps for ep in episodes)
    assert result["episodes"] == len(episodes) and result["frames"] == total
    assert "Svt[" not in stderr  # the AV1 encoder's banner stays out of the way
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 20 and info["total_frames"] == total
    assert info["features"]["observation.images.image"]["dtype"] == "video"
    state_keys = sorted(k[4:] for k in episodes[0].arrays if k.startswith("obs/") and k != "obs/image")
    widths = {k: episodes[0].arrays[f"obs/{k}"].shape[1] for k in state_keys}
    names = [f"{k}_{i}" for k in state_keys for i in range(widths[k])]
    assert info["features"]["observation.state"]["names"] == names

    data = read_parquet(out / info["data_path"].format(chunk_index=0, file_index=0)).to_pydict()
    meta = read_parquet(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    tasks = read_parquet(out / "meta" / "tasks.parquet")
    assert tasks.to_pydict() == {"task_index": [0], "task": ["reach"]}
    # pandas (how LeRobot reads it) takes the task text as the index
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    assert [m["length"] for m in meta] == [ep.num_steps for ep in episodes]
    for index, (ep, m) in enumerate(zip(episodes, meta)):
        rows = slice(m["dataset_from_index"], m["dataset_to_index"])
        assert data["episode_index"][rows] == [index] * ep.num_steps
        assert data["frame_index"][rows] == list(range(ep.num_steps))
        state = np.asarray(data["observation.state"][rows], np.float32)
        want = np.concatenate([ep.arrays[f"obs/{k}"].reshape(ep.num_steps, -1) for k in state_keys], axis=1)
        np.testing.assert_array_equal(state, want)
        np.testing.assert_array_equal(np.asarray(data["action"][rows], np.float32), ep.arrays["action"])
        np.testing.assert_array_equal(np.asarray(data["next.reward"][rows], np.float32), ep.arrays["reward"])
        assert data["next.done"][rows][-1] is (ep.end in ("terminated", "truncated"))
        assert m["loopgate/episode_id"] == ep.episode_id and m["loopgate/eval"] == bool(ep.meta["eval"])
        assert (m["loopgate/worker"], m["loopgate/env"]) == env_of(ep) and m["loopgate/source"] == "online"
    assert data["index"] == list(range(total))

    video = out / info["video_path"].format(video_key="observation.images.image", chunk_index=0, file_index=0)
    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == total and frames[0].shape == episodes[0].arrays["obs/image"].shape[1:]
    for ep, m in zip(episodes, meta):
        start = round(m["videos/observation.images.image/from_timestamp"] * 20)
        assert round(m["videos/observation.images.image/to_timestamp"] * 20) == start + ep.num_steps
        for s in (0, ep.num_steps - 1):
            err = np.abs(frames[start + s].astype(int) - ep.arrays["obs/image"][s].astype(int)).mean()
            assert err < 8, f"frame {start + s} differs by {err:.1f} on average"


@pytest.fixture(scope="module")
def camera_export(camera_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("camera_export") / "lerobot"
    export(camera_run, "lerobot", out)
    return out


def test_lerobot_info_has_every_key_lerobot_writes_with_the_same_features(camera_export):
    ref = json.loads((REFERENCE / "meta" / "info.json").read_text())
    got = json.loads((camera_export / "meta" / "info.json").read_text())
    assert list(got) == list(ref)
    for key in set(ref) - {"features", "total_episodes", "total_frames", "splits"}:
        assert got[key] == ref[key], key
    assert got["splits"] == {"train": f"0:{got['total_episodes']}"}
    # LeRobot merges two datasets only if their features are equal but for encoder settings
    assert list(got["features"]) == list(ref["features"])
    for key, feature in ref["features"].items():
        mine = dict(got["features"][key])
        if feature["dtype"] == "video":
            assert list(mine["info"]) == list(feature["info"])
            assert "video.is_depth_map" not in mine["info"] and mine["info"]["is_depth_map"] is False
            mine["info"] = {k: v for k, v in mine["info"].items() if k not in ENCODER_INFO_KEYS}
            feature = feature | {
                "info": {k: v for k, v in feature["info"].items() if k not in ENCODER_INFO_KEYS}
            }
        assert mine == feature, key


def test_lerobot_stats_have_lerobots_names_and_shapes(camera_export):
    ref = json.loads((REFERENCE / "meta" / "stats.json").read_text())
    got = json.loads((camera_export / "meta" / "stats.json").read_text())
    assert set(got) == set(ref)
    for feature, stats in ref.items():
        assert list(got[feature]) == list(stats) == STATS, feature
        for name, value in stats.items():
            assert np.shape(got[feature][name]) == np.shape(value), (feature, name)
    assert np.shape(got["observation.images.image"]["q01"]) == (3, 1, 1)


def test_lerobot_files_have_the_columns_types_and_row_groups_lerobot_writes(camera_export):
    import pyarrow.parquet as pq

    ref = read_parquet(REFERENCE / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    got = read_parquet(camera_export / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert [n for n in got.schema.names if not n.startswith("loopgate/")] == ref.schema.names
    for name in ref.schema.names:
        assert got.schema.field(name).type == ref.schema.field(name).type, name
    stats_columns = [n for n in ref.schema.names if n.startswith("stats/")]
    assert len(stats_columns) == len(STATS) * 12
    ref_row, rows = ref.slice(0, 1).to_pylist()[0], got.to_pylist()
    for row in rows:
        for name in stats_columns:
            assert np.shape(row[name]) == np.shape(ref_row[name]), name
    assert all(row["stats/observation.state/count"] == [row["length"]] for row in rows)

    for path in ("data/chunk-000/file-000.parquet", "meta/tasks.parquet"):
        ref_file, got_file = pq.ParquetFile(REFERENCE / path), pq.ParquetFile(camera_export / path)
        assert got_file.schema_arrow.remove_metadata() == ref_file.schema_arrow.remove_metadata(), path
    data_ref = pq.ParquetFile(REFERENCE / "data/chunk-000/file-000.parquet")
    data_got = pq.ParquetFile(camera_export / "data/chunk-000/file-000.parquet")
    assert data_got.num_row_groups == len(rows)  # one per episode, as LeRobot writes them
    hf_ref = json.loads(data_ref.schema_arrow.metadata[b"huggingface"])["info"]
    assert json.loads(data_got.schema_arrow.metadata[b"huggingface"])["info"] == hf_ref


def _aggregate(parts: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """LeRobot's rule for dataset stats from episode stats, written out independently."""
    n = np.array([p["count"][0] for p in parts], np.float64)
    total = n.sum()

    def weighted(key: str) -> np.ndarray:
        values = np.array([p[key] for p in parts], np.float64)
        return np.tensordot(n, values, axes=1) / total

    mean = weighted("mean")
    second = np.tensordot(
        n, np.array([np.square(p["std"]) + np.square(p["mean"]) for p in parts], np.float64), axes=1
    )
    out = {
        "min": np.min([p["min"] for p in parts], axis=0),
        "max": np.max([p["max"] for p in parts], axis=0),
        "mean": mean,
        "std": np.sqrt(second / total - mean**2),
        "count": np.array([total]),
    }
    return out | {q: weighted(q) for q in STATS[5:]}


def test_lerobot_episode_stats_aggregate_to_the_dataset_stats(camera_run, camera_export):
    info = json.loads((camera_export / "meta" / "info.json").read_text())
    dataset = json.loads((camera_export / "meta" / "stats.json").read_text())
    rows = read_parquet(camera_export / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    data = read_parquet(camera_export / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    episodes = run_episodes(camera_run)
    for feature, ft in info["features"].items():
        parts = [{s: row[f"stats/{feature}/{s}"] for s in STATS} for row in rows]
        for stat, value in _aggregate(parts).items():
            np.testing.assert_allclose(dataset[feature][stat], value, rtol=1e-9, atol=1e-12, err_msg=feature)
        for part in parts:
            q = np.array([part[s] for s in STATS[5:]])
            assert np.all(np.diff(q, axis=0) >= 0), f"{feature} quantiles out of order"
            assert np.all(q >= np.array(part["min"]) - 1e-9) and np.all(q <= np.array(part["max"]) + 1e-9)
        if ft["dtype"] == "video":
            for part, ep in zip(parts, episodes):
                pixels = ep.arrays["obs/image"].reshape(-1, 3) / 255.0
                np.testing.assert_allclose(np.ravel(part["mean"]), pixels.mean(axis=0), rtol=1e-9)
                np.testing.assert_allclose(np.ravel(part["min"]), pixels.min(axis=0))
                assert part["count"] == [ep.num_steps]
            continue
        # the dataset's stats are those of every frame in the dataset
        frames = np.asarray(data[feature], np.float64).reshape(info["total_frames"], -1)
        np.testing.assert_allclose(dataset[feature]["mean"], frames.mean(axis=0), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(dataset[feature]["std"], frames.std(axis=0), rtol=1e-6, atol=1e-9)
        np.testing.assert_array_equal(dataset[feature]["min"], frames.min(axis=0))
        np.testing.assert_array_equal(dataset[feature]["max"], frames.max(axis=0))
        assert dataset[feature]["count"] == [info["total_frames"]]


# ---------------------------------------------------------------------------- MCAP


def read_mcap(path: str) -> tuple[list[tuple[str, str, int, int, Any]], dict[str, dict[str, str]]]:
    """Every message in file order: (topic, schema, log_time, publish_time, decoded); metadata."""
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    with open(path, "rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        messages = [
            (channel.topic, schema.name, message.log_time, message.publish_time, decoded)
            for schema, channel, message, decoded in reader.iter_decoded_messages(log_time_order=False)
        ]
        metadata = {m.name: dict(m.metadata) for m in reader.iter_metadata()}
    return messages, metadata


def test_export_logs_progress_without_a_terminal_and_ends_with_a_summary(synthetic_run, tmp_path):
    _, stderr = export(synthetic_run, "lerobot", tmp_path / "lerobot")
    episodes = len(run_episodes(synthetic_run))
    frames = episodes * STEPS
    assert "\x1b[" not in stderr and "\r" not in stderr
    assert f"episodes {episodes}/{episodes}" in stderr
    assert f"video observation.images.image {frames}/{frames}" in stderr
    last = stderr.strip().splitlines()[-1]
    assert f"exported {episodes} episodes ({frames} frames" in last and str(tmp_path / "lerobot") in last


def test_export_draws_progress_bars_on_a_terminal(synthetic_run, tmp_path):
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "export",
            str(synthetic_run),
            "--format",
            "mcap",
            str(tmp_path / "o.mcap"),
        ],
        cwd=REPO,
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"},
    )
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # the follower side closed: the export is over
                break
            if not data:
                break
            screen += data
        assert proc.wait(timeout=30) == 0, screen.decode(errors="replace")[-2000:]
        stdout = proc.stdout.read() if proc.stdout else b""
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    text = screen.decode(errors="replace")
    steps = len(run_episodes(synthetic_run)) * STEPS
    assert "━" in text and f"{steps}/{steps}" in text  # rich's bar, completed
    assert "\x1b[" in text  # drawn in place
    assert "exported" in text.strip().splitlines()[-1]
    assert json.loads(stdout)["messages"] > 0


def test_export_flags_demonstrations_and_evaluations_or_leaves_them_out(tmp_path):
    from trainer.replay.ingest import import_into

    make_run(tmp_path / "earlier")
    make_run(tmp_path / "run")
    replay_log = ReplayLog(tmp_path / "run" / LOG_DIR, fsync="never")
    try:
        import_into(replay_log, tmp_path / "earlier", lambda chunk: None)
    finally:
        replay_log.close()
    online = WORKERS * ENVS * EPISODES
    evals = WORKERS  # env 3's second episode on each worker

    def episode_rows(out: Path) -> list[dict[str, Any]]:
        return read_parquet(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()

    result, _ = export(tmp_path / "run", "lerobot", tmp_path / "plain")
    rows = episode_rows(tmp_path / "plain")
    assert result["episodes"] == online and {r["loopgate/source"] for r in rows} == {"online"}
    assert sum(r["loopgate/eval"] for r in rows) == evals
    # evaluation episodes are never imported as demonstrations
    result, _ = export(tmp_path / "run", "lerobot", tmp_path / "demos", "--demos", "--no-eval")
    rows = episode_rows(tmp_path / "demos")
    assert result["episodes"] == 2 * (online - evals) and not any(r["loopgate/eval"] for r in rows)
    demos = [r for r in rows if r["loopgate/source"] == "demos"]
    assert len(demos) == online - evals and all(r["loopgate/episode_id"].startswith("demo:") for r in demos)
    result, _ = export(tmp_path / "run", "mcap", tmp_path / "demos.mcap", "--demos")
    messages, _ = read_mcap(result["path"])
    infos = [json.loads(m[4].data) for m in messages if m[0].endswith("/episode")]
    assert sorted(i["source"] for i in infos) == ["demos"] * (online - evals) + ["online"] * online


def test_export_of_a_folder_without_data_fails_clearly(tmp_path):
    done = loopgate("export", str(tmp_path), "--format", "mcap", str(tmp_path / "o"), timeout=60)
    assert done.returncode == 2 and "not a run folder" in done.stderr


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> contents)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", ["lerobot", "mcap"])
def test_an_interrupted_export_leaves_the_previous_one_as_it_was(camera_run, tmp_path, fmt):
    """Exported once (and marked), then again into the same place and interrupted (Ctrl-C)
    halfway: the first export is still there, byte for byte, and nothing half-written is
    left beside it. Once an export completes, it replaces the first whole."""
    from trainer.replay.export import export as export_run

    out = tmp_path / ("dataset" if fmt == "lerobot" else "episodes.mcap")
    first = export_run(camera_run, fmt, out)
    assert first["path"] == str(out)
    if fmt == "lerobot":
        (out / "marker").write_text("the first export")
    else:
        out.write_bytes(out.read_bytes() + b"the first export")
    before = tree(tmp_path)

    def interrupt(phase: str, done: int, total: int) -> None:
        if done >= total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_run(camera_run, fmt, out, progress=interrupt)
    assert tree(tmp_path) == before
    again = export_run(camera_run, fmt, out)
    assert again == first
    after = tree(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    assert not any(b"the first export" in data or "marker" in name for name, data in after.items())


KILLED_EXPORT = """
import os, signal, sys
from trainer.replay import export as ex

run, fmt, out, where = sys.argv[1:]
if where == "halfway":
    def progress(phase, done, total):
        if done >= total // 2:
            os.kill(os.getpid(), signal.SIGKILL)
    ex.export(run, fmt, out, progress=progress)
else:  # between the swap's two renames: the previous export moved aside, the new one not in place
    rename = os.rename
    def rename_then_die(src, dst):
        rename(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename_then_die
    ex.export(run, fmt, out)
"""


@pytest.mark.parametrize(("fmt", "where"), [("lerobot", "halfway"), ("mcap", "halfway"), ("lerobot", "swap")])
def test_an_export_killed_outright_is_cleared_by_the_next_one(camera_run, tmp_path, fmt, where):
    """An export killed by SIGKILL (halfway through, or between the two renames that swap a
    finished dataset in) leaves hidden files beside its destination, and in the swap's case
    no destination at all. The next export puts the previous one back or removes what is
    left, then replaces it: the folder holds the destination alone, complete."""
    from trainer.replay.export import export as export_run

    out = tmp_path / ("dataset" if fmt == "lerobot" else "episodes.mcap")
    first = export_run(camera_run, fmt, out)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(camera_run), fmt, str(out), where],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert any(".partial-" in name or ".old-" in name for name in left), left
    assert (out.name in left) == (where == "halfway"), left
    again = export_run(camera_run, fmt, out)
    assert again == first
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


def test_the_leftovers_of_an_export_still_running_are_not_touched(tmp_path):
    """Only an export whose process is gone is cleared: a partial of a live process
    (another export writing to the same place) is kept."""
    from trainer.replay.export import sweep_leftovers

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        )
        live = tmp_path / f".dataset.partial-{sleeper.pid}"
        dead = tmp_path / f".dataset.partial-{int(gone.stdout)}"
        other = tmp_path / f".datasets.partial-{int(gone.stdout)}"  # another destination's
        for path in (live, dead, other):
            path.mkdir()
        sweep_leftovers(tmp_path / "dataset")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_export_refuses_a_folder_that_holds_something_else(synthetic_run, tmp_path):
    """The export replaces its folder whole, so a folder with other files (a mistyped
    path, a parent folder) is refused, untouched, with the reason."""
    out = tmp_path / "datasets"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    done = loopgate("export", str(synthetic_run), "--format", "lerobot", str(out), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds something other than a LeRobot dataset" in done.stderr
    assert tree(out) == {"notes.txt": b"mine"}
