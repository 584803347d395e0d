"""On-policy distillation: the student samples, a frozen teacher grades every token (GKD, arXiv 2306.13649;
Thinking Machines' "On-Policy Distillation", 2025)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyBatch, PolicyGradient, PolicyGradientConfig, Rollout, broadcast
from alignflow.core.rl.parts import discounted_returns, group_normalize, kl_estimate, masked_mean


class DistillConfig(PolicyGradientConfig):
    kl_coef: float = Field(1.0, gt=0.0)  # weight of the per-token distillation reward (Tinker's kl_penalty_coef)
    # gamma of a return-to-go over the per-token rewards; 0 (Tinker's default): each token is weighted by its own
    # reverse KL only, the low-variance estimator the blog post reports working as well as the full return
    kl_discount: float = Field(0.0, ge=0.0, le=1.0)
    reward_weight: float = Field(0.0, ge=0.0)  # weight of the verifier's group advantage; 0: pure distillation
    scale_rewards: bool = False  # divide the verifier advantage by the group std (GRPO); Tinker only centres it
    loss_agg_mode: AggMode = "token-mean"  # a mean over the step's tokens, as TRL's and NeMo-RL's distillation


class Distill(PolicyGradient):
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649) in the sampled-token form of
    Thinking Machines' recipe (tinker-cookbook `distillation/train_on_policy.py`).

    Per response token o_t drawn from pi_old, the reward is the negative sampled reverse KL
    r_t = -(log pi_old(o_t) - log pi_teacher(o_t)), used as a detached per-token advantage
    A_t = kl_coef * r_t (+ reward_weight * (R_i - mean_group R)) in PPO's clipped importance-sampled surrogate
    against pi_old. On-policy its expected gradient is that of sum_t KL(pi_theta || pi_teacher) at each
    sampled prefix, not counting a token's effect on later ones (`kl_discount` = 1 counts it: the sequence KL).
    GKD/TRL instead differentiate a full-vocabulary divergence (JSD(beta); beta = 1 is the reverse KL);
    the sampled form needs only the teacher's log-prob of each sampled token, so it runs through the
    policy-gradient loop as any RL algorithm. Teacher log-probs use the sampling temperature, as every
    log-prob of the stage. Each |log-ratio| is clamped at 10 nats (KL_CLAMP), which Tinker does not do.
    """

    Config: ClassVar[type[DistillConfig]] = DistillConfig
    requires_teacher: ClassVar[bool] = True

    def advantages(self, rollout: Rollout):
        c, mask = self.config, rollout.response_mask
        if rollout.teacher_logprobs is None:
            raise ValueError("distill needs rollout.teacher_logprobs: the rl stage fills them from its `teacher` input")
        # k1 on pi_old's samples: log pi_old - log pi_teacher, the sampled reverse KL of each token
        rewards = -kl_estimate(rollout.old_logprobs, rollout.teacher_logprobs, "k1") * mask
        if c.kl_discount > 0:
            rewards = discounted_returns(rewards, mask, c.kl_discount)
        advantages = c.kl_coef * rewards
        if c.reward_weight > 0:
            verifier = group_normalize(rollout.rewards, rollout.group, scale=c.scale_rewards)
            advantages = advantages + c.reward_weight * broadcast(verifier, mask)
        return advantages, None

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().loss(batch)
        # Tinker's `teacher_kl`: the sampled reverse KL of pi_old to the teacher on this micro-batch
        metrics["distill/reverse_kl"] = masked_mean(batch.old_logprobs - batch.teacher_logprobs,
                                                    batch.response_mask).detach()
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("distill", Distill)
