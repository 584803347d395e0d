"""DisCO: discriminative constrained optimisation for binary rewards (Li et al., NeurIPS 2025, arXiv 2505.12366)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.contracts import PluginConfig
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import PolicyBatch, RLAlgorithm, Rollout
from alignflow.core.rl.parts import LOG_RATIO_CLAMP, group_ids, group_sum, kl_estimate, masked_mean

# Per-token terms whose length-normalised mean is the score s_i (official code: token means, not products).
SCORES = {
    "logL": lambda logprobs, old: logprobs,
    "Lratio": lambda logprobs, old: (logprobs - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(),
}
DEFAULT_TAU = {"logL": 10.0, "Lratio": 1.0}  # the released scripts


class DisCOConfig(PluginConfig):
    # s_i: logL, the token-mean log-likelihood, or Lratio, the likelihood ratio to pi_old
    score: Literal["logL", "Lratio"] = "logL"
    tau: float | None = Field(None, gt=0.0)  # DRO temperature; None: 10 for logL, 1 for Lratio
    delta: float = Field(1e-4, ge=0.0)  # trust region: KL(pi_old || pi_theta) <= delta
    beta: float = Field(1e3, ge=0.0)  # squared-hinge penalty weight
    kl_estimator: Literal["k1", "k3"] = "k1"  # released scripts: k1 (`ppo_kl_type=kl`)


class DisCO(RLAlgorithm):
    """DisCO (Li et al. 2025, arXiv 2505.12366), the DRO objective; no reference, no critic, no clipping.

    Minimises L = -(1/n_Q) sum_q [mean_{i in P_q} s_i - tau log mean_{j in N_q} exp(s_j / tau)]
    + (beta/2) [KL_hat - delta]_+^2, with s the token-mean log-likelihood (logL) or likelihood ratio (Lratio),
    n_Q counting every question (a group without both labels contributes 0), KL_hat the token-mean k1
    of KL(pi_old || pi_theta) over the micro-batch. The beta/2 follows the official code's gradient (the paper
    writes beta). Each group's term is spread evenly over its tokens, so `seq-mean-token-sum` over the step
    (divided by G n_Q sequences) yields this value and gradient exactly; micro-batches must hold whole groups.
    """

    Config: ClassVar[type[DisCOConfig]] = DisCOConfig
    requires_whole_groups: ClassVar[bool] = True

    @property
    def loss_agg_mode(self) -> str:
        return "seq-mean-token-sum"

    @property
    def tau(self) -> float:
        return self.config.tau or DEFAULT_TAU[self.config.score]

    def advantages(self, rollout: Rollout):
        """DisCO uses no advantage (zeros); this checks once per rollout that rewards are binary."""
        labels = rollout.correct
        if labels is None or not bool(((labels == 0) | (labels == 1)).all()):
            raise DataError("disco needs binary 0/1 correctness (Rollout.correct); soft or +-1 rewards break it")
        return torch.zeros_like(rollout.response_mask, dtype=torch.float32), None

    def group_losses(self, scores: Tensor, correct: Tensor, inverse: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Per-group -J_q [n], and which groups hold both labels."""
        pos, neg = correct == 1, correct == 0
        n_pos, n_neg = group_sum(pos.float(), inverse, n), group_sum(neg.float(), inverse, n)
        pos_mean = group_sum(scores * pos, inverse, n) / n_pos.clamp(min=1)
        x = scores / self.tau
        top = torch.full((n,), float("-inf"), device=x.device)
        top = top.scatter_reduce(0, inverse[neg], x.detach()[neg], "amax", include_self=False)
        top = torch.where(n_neg > 0, top, torch.zeros_like(top))  # log-sum-exp shift; cancels exactly
        sum_exp = group_sum(torch.where(neg, x - top[inverse], float("-inf")).exp(), inverse, n)
        log_mean_exp = top + torch.where(n_neg > 0, sum_exp, torch.ones_like(sum_exp)).log() - n_neg.clamp(min=1).log()
        valid = (n_pos > 0) & (n_neg > 0)
        return torch.where(valid, -pos_mean + self.tau * log_mean_exp, torch.zeros_like(pos_mean)), valid

    def loss(self, batch: PolicyBatch):
        mask = batch.response_mask.float()
        lengths = mask.sum(-1)
        scores = (SCORES[self.config.score](batch.logprobs, batch.old_logprobs) * mask).sum(-1) / lengths.clamp(min=1)
        inverse, n = group_ids(batch.group)
        per_group, valid = self.group_losses(scores, batch.correct, inverse, n)
        group_size = group_sum(torch.ones_like(lengths), inverse, n)
        group_tokens = group_sum(lengths, inverse, n).clamp(min=1)
        per_token = (group_size * per_group / group_tokens)[inverse][:, None] * mask

        kl = masked_mean(kl_estimate(batch.old_logprobs, batch.logprobs, self.config.kl_estimator), mask)
        penalty = 0.5 * self.config.beta * (kl - self.config.delta).clamp(min=0) ** 2
        # Spread over the micro-batch so it enters the step loss weighted by its share of sequences.
        per_token = per_token + penalty * mask.shape[0] * mask / mask.sum().clamp(min=1)
        pos, neg = batch.correct == 1, batch.correct == 0
        metrics = {
            "disco/objective": -per_group.mean(),
            "disco/kl_old": kl,
            "disco/penalty": penalty,
            "disco/valid_group_frac": valid.float().mean(),
            "disco/score_pos": masked_mean(scores, pos),
            "disco/score_neg": masked_mean(scores, neg),
        }
        return per_token, {k: v.detach() for k, v in metrics.items()}


@hookimpl
def register_algorithms(register):
    register("disco", DisCO)
