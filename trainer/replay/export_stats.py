"""Feature statistics the way LeRobot computes and stores them: per episode, then aggregated.

LeRobot (0.6) keeps, for every feature, ``min``, ``max``, ``mean``, ``std``, ``count`` and
the quantiles ``q01``, ``q10``, ``q50``, ``q90``, ``q99``: per episode in
``meta/episodes`` (columns ``stats/<feature>/<stat>``) and over the whole dataset in
``meta/stats.json``. Its dataset tools rebuild ``stats.json`` from the episode columns
(after deleting or splitting episodes, when merging datasets) and its normalisers read
the quantiles, so an export follows the same rules::

    per_episode = [episode_stats(columns_of(ep), images_of(ep)) for ep in episodes]
    global_stats = aggregate_stats(per_episode)

- quantiles come from a 5000-bin histogram spanning each dimension's [min, max] (padded
  by 1e-10), interpolated linearly inside the bin that holds the target count;
- images: per channel over every pixel of the frames sampled from the episode (all
  frames up to 100, then ``n ** 0.75``; frames 300 px or larger are subsampled to about
  150 px), scaled to [0, 1], shape (C, 1, 1); their ``count`` is the frames sampled;
- vectors: per dimension, shape (D,); scalars and flags: shape (1,); ``count`` (1,);
- aggregation: means and quantiles weighted by count, pooled variance, min of the
  minima, max of the maxima.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

QUANTILES: dict[str, float] = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
STAT_NAMES = ("min", "max", "mean", "std", "count", *QUANTILES)
"""Every statistic of every feature, in the order LeRobot writes them."""
HISTOGRAM_BINS = 5000
EDGE_PAD = 1e-10

Stats = dict[str, np.ndarray]


def sample_frame_indices(n: int) -> np.ndarray:
    """Frames of an ``n``-frame episode that image statistics are computed over."""
    want = max(min(n, 100), min(int(n**0.75), 10_000))
    return np.round(np.linspace(0, n - 1, want)).astype(np.int64)


def _subsample(frames: np.ndarray) -> np.ndarray:
    """Frames [N, H, W, C] of 300 px or more thinned to about 150 px, as LeRobot does."""
    h, w = frames.shape[1:3]
    if max(h, w) < 300:
        return frames
    step = int(w / 150) if w > h else int(h / 150)
    return frames[:, ::step, ::step]


def _quantile(cumulative: np.ndarray, edges: np.ndarray, target: float) -> float:
    i = int(np.searchsorted(cumulative, target))
    if i == 0:
        return float(edges[0])
    if i >= len(cumulative):
        return float(edges[-1])
    before = cumulative[i - 1]
    # searchsorted puts target in (cumulative[i - 1], cumulative[i]]: the bin is not empty
    fraction = (target - before) / (cumulative[i] - before)
    return float(edges[i] + fraction * (edges[i + 1] - edges[i]))


def _rows_stats(rows: np.ndarray, count: int) -> Stats:
    """Statistics of ``rows`` [R, D] per column; ``count`` is what the rows stand for."""
    stats: Stats = {
        "min": rows.min(axis=0),
        "max": rows.max(axis=0),
        "mean": rows.mean(axis=0),
        "std": rows.std(axis=0),
        "count": np.array([count], np.int64),
    }
    if len(rows) < 2:  # no spread to interpolate in: LeRobot reports the mean
        stats |= {key: stats["mean"].copy() for key in QUANTILES}
        return stats
    quantiles = {key: np.empty(rows.shape[1]) for key in QUANTILES}
    for j in range(rows.shape[1]):
        # The edges as LeRobot lays them out, passed as an array: at a large magnitude the
        # padded span can be narrower than 5000 representable steps (an episode's constant
        # episode_index of 256 or more), where numpy refuses ``bins=5000, range=span``
        # ("Too many bins for data range") but takes repeated edges.
        edges = np.linspace(stats["min"][j] - EDGE_PAD, stats["max"][j] + EDGE_PAD, HISTOGRAM_BINS + 1)
        hist, _ = np.histogram(rows[:, j], bins=edges)
        cumulative = np.cumsum(hist)
        for key, q in QUANTILES.items():
            quantiles[key][j] = _quantile(cumulative, edges, q * len(rows))
    return stats | quantiles


def feature_stats(values: np.ndarray) -> Stats:
    """Statistics of one feature over one episode: ``values`` [N] or [N, D]."""
    v = np.asarray(values, np.float64)
    return _rows_stats(v.reshape(len(v), -1), len(v))


def image_stats(frames: np.ndarray) -> Stats:
    """Per-channel statistics of u8 ``frames`` [N, H, W, C], in [0, 1], shaped (C, 1, 1)."""
    sampled = _subsample(np.asarray(frames)[sample_frame_indices(len(frames))])
    channels = sampled.shape[-1]
    stats = _rows_stats(sampled.reshape(-1, channels).astype(np.float64), len(sampled))
    return {k: v if k == "count" else (v / 255.0).reshape(channels, 1, 1) for k, v in stats.items()}


def aggregate_feature(parts: Sequence[Mapping[str, np.ndarray]]) -> Stats:
    """One feature's statistics over several episodes from each episode's statistics."""
    counts = np.stack([np.asarray(p["count"], np.int64) for p in parts])  # [E, 1]
    means = np.stack([np.asarray(p["mean"], np.float64) for p in parts])
    total = counts.sum(axis=0)
    weights = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim)).astype(np.float64)
    mean = (means * weights).sum(axis=0) / total
    spread = np.stack([np.asarray(p["std"], np.float64) ** 2 for p in parts]) + (means - mean) ** 2
    out: Stats = {
        "min": np.min(np.stack([np.asarray(p["min"], np.float64) for p in parts]), axis=0),
        "max": np.max(np.stack([np.asarray(p["max"], np.float64) for p in parts]), axis=0),
        "mean": mean,
        "std": np.sqrt((spread * weights).sum(axis=0) / total),
        "count": total,
    }
    for key in QUANTILES:
        values = np.stack([np.asarray(p[key], np.float64) for p in parts])
        out[key] = (values * weights).sum(axis=0) / total
    return out


def aggregate_stats(episodes: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> dict[str, Stats]:
    """Dataset statistics from per-episode statistics (feature -> stat -> array)."""
    features = list(dict.fromkeys(f for ep in episodes for f in ep))
    return {f: aggregate_feature([ep[f] for ep in episodes if f in ep]) for f in features}


def to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, list[Any]]]:
    """Statistics as nested lists (``stats.json``, parquet columns)."""
    return {f: {k: np.asarray(v).tolist() for k, v in s.items()} for f, s in stats.items()}
