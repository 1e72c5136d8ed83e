"""Checkpoints with ``torch.distributed.checkpoint``: every rank saves its shards.

A checkpoint holds every network and optimizer of the algorithm, its extra tensors
(e.g. SAC's temperature) and the counters (updates, policy version, samples). It is
written under ``<run>/checkpoints/step-<updates>/`` and ``latest`` names the newest
complete one, so a trainer killed mid-save resumes from the previous one. DCP reshards
on load: a checkpoint taken with 2 processes loads with 1 (or 3).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.algos import Algorithm

log = logging.getLogger(__name__)
KEEP = 2


def _state(algo: Algorithm) -> dict[str, Any]:
    state: dict[str, Any] = {f"model/{name}": get_model_state_dict(m) for name, m in algo.modules().items()}
    for name, (module, opt) in algo.optimizers().items():
        state[f"optim/{name}"] = get_optimizer_state_dict(module, opt)
    state["extra"] = algo.extra_state()
    return state


def save(algo: Algorithm, directory: Path, counters: dict[str, int], *, is_main: bool) -> Path:
    """Save a checkpoint of ``algo`` with ``counters``; every rank must call this."""
    target = directory / f"step-{counters['updates']:09d}"
    state = _state(algo)
    state["counters"] = {k: torch.tensor(v) for k, v in counters.items()}
    dcp.save(state, checkpoint_id=str(target))
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        tmp = directory / "latest.tmp"
        tmp.write_text(json.dumps({"path": target.name, **counters}))
        os.replace(tmp, directory / "latest")  # atomic: a reader sees the old or the new
        for old in sorted(p for p in directory.glob("step-*") if p != target)[: -(KEEP - 1) or None]:
            shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s saved (%s)", target.name, counters)
    return target


def latest(directory: Path) -> Path | None:
    marker = directory / "latest"
    if not marker.exists():
        return None
    path = directory / json.loads(marker.read_text())["path"]
    return path if path.exists() else None


def load(algo: Algorithm, path: Path) -> dict[str, int]:
    """Load a checkpoint into ``algo`` (any number of processes); return its counters."""
    state = _state(algo)
    state["counters"] = {k: torch.tensor(0) for k in ("updates", "version", "samples")}
    dcp.load(state, checkpoint_id=str(path))
    for name, module in algo.modules().items():
        set_model_state_dict(module, state[f"model/{name}"])
    for name, (module, opt) in algo.optimizers().items():
        set_optimizer_state_dict(module, opt, state[f"optim/{name}"])
    algo.load_extra_state(state["extra"])
    counters = {k: int(v) for k, v in state["counters"].items()}
    log.info("resumed from %s: %s", path.name, counters)
    return counters
