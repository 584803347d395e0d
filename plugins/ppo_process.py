"""Step-by-step PPO (Math-Shepherd, Wang et al. 2024, arXiv 2312.08935): a PRM score at the end of each step."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.ppo import PPO, PPOConfig


class ProcessPPOConfig(PPOConfig):
    kl_coef: float = Field(0.04, ge=0.0)  # Math-Shepherd's step-by-step PPO
    # raw: the PRM's score as it is (Math-Shepherd). clip: min(score - eta, 0) (Gao et al. 2024,
    # arXiv 2410.15115): never positive, so extra steps cannot add reward.
    step_reward: Literal["raw", "clip"] = "raw"
    clip_eta: float = Field(0.5, ge=0.0, le=1.0)  # eta of `step_reward: clip`, the score a step needs to cost nothing


class ProcessPPO(PPO):
    """PPO whose per-token rewards also hold a process reward at the last token of every step.

    r_t = s_j at the last token of step j (s_j the PRM's probability that step j is correct, or
    min(s_j - eta, 0) with step_reward=clip), plus PPO's own r_t: the stage's weighted outcome
    reward R at the response's last token and -beta k1 at every token. GAE, the critic and the
    losses are PPO's. Give the outcome rewards weight 0 for Math-Shepherd's PRM-only PPO; keep a
    verifier's weight for process + outcome. The step rewards come from the one reward with
    `step_rewards` among the stage's rewards (the `prm` reward).
    """

    Config: ClassVar[type[ProcessPPOConfig]] = ProcessPPOConfig
    requires_step_rewards: ClassVar[bool] = True

    def step_token_rewards(self, rollout: Rollout) -> torch.Tensor:
        scores, at_step = rollout.step_rewards.float(), rollout.step_mask.bool()
        if self.config.step_reward == "clip":
            scores = (scores - self.config.clip_eta).clamp(max=0.0)
        return torch.where(at_step, scores, 0.0) * rollout.response_mask

    def token_rewards(self, rollout: Rollout):
        return super().token_rewards(rollout) + self.step_token_rewards(rollout)


@hookimpl
def register_algorithms(register):
    register("ppo_process", ProcessPPO)
