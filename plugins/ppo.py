"""PPO with a critic and GAE, KL penalty in the reward (Schulman et al. 2017; Ouyang et al. 2022)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import PolicyBatch, PolicyGradient, PolicyGradientConfig, Rollout
from alignflow.core.rl.parts import gae, kl_estimate, last_token_rewards, masked_mean, masked_whiten


class PPOConfig(PolicyGradientConfig):
    kl_coef: float = Field(0.05, ge=0.0)  # beta of the per-token k1 penalty in the reward (TRL)
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # discount of the per-token rewards (1: none, TRL's)
    lam: float = Field(0.95, ge=0.0, le=1.0)  # GAE lambda
    value_clip: float = Field(0.2, gt=0.0)  # epsilon_v
    vf_coef: float = Field(0.1, ge=0.0)  # weight of the value loss
    whiten_advantages: bool = True  # advantages standardised over the rollout's tokens (TRL)


class PPO(PolicyGradient):
    """PPO (Schulman et al. 2017) with GAE (2015), for LLMs as TRL's PPOTrainer; defaults are TRL's.

    r_t = -beta (log pi_old - log pi_ref) plus R at the last token; GAE(gamma=1, lambda=0.95) on the critic's
    values, advantages whitened over the rollout; PPO-clip 0.2; clipped value loss
    0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2) weighted by vf_coef.
    """

    Config: ClassVar[type[PPOConfig]] = PPOConfig
    requires_reference: ClassVar[bool] = True
    requires_critic: ClassVar[bool] = True

    def uses_reference(self) -> bool:
        return super().uses_reference() or self.config.kl_coef > 0

    def token_rewards(self, rollout: Rollout):
        """r_t: the reward R at the response's last token, minus beta's k1 penalty at every token."""
        c, mask = self.config, rollout.response_mask
        rewards = last_token_rewards(rollout.rewards, mask)
        if c.kl_coef > 0:
            rewards = rewards - c.kl_coef * kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, "k1") * mask
        return rewards

    def advantages(self, rollout: Rollout):
        c, mask = self.config, rollout.response_mask
        advantages, returns = gae(self.token_rewards(rollout), rollout.values.float(), mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        return advantages, returns

    def value_loss(self, batch: PolicyBatch):
        eps, mask = self.config.value_clip, batch.response_mask
        clipped = batch.old_values + (batch.values - batch.old_values).clamp(-eps, eps)
        unclipped_loss = (batch.values - batch.returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped_loss, (clipped - batch.returns) ** 2)
        metrics = {
            "critic/value_loss": masked_mean(per_token, mask),
            "critic/clip_frac": masked_mean(((clipped - batch.returns) ** 2 > unclipped_loss).float(), mask),
            "critic/values_mean": masked_mean(batch.values, mask),
        }
        return self.config.vf_coef * per_token, {k: v.detach() for k, v in metrics.items()}


@hookimpl
def register_algorithms(register):
    register("ppo", PPO)
