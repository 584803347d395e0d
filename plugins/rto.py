"""RTO, Reinforced Token Optimization: PPO with DPO's implicit token rewards (Zhong et al., "DPO Meets PPO:
Reinforced Token Optimization for RLHF", arXiv 2404.18922)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyBatch, Rollout
from alignflow.core.rl.parts import masked_mean
from alignflow.plugins.ppo import PPO, PPOConfig


class RTOConfig(PPOConfig):
    """Defaults of the official script (zkshan2002/RTO `examples/scripts/train_rto_llama_8b.sh`)."""

    dpo_reward_scale: float = Field(0.05, gt=0.0)  # beta_1 (`--dpo_reward_scale`); RTO's README: keep it small
    dpo_reward_clip: float | None = Field(0.05, gt=0.0)  # c (`--dpo_reward_clip`): |token reward| <= c; None: no clip
    kl_coef: float = Field(0.01, ge=0.0)  # beta_2 of the k1 penalty to pi_ref in the reward (`--init_kl_coef`)
    reward_weight: float = Field(1.0, ge=0.0)  # beta_3 on the outcome reward; 0: DPO token rewards alone
    reward_clip: float | None = Field(10.0, gt=0.0)  # OpenRLHF's `compute_reward` clamps R to +-10; None: no clip
    loss_agg_mode: AggMode = "seq-mean-token-mean"  # OpenRLHF's PolicyLoss/ValueLoss of the RTO fork


def dpo_token_rewards(teacher_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, scale: float,
                      clip: float | None) -> Tensor:
    """[B, T] clip(beta_1 (log pi_dpo - log pi_ref), -c, c) on response tokens, 0 on padding."""
    rewards = scale * (teacher_logprobs.float() - ref_logprobs.float())
    if clip is not None:
        rewards = rewards.clamp(-clip, clip)
    return rewards * mask


class RTO(PPO):
    """RTO (Zhong et al. 2024): PPO whose per-token reward adds the DPO model's implicit reward at every token,

    r_t = clip(beta_1 [log pi_dpo(a_t) - log pi_ref(a_t)], -c, c) - beta_2 [log pi_old(a_t) - log pi_ref(a_t)]
          + 1[t = T] beta_3 clip(R, -10, 10),

    then PPO as `ppo`: GAE(gamma=1, lambda=0.95) on a critic, advantages whitened over the rollout, ratio clip 0.2,
    clipped value loss; losses seq-mean-token-mean. pi_dpo is the stage's `teacher` input (a DPO model trained
    with pi_ref as its reference), pi_ref the `reference` input or else the initial policy (the SFT model).
    As the official code (zkshan2002/RTO, OpenRLHF fork: `_compute_dpo_rewards`, `compute_reward`): the DPO
    term is scaled, then clipped; beta_3 = 1 there (the paper's beta_3 is `reward_weight`). Deviations: R is the
    stage's rewards (a verifier on the tiny task) where the official script uses a Bradley-Terry reward model;
    the critic starts from the `critic` input or the policy, not the reward model; log-probs use the sampling
    temperature, as every log-prob of the stage; each k1 term is clamped to +-10 as in `ppo`.
    With pi_dpo = pi_ref and beta_3 = 1 the token term is 0 and the rewards are exactly PPO's (kl_coef = beta_2).
    """

    Config: ClassVar[type[RTOConfig]] = RTOConfig
    requires_teacher: ClassVar[bool] = True

    def uses_reference(self) -> bool:
        return True  # the DPO token reward is a log-ratio to pi_ref, whatever beta_2

    def token_rewards(self, rollout: Rollout) -> Tensor:
        """r_t: PPO's (the KL penalty, the outcome at the last token) with the outcome weighted and clipped,
        plus the clipped DPO token reward at every response token."""
        c, mask = self.config, rollout.response_mask
        if rollout.teacher_logprobs is None or rollout.ref_logprobs is None:
            raise ValueError("rto needs rollout.teacher_logprobs (pi_dpo, the stage's `teacher` input) and "
                             "rollout.ref_logprobs (pi_ref)")
        outcome = rollout.rewards.float()
        if c.reward_clip is not None:
            outcome = outcome.clamp(-c.reward_clip, c.reward_clip)
        rewards = super().token_rewards(replace(rollout, rewards=c.reward_weight * outcome))
        dpo = dpo_token_rewards(rollout.teacher_logprobs, rollout.ref_logprobs, mask, c.dpo_reward_scale,
                                c.dpo_reward_clip)
        return rewards + dpo

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().loss(batch)
        c, mask = self.config, batch.response_mask
        raw = dpo_token_rewards(batch.teacher_logprobs, batch.ref_logprobs, mask, c.dpo_reward_scale, None)
        clip = float("inf") if c.dpo_reward_clip is None else c.dpo_reward_clip
        # the RTO authors' advice is to keep the DPO token rewards from dominating: log their size and the clip's share
        metrics["rto/dpo_reward_mean"] = masked_mean(raw.clamp(-clip, clip), mask).detach()
        metrics["rto/dpo_reward_clip_frac"] = masked_mean((raw.abs() > clip).float(), mask).detach()
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("rto", RTO)
