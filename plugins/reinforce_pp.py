"""REINFORCE++: critic-free PPO-clip with per-token KL reward and global advantage whitening (arXiv 2501.03262)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, Rollout
from alignflow.core.rl.parts import discounted_returns, kl_estimate, last_token_rewards, masked_whiten


class ReinforcePPConfig(PolicyGradientConfig):
    kl_coef: float = Field(0.01, ge=0.0)  # beta of the k1 KL in the token reward (OpenRLHF --algo.kl.init_coef)
    reward_clip: float = Field(10.0, gt=0.0)  # R clipped to [-c, c] before it enters the return
    gamma: float = Field(1.0, ge=0.0, le=1.0)  # discount of the per-token rewards in the return-to-go (1: none)


class ReinforcePP(PolicyGradient):
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262), as OpenRLHF's `reinforce` estimator.

    r_t = clip(R) at the last token - beta * k1_t, k1_t = log pi_old - log pi_ref; A_t = return-to-go,
    whitened over every token of the rollout (token-weighted, biased variance); PPO-clip, token-mean loss.
    """

    Config: ClassVar[type[ReinforcePPConfig]] = ReinforcePPConfig
    requires_reference: ClassVar[bool] = True

    def uses_reference(self) -> bool:
        return super().uses_reference() or self.config.kl_coef > 0

    def advantages(self, rollout: Rollout):
        c, mask = self.config, rollout.response_mask
        rewards = last_token_rewards(rollout.rewards.clamp(-c.reward_clip, c.reward_clip), mask)
        if c.kl_coef > 0:
            rewards = rewards - c.kl_coef * kl_estimate(rollout.old_logprobs, rollout.ref_logprobs, "k1") * mask
        return masked_whiten(discounted_returns(rewards, mask, c.gamma), mask), None


@hookimpl
def register_algorithms(register):
    register("reinforce_pp", ReinforcePP)
