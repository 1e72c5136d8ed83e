"""The export's statistics and video encoder, against LeRobot's own figures.

LeRobot 0.6.1 wrote the reference dataset in ``../shared/fixtures/lerobot_v3_reference``
(12 episodes, its own per-episode and dataset stats): the export's stats of the same
frames must match them, and its aggregation must reproduce the dataset's stats from the
episodes'. Each test here works on arrays or on that dataset, with no run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

REFERENCE = REPO.parent / "shared" / "fixtures" / "lerobot_v3_reference"
STATS = ["min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"]


def read_parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    return pq.read_table(path)


def test_episode_stats_match_lerobots_own_on_the_reference_frames():
    from trainer.replay.export_stats import STAT_NAMES, feature_stats

    data = read_parquet(REFERENCE / "data" / "chunk-000" / "file-000.parquet").to_pydict()
    rows = read_parquet(REFERENCE / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    features = [k for k, ft in json.loads((REFERENCE / "meta" / "info.json").read_text())["features"].items()]
    features = [k for k in features if k in data]
    assert len(features) == 11 and len(rows) == 12
    for row in rows:
        frames = slice(row["dataset_from_index"], row["dataset_to_index"])
        for feature in features:
            mine = feature_stats(np.asarray(data[feature][frames]))
            assert list(mine) == STATS
            ref = {k: np.asarray(row[f"stats/{feature}/{k}"], np.float64) for k in STAT_NAMES}
            # LeRobot works in float32 for float32 features; a histogram bin is span / 5000
            span = np.maximum(ref["max"] - ref["min"], 1e-3)
            for name in ("min", "max", "q01", "q10", "q50", "q90", "q99"):
                assert mine[name].shape == ref[name].shape, (feature, name)
                assert np.all(np.abs(mine[name] - ref[name]) <= 1e-5 * span), (feature, name)
            np.testing.assert_allclose(mine["mean"], ref["mean"], rtol=1e-5, atol=1e-6, err_msg=feature)
            varying = ref["max"] > ref["min"]  # float32 E[x^2] - E[x]^2 is noise where x is constant
            np.testing.assert_allclose(
                mine["std"][varying], ref["std"][varying], rtol=1e-3, atol=1e-6, err_msg=feature
            )
            assert mine["count"].tolist() == ref["count"].tolist() == [row["length"]]


def test_constant_columns_at_a_large_magnitude_have_their_value_as_every_quantile():
    """An episode's ``episode_index`` (or ``index``) column is constant, and from 256 on its
    padded span (2e-10) holds fewer than 5000 representable steps: numpy refused the
    histogram ("Too many bins for data range") and the export of any run of more than
    256 episodes failed. The edges are laid out as LeRobot lays them out."""
    from trainer.replay.export_stats import feature_stats

    for value in (255, 256, 9_375, 468_255, 2.0**40):
        stats = feature_stats(np.full(50, value, np.int64))
        for name in ("min", "max", "mean", "q01", "q10", "q50", "q90", "q99"):
            assert np.allclose(stats[name], value, rtol=1e-12, atol=1e-9), (value, name, stats[name])
    # A varying column keeps its quantiles, whatever the magnitude.
    ramp = 1e6 + np.arange(1001, dtype=np.float64)
    stats = feature_stats(ramp)
    assert abs(stats["q50"][0] - 1e6 - 500) <= 0.5 and abs(stats["q99"][0] - 1e6 - 990) <= 0.5


def test_image_stats_sample_long_episodes_and_large_frames_as_lerobot_does():
    from trainer.replay.export_stats import image_stats, sample_frame_indices

    # LeRobot's own table: up to ~500 frames 100 samples, 1000 -> 177, 2000 -> 299, 5000 -> 594
    assert sample_frame_indices(60).tolist() == list(range(60))
    for n, want in ((400, 100), (1000, 177), (2000, 299), (5000, 594)):
        picked = sample_frame_indices(n)
        assert len(picked) == want and picked[0] == 0 and picked[-1] == n - 1
    frames = np.zeros((1000, 4, 4, 3), np.uint8)
    frames[sample_frame_indices(1000)] = 255
    stats = image_stats(frames)
    assert stats["count"].tolist() == [177] and stats["min"].shape == (3, 1, 1)
    np.testing.assert_allclose(stats["min"], 1.0)  # only the sampled frames count
    large = np.zeros((2, 480, 640, 3), np.uint8)
    large[:, ::4, ::4] = 255  # 640 px wide: LeRobot looks at every 4th pixel
    stats = image_stats(large)
    np.testing.assert_allclose(stats["min"], 1.0)
    np.testing.assert_allclose(stats["q01"], 1.0)


def test_aggregation_reproduces_lerobots_dataset_stats_from_its_episode_stats():
    from trainer.replay.export_stats import aggregate_stats

    rows = read_parquet(REFERENCE / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    ref = json.loads((REFERENCE / "meta" / "stats.json").read_text())
    parts = [{f: {s: np.asarray(row[f"stats/{f}/{s}"]) for s in STATS} for f in ref} for row in rows]
    mine = aggregate_stats(parts)
    assert set(mine) == set(ref)
    for feature, stats in ref.items():
        for name, value in stats.items():
            np.testing.assert_allclose(mine[feature][name], value, rtol=1e-7, err_msg=f"{feature} {name}")


def test_av1_encoder_is_quiet_until_it_fails(tmp_path, capfd, caplog, monkeypatch):
    import av

    from trainer.replay.export_video import VideoEncoder, encode

    monkeypatch.delenv("SVT_LOG", raising=False)
    encoder = VideoEncoder(codec="libsvtav1", crf=30, preset=12)
    encode(np.zeros((4, 8, 8, 3), np.uint8), tmp_path / "ok.mp4", fps=20, encoder=encoder)
    assert "Svt[" not in capfd.readouterr().err
    with pytest.raises(av.FFmpegError):
        # Wider than SVT-AV1 takes (16 384): refused by the encoder itself in every PyAV
        # build (2x2 frames, used before, are padded and encoded by PyAV 18.1.1's).
        encode(np.zeros((2, 8, 16_392, 3), np.uint8), tmp_path / "bad.mp4", fps=20, encoder=encoder)
    assert "Svt[error]" in capfd.readouterr().err  # too wide for SVT-AV1: it says so
    assert "libsvtav1" in caplog.text and "failed" in caplog.text
