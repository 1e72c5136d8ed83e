"""Generalised advantage estimation over a rollout of linked transitions, and PPO's loss terms.

A rollout comes from a replay table with ``links: true``: every transition carries its
store ``row`` and ``next_row``, the row of its episode's next step. Transitions arrive in
no particular order and from many episodes at once; :func:`successors` finds, for each,
the transition that follows it in the rollout (or none)::

    succ = successors(batch["row"], batch["next_row"])
    adv, ret = gae(reward, discount, value, next_value, succ, lam=0.95)
    adv = normalise(adv)

``discount`` is the table's: ``gamma``, and 0 on a terminating step, so a termination
never bootstraps. Every other step bootstraps on ``next_value``, the critic's value of
the observation after it: on a truncation (a time-out) that is the episode's final
observation, and where the rollout stops inside an episode (the round ended, or the
next steps acted with another policy version and were left out) it is the next
observation of the episode. The recursion ``A_t = δ_t + γλ A_{t+1}`` follows a link only
when the next step is in the rollout; otherwise ``A_t = δ_t``.
"""

from __future__ import annotations

import torch


def successors(row: torch.Tensor, next_row: torch.Tensor) -> torch.Tensor:
    """Index of the transition whose ``row`` is each one's ``next_row``, or -1."""
    row, next_row = row.long(), next_row.long()
    order = torch.argsort(row)
    ranked = row[order]
    at = torch.searchsorted(ranked, next_row).clamp(max=max(len(row) - 1, 0))
    found = (ranked[at] == next_row) & (next_row != row) & (next_row >= 0)
    return torch.where(found, order[at], torch.full_like(at, -1))


def gae(
    reward: torch.Tensor,
    discount: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    succ: torch.Tensor,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (``advantage + value``) over linked transitions.

    Solved as a fixed point, one sweep per step of the longest chain, each over the
    whole rollout at once (chains are at most a round's steps per env long)."""
    reward, discount = reward.float(), discount.float()
    delta = reward + discount * next_value - value
    linked = succ >= 0
    chain = discount * lam * linked.float()
    idx = succ.clamp(min=0)
    adv = delta.clone()
    for _ in range(len(adv)):
        new = delta + chain * adv[idx]
        if torch.equal(new, adv) or not bool(torch.isfinite(new).all()):
            adv = new
            break
        adv = new
    return adv, adv + value


def normalise(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit (unbiased) standard deviation over the rollout."""
    if len(adv) < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + eps)


def clipped_surrogate(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, adv: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's policy loss: ``-mean(min(r A, clip(r, 1 - ε, 1 + ε) A))``, ``r = π/π_old``."""
    ratio = torch.exp(log_prob - old_log_prob)
    return -torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv).mean()


def value_loss(
    value: torch.Tensor, old_value: torch.Tensor, ret: torch.Tensor, clip: float | None
) -> torch.Tensor:
    """Squared error to the returns; with ``clip``, the worse of the clipped and the plain one."""
    plain = (value - ret).pow(2)
    if clip is None:
        return plain.mean()
    clipped = old_value + (value - old_value).clamp(-clip, clip)
    return torch.max(plain, (clipped - ret).pow(2)).mean()


def gaussian_kl(
    mean_old: torch.Tensor, log_std_old: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor
) -> torch.Tensor:
    """Mean ``KL(old || new)`` of diagonal Gaussians (the pre-tanh policies; tanh keeps KL)."""
    var_old, var = torch.exp(2 * log_std_old), torch.exp(2 * log_std)
    kl = log_std - log_std_old + (var_old + (mean_old - mean).pow(2)) / (2 * var) - 0.5
    return kl.sum(-1).mean()
