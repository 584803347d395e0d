"""Off-policy GRPO: replayed groups, ratios against the policy that sampled them (Mroueh et al., arXiv 2505.22257)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import Rollout, broadcast
from alignflow.core.rl.capabilities import Replay
from alignflow.core.rl.parts import group_ids, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class OffPolicyGRPOConfig(GRPOConfig):
    # Share of each step's prompt groups taken from the replay buffer instead of generated; the stage then
    # generates prompts_per_step - round(replay_fraction x prompts_per_step) groups (at least one).
    replay_fraction: float = Field(0.5, ge=0.0, lt=1.0)
    buffer_steps: int = Field(1, ge=1)  # a group is replayable for this many steps after the one that made it
    var_eps: float = Field(1e-6, gt=0.0)  # eps of sigma_eps = sqrt(var + eps) (the paper's value is not given)


class OffPolicyGRPO(Replay, GRPO):
    """Off-policy GRPO (Mroueh et al. 2025, arXiv 2505.22257): samples of a behaviour policy alpha, replayed.

    The paper's surrogate, per token: min(r A_alpha, clip(r, 1-eps, 1+eps) A_alpha) - beta KL(pi_theta || pi_ref),
    with r = pi_theta / alpha and A_alpha = (R - mu_alpha) / sqrt(sigma_alpha^2 + eps) from the G samples of
    alpha for the prompt. Here alpha is, for each group, the policy of the step that generated it: the stage
    keeps groups for `buffer_steps` steps with the log-probs they were sampled with (`old_logprobs`, never
    recomputed later) and mixes `replay_fraction` of them into each step's batch; fresh groups have alpha = pi_k,
    on-policy GRPO. The paper lags the sampler's weights instead (alpha = pi_{k-v}, the server refreshed every
    v steps); the objective is the same. Ours, where the paper is silent: token-level ratios as TRL,
    sigma^2 the unbiased (N-1) group variance as GRPO here, and the k3 KL term not importance-weighted.
    """

    Config: ClassVar[type[OffPolicyGRPOConfig]] = OffPolicyGRPOConfig

    def fresh_groups(self, prompts_per_step: int) -> int:
        return max(1, prompts_per_step - round(self.config.replay_fraction * prompts_per_step))

    @property
    def buffer_steps(self) -> int:
        return self.config.buffer_steps

    def advantages(self, rollout: Rollout):
        c = self.config
        scores = whiten(rollout.rewards, rollout.group, c.var_eps, scale=c.scale_rewards)
        return broadcast(scores, rollout.response_mask), None


def whiten(rewards: torch.Tensor, group: torch.Tensor, eps: float, scale: bool = True) -> torch.Tensor:
    """(R - mean_g) / sqrt(var_g + eps) per prompt group, var unbiased (0 for a group of one); `scale=False`
    only centres."""
    inverse, n = group_ids(group)
    rewards = rewards.float()
    count = group_sum(torch.ones_like(rewards), inverse, n)
    centred = rewards - (group_sum(rewards, inverse, n) / count)[inverse]
    if not scale:
        return centred
    var = group_sum(centred**2, inverse, n) / (count - 1).clamp(min=1)
    return centred / (var + eps).sqrt()[inverse]


@hookimpl
def register_algorithms(register):
    register("offpolicy_grpo", OffPolicyGRPO)
