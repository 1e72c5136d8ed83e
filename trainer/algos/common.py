"""Pieces algorithms share: the finite-gradient guard, replicated-gradient averaging, Polyak updates."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def clip_and_check(module: nn.Module, max_norm: float) -> bool:
    """Clip gradients (FSDP-aware) and report whether their norm is finite."""
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return bool(torch.isfinite(norm).item())


def average_grad(param: torch.Tensor) -> None:
    """All-reduce a replicated (unsharded) parameter's gradient to the mean across ranks."""
    if param.grad is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= dist.get_world_size()


def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """``target <- (1 - tau) * target + tau * source``, parameter by parameter (shards too)."""
    # An FSDP root keeps its parameters gathered after a forward with no backward;
    # bring both back to their shards so the update runs shard by shard.
    for module in (target, source):
        reshard = getattr(module, "reshard", None)
        if reshard is not None:
            reshard()
    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters(), strict=True):
            t.lerp_(s, tau)
