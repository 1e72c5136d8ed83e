"""The run's record of the trainer's newest policy version, read without torch.

The publisher writes each version to ``<run>/checkpoints/published_version`` as it is
made, before anyone hears of it (:func:`record_published`); a restarted trainer continues
after it (:func:`last_published`), and ``summary.json`` names the newest of it and the
latest checkpoint's counters (:func:`final_version`): a stopped trainer publishes and
saves its last version after the gateway's last status.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PUBLISHED = "published_version"
"""The record's file name, under the run's ``checkpoints/``."""


def record_published(path: Path, version: int) -> None:
    """Keep ``version`` as the newest one published (replaced atomically: a killed
    process leaves the old number or the new one, never half of it)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(f"{version}\n")
    os.replace(tmp, path)


def last_published(path: Path) -> int:
    """The newest version :func:`record_published` kept under ``path``; 0 if none."""
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def final_version(checkpoints: Path) -> int:
    """The trainer's newest version in a run's ``checkpoints/``: the newest published (a
    trainer without inference servers publishes nothing) or the latest checkpoint's
    (``trainer.checkpoint.save`` writes its counters into ``latest``); 0 if neither."""
    try:
        saved = int(json.loads((checkpoints / "latest").read_text()).get("version", 0))
    except (FileNotFoundError, ValueError, AttributeError):
        saved = 0
    return max(saved, last_published(checkpoints / PUBLISHED))
