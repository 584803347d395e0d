"""Shared pieces of RL objectives: baselines, whitening, KL estimators, the clipped surrogate, GAE.

Conventions: `[B]` tensors hold one value per response, `[B, T]` tensors one per response token,
`mask` is the response mask (1 on generated tokens, 0 on padding). `group` holds each response's
prompt index (any integers; they need not be contiguous).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Defaults of the `log_ratio_clamp` and `kl_clamp` settings (`KLLossConfig`); None in either disables it (TRL).
LOG_RATIO_CLAMP = 20.0  # verl: |log r| <= 20 keeps exp() finite; zero gradient past it
KL_CLAMP = 10.0  # OpenRLHF clamps every estimator to +-10; verl clamps only k3 (zero gradient past it)


def clamp_log_ratio(log_ratio: Tensor, bound: float | None = LOG_RATIO_CLAMP) -> Tensor:
    """log r clamped to [-bound, bound] (zero gradient outside); None: unchanged."""
    return log_ratio if bound is None else log_ratio.clamp(-bound, bound)


def group_ids(group: Tensor) -> tuple[Tensor, int]:
    """Dense group indices 0..n-1 for arbitrary prompt ids, and n."""
    uniq, inverse = torch.unique(group, return_inverse=True)
    return inverse, uniq.numel()


def group_sum(values: Tensor, inverse: Tensor, n: int) -> Tensor:
    """Per-group sums of a [B] tensor: [n]."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, inverse, values)


def group_normalize(rewards: Tensor, group: Tensor, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage (R - mean_g) / (std_g + eps), std unbiased (N-1) as verl; `scale=False` only centres.

    A response alone in its group gets advantage 0 (no baseline to compare with).
    """
    inverse, n = group_ids(group)
    rewards = rewards.float()
    count = group_sum(torch.ones_like(rewards), inverse, n)
    mean = group_sum(rewards, inverse, n) / count
    centred = rewards - mean[inverse]
    if not scale:
        return centred
    var = group_sum(centred**2, inverse, n) / (count - 1).clamp(min=1)
    return centred / (var.sqrt()[inverse] + eps)


def leave_one_out(rewards: Tensor, group: Tensor) -> Tensor:
    """RLOO advantage R_i - mean_{j != i} R_j within the group (0 for a response alone in its group)."""
    inverse, n = group_ids(group)
    rewards = rewards.float()
    count = group_sum(torch.ones_like(rewards), inverse, n)[inverse]
    total = group_sum(rewards, inverse, n)[inverse]
    baseline = (total - rewards) / (count - 1).clamp(min=1)
    return torch.where(count > 1, rewards - baseline, torch.zeros_like(rewards))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over the positions where mask = 1 (0 when there are none)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Token-weighted whitening over the whole batch: (x - mu) / sqrt(max(var, eps)), biased var as OpenRLHF.

    Long responses weigh more than short ones; call it on the full rollout, never per micro-batch.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    whitened = (values - mean) if shift_mean else values
    return whitened * var.clamp(min=eps).rsqrt() * mask


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k3",
    clamp: float | None = KL_CLAMP,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> Tensor:
    """Per-token estimate of KL(p || ref) from samples of p (Schulman's k1/k2/k3), clamped to +-`clamp`.

    Pass the sampling policy first: KL(pi_old || pi_theta) on pi_old's samples is
    `kl_estimate(old_logprobs, logprobs)`. k3 = rho - 1 - log rho reaches 10 at log rho = 2.61 (and at -11.0),
    so the default clamp binds on tokens the policy gives e^-2.61 = 0.074 of the reference's probability;
    log rho is first clamped to +-`log_ratio_clamp`. None disables a clamp (TRL clamps neither).
    """
    log_ratio = clamp_log_ratio(ref_logprobs - logprobs, log_ratio_clamp)  # log rho
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio**2
    elif kind == "k3":
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2 or k3")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """PPO's per-token loss max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), optionally dual-clipped at -A c for A < 0.

    Returns the loss, the ratio r (log r clamped to +-`log_ratio_clamp` first; None: not clamped), and boolean
    masks of tokens whose gradient the clip removed (`clip_low`: A < 0 and r < 1-eps_low; `clip_high`: A > 0 and
    r > 1+eps_high; `dual_clip`).
    """
    ratio = clamp_log_ratio(logprobs - old_logprobs, log_ratio_clamp).exp()
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    flags = {
        "clip_low": (advantages < 0) & (ratio < 1 - clip_low),
        "clip_high": (advantages > 0) & (ratio > 1 + clip_high),
    }
    if dual_clip is not None:
        # Ye et al. 2020: for A < 0 an unbounded ratio would make one token's loss unbounded.
        bound = -advantages * dual_clip
        flags["dual_clip"] = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, ratio, flags


def last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T] per-token rewards holding each scalar reward at its response's last token."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = (positions * mask.long()).argmax(-1, keepdim=True)  # mask may start anywhere
    placed = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return placed.scatter(-1, last, rewards.float()[:, None]) * mask


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2015): A_t = sum_l (gamma lam)^l delta_{t+l}; returns A + V. Both [B, T].

    delta_t = r_t + gamma V_{t'} - V_t, t' the next position in `mask` (V = 0 past the last). Positions outside
    the mask are not time steps: in a multi-turn episode the environment's tokens between two model turns
    neither decay nor carry the advantage, so the last token of a turn bootstraps from the next turn's first.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    valid = mask.bool()
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(running)
    # The recursion runs backwards in time; every library loops over T here (vectorised over B).
    for t in reversed(range(values.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = step
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go G_t = sum_{s >= t} gamma^(s-t) r_s over the response, [B, T]."""
    rewards = rewards * mask.to(rewards.dtype)
    if gamma == 1.0:
        return rewards.flip(-1).cumsum(-1).flip(-1) * mask
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def advantage_metrics(advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Mean, std, min and max of the advantages over response tokens."""
    valid = advantages[mask.bool()]
    if valid.numel() == 0:
        valid = advantages.new_zeros(1)
    return {
        "advantages/mean": valid.mean(),
        "advantages/std": valid.std(unbiased=False),
        "advantages/min": valid.min(),
        "advantages/max": valid.max(),
    }
