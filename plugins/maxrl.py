"""MaxRL: the group advantage divided by the group's mean reward, a truncated maximum-likelihood objective
(Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv 2602.02710)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, Rollout, broadcast
from alignflow.core.rl.parts import group_ids, group_sum


class MaxRLConfig(PolicyGradientConfig):
    # r_i: the stage's weighted total reward (the official code's score), or `correct`, the stage's 0/1
    # accuracy (the first reward scored >= 1): the paper's r_i in {0, 1}
    reward: Literal["total", "correct"] = "total"
    # (r - mean) / (mean + eps): the paper has none; the official code adds 1e-6. A group whose mean is <= 0
    # gets 0 either way (no success: the paper's convention; a negative mean would flip every sign).
    eps: float = Field(0.0, ge=0.0)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # the official runs: no KL
    loss_agg_mode: AggMode = "token-mean"  # the official code's (the theory sums each response's tokens)


def maxrl_advantages(rewards: Tensor, group: Tensor, eps: float = 0.0) -> Tensor:
    """[B] (r_i - rbar) / (rbar + eps) with rbar the mean reward of i's group; 0 in a group with rbar <= 0."""
    inverse, n = group_ids(group)
    rewards = rewards.float()
    mean = (group_sum(rewards, inverse, n) / group_sum(torch.ones_like(rewards), inverse, n))[inverse]
    return torch.where(mean > 0, (rewards - mean) / (mean.clamp(min=torch.finfo(rewards.dtype).tiny) + eps), 0.0)


class MaxRL(PolicyGradient):
    """MaxRL (Tajwar et al. 2026, arXiv 2602.02710): A_i = (r_i - rbar) / rbar over the G samples of a prompt.

    With binary r and K >= 1 successes, (1/N) sum_i ((r_i - rbar) / rbar) grad log pi(z_i) is the paper's
    estimator (1/K) sum_i r_i grad log pi(z_i) minus the zero-mean control variate (1/N) sum_i grad log pi(z_i),
    unbiased for the gradient of J^(N) = -sum_{k=1..N} (1 - p)^k / k, which tends to log p (maximum likelihood)
    as the group size N grows: N is the truncation order, not only a variance knob. One success among 16
    gets +15, each failure -1 (GRPO: +3.75, -0.25). Defined for 0/1 rewards; partial credit voids the theorem.
    The loss is the official code's (a verl fork) but for one clip: PPO's clipped surrogate (0.2/0.2), token-mean,
    no KL, and no dual clip by default, where the official code inherits verl's dual clip at c = 3 for A < 0
    (`clip_ratio_c`): `dual_clip: 3` matches it exactly.
    """

    Config: ClassVar[type[MaxRLConfig]] = MaxRLConfig

    def advantages(self, rollout: Rollout):
        c = self.config
        rewards = rollout.correct if c.reward == "correct" else rollout.rewards
        if rewards is None:
            raise ValueError("maxrl: config.reward is 'correct' but the rollout has no accuracy (Rollout.correct)")
        return broadcast(maxrl_advantages(rewards, rollout.group, c.eps), rollout.response_mask), None


@hookimpl
def register_algorithms(register):
    register("maxrl", MaxRL)
