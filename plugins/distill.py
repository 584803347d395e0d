"""On-policy distillation: the student samples, a frozen teacher grades every token (GKD, arXiv 2306.13649;
Thinking Machines' "On-Policy Distillation", 2025)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import (PolicyBatch, PolicyGradient, PolicyGradientConfig, Rollout, broadcast,
                                         policy_weighted, with_kl_loss)
from alignflow.core.rl.capabilities import TeacherDistributions
from alignflow.core.rl.divergence import Divergence, TopKTail, logit_divergence
from alignflow.core.rl.parts import discounted_returns, group_normalize, kl_estimate, masked_mean


class DistillConfig(PolicyGradientConfig):
    kl_coef: float = Field(1.0, gt=0.0)  # weight of the per-token distillation reward (Tinker's kl_penalty_coef)
    # gamma of a return-to-go over the per-token rewards; 0 (Tinker's default): each token is weighted by its own
    # reverse KL only, the low-variance estimator the blog post reports working as well as the full return
    kl_discount: float = Field(0.0, ge=0.0, le=1.0)
    reward_weight: float = Field(0.0, ge=0.0)  # weight of the verifier's group advantage; 0: pure distillation
    scale_rewards: bool = False  # divide the verifier advantage by the group std (GRPO); Tinker only centres it
    # None: "token-mean" for `sampled` (TRL's and NeMo-RL's distillation), "seq-mean-token-mean" for `top_k` and
    # `full` (GKD's (1/L_y) sum_n per sequence, then a mean over sequences); "token-mean" there is TRL's GKD
    loss_agg_mode: AggMode | None = None
    # sampled: the teacher's log-prob of each sampled token as a reward (below); top_k / full: the divergence
    # between the teacher's and the student's next-token distributions, differentiated directly
    form: Literal["sampled", "top_k", "full"] = "sampled"
    divergence: Divergence = "jsd"  # of `top_k` / `full`: forward_kl, reverse_kl or GKD's jsd (TRL's default)
    beta: float = Field(0.5, gt=0.0, lt=1.0)  # JSD's weight of the teacher in M (GKD's and TRL's default 0.5)
    top_k: int = Field(64, ge=1)  # k of `top_k`: the teacher's k likeliest tokens at each position
    # what top_k does with the other tokens' mass: renormalize both over the k tokens, drop it (verl's forward KL
    # with its floors: log-probs at -10, each position's sum in [0, 10]), or bucket it as a (k+1)-th outcome; see
    # alignflow.core.rl.divergence.top_k_log_probs
    top_k_tail: TopKTail = "renormalize"
    chunk_positions: int = Field(256, ge=1)  # positions per softmax chunk of the top_k / full divergence

    @model_validator(mode="after")
    def _form_fields(self):
        if self.form != "sampled" and self.kl_discount > 0:
            raise ValueError(f"kl_discount applies to form 'sampled' only, not to form '{self.form}'")
        return self


class Distill(TeacherDistributions, PolicyGradient):
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

    `form: full` is GKD's on-policy loss (lambda = 1) on the stage's samples: at each response position n the
    loss is D(p_T(.|y_<n) || p_S(.|y_<n)) over the vocabulary, `divergence` forward_kl KL(P||Q), reverse_kl
    KL(Q||P) or jsd beta KL(P||M) + (1-beta) KL(Q||M), M = beta P + (1-beta) Q (P teacher, Q student;
    `alignflow.core.rl.divergence`), differentiated directly, no importance ratio. The teacher's logits are
    computed per micro-batch under no_grad inside the micro-step, never for the whole rollout. `form: top_k`
    restricts both to the teacher's top_k tokens at each position, renormalised over them by default
    (`top_k_tail`: the student's mass outside them then gets no gradient; `drop` is verl's unrenormalised top-k
    forward KL with verl's floors, log-probs at -10 and each position's sum in [0, 10]; `bucket` keeps the rest as
    one more outcome). The paper averages over each sequence's tokens, then over
    sequences (loss_agg_mode seq-mean-token-mean, the default here); TRL's token-mean is a setting. The logits
    are divided by the stage's sampling temperature as every log-prob of the stage; TRL's loss uses 1 (sample at
    temperature 1 for its form). TRL's beta = 0 / beta = 1 (un-scaled KLs) are forward_kl / reverse_kl here.
    A positive `reward_weight` adds the verifier's advantage in the clipped surrogate.
    """

    Config: ClassVar[type[DistillConfig]] = DistillConfig
    requires_teacher: ClassVar[bool] = True

    @property
    def loss_agg_mode(self) -> str:
        mode = self.config.loss_agg_mode
        return mode or ("token-mean" if self.config.form == "sampled" else "seq-mean-token-mean")

    @property
    def uses_teacher_logits(self) -> bool:
        return self.config.form != "sampled"

    def inert_rows(self, rollout: Rollout, advantages: Tensor) -> Tensor | None:
        return super().inert_rows(rollout, advantages) if self.config.form == "sampled" else None

    def advantages(self, rollout: Rollout):
        c, mask = self.config, rollout.response_mask
        if c.form != "sampled":  # the divergence is the loss; only the verifier's advantage is a surrogate's
            verifier = group_normalize(rollout.rewards, rollout.group, scale=c.scale_rewards)
            return c.reward_weight * broadcast(verifier, mask), None
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

    def distribution_loss(self, batch: PolicyBatch, student_logits: Tensor, teacher_logits: Tensor):
        c, mask = self.config, batch.response_mask
        top_k = c.top_k if c.form == "top_k" else None
        div = logit_divergence(student_logits, teacher_logits, c.divergence, c.beta, top_k, c.top_k_tail,
                               c.chunk_positions) * mask
        # named by form and divergence (`distill/full_reverse_kl`): `distill/reverse_kl` is the sampled estimate
        metrics = {f"distill/{c.form}_{c.divergence}": masked_mean(div.detach(), mask)}
        if c.reward_weight > 0:  # the surrogate (sampler-weighted) and any KL term, then the weighted divergence
            loss, more = super().loss(batch)
            loss = loss + policy_weighted(div, batch)
        else:  # the sampler weights on the divergence, and the KL term, if any, unweighted
            loss, more = with_kl_loss(div, batch, c, {})
        metrics.update(more)
        if batch.teacher_logprobs is not None:
            metrics["distill/reverse_kl"] = masked_mean(batch.old_logprobs - batch.teacher_logprobs, mask)
        return loss, {k: v.detach() for k, v in metrics.items()}


@hookimpl
def register_algorithms(register):
    register("distill", Distill)
