"""Pieces algorithms share: the finite-gradient guard, replicated-gradient averaging, Polyak updates."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # an FSDP-sharded (DTensor) gradient
    return to_local() if to_local is not None else t


def clip_groups(groups: list[list[torch.Tensor]], max_norm: float) -> list[bool]:
    """Clip each group's gradients to ``max_norm``; report per group whether its norm is finite.

    One all-reduce for every group together: each rank sums the squares of its own
    shards (replicated parameters count once, on rank 0). All ranks see the same norms,
    so they agree on skipping a step.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    squares = torch.zeros(len(groups), dtype=torch.float64)
    for i, params in enumerate(groups):
        for p in params:
            if p.grad is None:
                continue
            g = p.grad
            if hasattr(g, "to_local") or rank == 0:
                squares[i] += _local(g).detach().double().pow(2).sum().cpu()
    if world > 1:
        dist.all_reduce(squares)
    norms = squares.sqrt()
    for i, params in enumerate(groups):
        coef = max_norm / (float(norms[i]) + 1e-6)
        if coef < 1 and torch.isfinite(norms[i]):
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return [bool(torch.isfinite(n)) for n in norms]


def clip_and_check(module: nn.Module, max_norm: float) -> bool:
    """Clip a module's gradients (FSDP-aware) and report whether their norm is finite."""
    return clip_groups([list(module.parameters())], max_norm)[0]


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
