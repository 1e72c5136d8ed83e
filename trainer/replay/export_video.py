"""Camera frames as the MP4 videos of a LeRobot dataset, encoded the way LeRobot encodes them.

::

    encoder = pick_encoder()                 # libsvtav1 as LeRobot records, else H.264, MPEG-4
    encode(frames, path, fps=20, encoder=encoder)
    features[key]["info"] = encoder.info(frames.shape[1:], fps=20)

The AV1 encoder (SVT-AV1) prints a banner of ~25 lines to stderr each time it starts;
:func:`encode` keeps it to its errors (``SVT_LOG=1`` unless the caller set ``SVT_LOG``),
so a failing encode still says why, and the failure is logged with the encoder's
settings. With the right to real-time scheduling (root), SVT-AV1 puts its threads at
``SCHED_FIFO`` 99, above the control loop and the e-stop's path; :func:`encode` puts
them back at normal priority as soon as the encoder has opened
(:class:`gateway.priority.RealtimeGuard`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gateway.priority import RealtimeGuard

log = logging.getLogger(__name__)

CODEC_NAMES = {"libsvtav1": "av1", "libx264": "h264", "mpeg4": "mpeg4"}
"""PyAV encoder -> the codec name a reader of the file reports (``video.codec``)."""
SVT_ERRORS_ONLY = "1"
"""``SVT_LOG`` level of SVT-AV1 that prints errors and nothing else."""


@dataclass(frozen=True, kw_only=True)
class VideoEncoder:
    """Settings of one video encoder; the ``video.*`` keys LeRobot records come from them."""

    codec: str
    """PyAV encoder name (``libsvtav1``, ``libx264``, ``mpeg4``)."""
    g: int | None = 2
    """GOP size: a key frame every ``g`` frames, so random access decodes little."""
    crf: int | None = None
    """Constant rate factor (lower is better quality); ``None`` leaves the codec's default."""
    preset: int | str | None = None
    """Speed/quality preset of the codec; ``None`` leaves the codec's default."""
    fast_decode: int = 0
    """SVT-AV1 ``fast-decode`` level (0 off, up to 2)."""
    extra_options: dict[str, str] = field(default_factory=dict)
    """Further codec options, passed as they are."""

    def __post_init__(self) -> None:
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"codec: {self.codec!r} is not one of {sorted(CODEC_NAMES)}")
        if not 0 <= self.fast_decode <= 2:
            raise ValueError(f"fast_decode: {self.fast_decode!r} is not in 0..2")

    def options(self) -> dict[str, str]:
        opts = {"g": str(self.g)} if self.g is not None else {}
        if self.crf is not None:
            opts["crf"] = str(self.crf)
        if self.preset is not None:
            opts["preset"] = str(self.preset)
        if self.codec == "libsvtav1":
            opts["svtav1-params"] = f"fast-decode={self.fast_decode}"
        return opts | {k: v for k, v in self.extra_options.items() if k not in opts}

    def info(self, shape: tuple[int, ...], fps: float) -> dict[str, Any]:
        """The feature's ``info`` in ``meta/info.json``, with LeRobot 0.6's keys."""
        h, w, c = shape
        return {
            "video.height": h + h % 2,
            "video.width": w + w % 2,
            "video.codec": CODEC_NAMES[self.codec],
            "video.pix_fmt": "yuv420p",
            "video.fps": round(fps),
            "video.channels": c,
            "has_audio": False,
            "video.g": self.g,
            "video.crf": self.crf,
            "video.preset": self.preset,
            "video.fast_decode": self.fast_decode,
            "video.video_backend": "pyav",
            "video.extra_options": dict(self.extra_options),
            "is_depth_map": False,
        }


ENCODERS = (
    VideoEncoder(codec="libsvtav1", g=2, crf=30, preset=12),  # LeRobot's default
    VideoEncoder(codec="libx264", g=2, crf=18),
    VideoEncoder(codec="mpeg4", g=2),
)


def pick_encoder() -> VideoEncoder:
    """The first of :data:`ENCODERS` this PyAV build has."""
    import av

    for encoder in ENCODERS:
        try:
            av.codec.Codec(encoder.codec, "w")
            return encoder
        except Exception:  # PyAV raises several types for a codec it lacks
            continue
    raise RuntimeError(f"PyAV has none of the video encoders {[e.codec for e in ENCODERS]}")


def encode(
    frames: np.ndarray,
    path: Path,
    *,
    fps: float,
    encoder: VideoEncoder,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write u8 ``frames`` [N, H, W, 3] to ``path`` as one yuv420p video stream.

    ``progress(done, total)`` is called as frames go in.
    """
    import av

    # SVT-AV1 reads SVT_LOG once, when its first encoder starts in this process.
    os.environ.setdefault("SVT_LOG", SVT_ERRORS_ONLY)
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames.shape[1:3]
    # SVT-AV1 with the right to real-time scheduling puts its threads at SCHED_FIFO 99
    # when the encoder opens (the first frame): back to where they were, every frame.
    guard = RealtimeGuard(f"the video encoder ({encoder.codec})")
    try:
        with av.open(str(path), "w") as container:
            stream = container.add_stream(encoder.codec, rate=round(fps), options=encoder.options())
            stream.width, stream.height = w + w % 2, h + h % 2  # yuv420p needs even sizes
            stream.pix_fmt = "yuv420p"
            for done, frame in enumerate(frames, 1):
                if h % 2 or w % 2:
                    frame = np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
                picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                packets = stream.encode(picture)
                guard.restore()
                for packet in packets:
                    container.mux(packet)
                if progress is not None:
                    progress(done, len(frames))
            for packet in stream.encode():
                container.mux(packet)
    except av.FFmpegError:
        log.error("encoding %d frames of %dx%d to %s with %s failed", len(frames), w, h, path, encoder)
        raise
    finally:
        guard.restore()  # after the flush, and after an encoder that failed as it opened
