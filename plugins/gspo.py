"""GSPO: one length-normalised importance ratio per response, clipped per response (Zheng et al. 2025, Qwen,
arXiv 2507.18071)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyBatch, with_kl_loss
from alignflow.core.rl.parts import clamp_log_ratio, clipped_surrogate, masked_mean
from alignflow.plugins.grpo import GRPO, GRPOConfig


class GSPOConfig(GRPOConfig):
    # Paper section 5.1: "the left and right clipping ranges ... 3e-4 and 4e-4". A sequence ratio is a
    # geometric mean of token ratios, so it moves far less than one token's ratio: the range is tiny.
    clip_low: float = Field(3e-4, ge=0.0, lt=1.0)
    clip_high: float = Field(4e-4, ge=0.0)
    kl_loss_coef: float = Field(0.0, ge=0.0)  # the paper trains without a KL term
    # J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i): each response counts once, whatever its length.
    loss_agg_mode: AggMode = "seq-mean-token-mean"


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[b] log s_i = (1/|o_i|) sum_t log(pi_theta / pi_old) over the response tokens."""
    mask = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


class GSPO(GRPO):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): s_i = (pi_theta(o_i) / pi_old(o_i))^(1/|o_i|) and
    min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) for the whole response; group advantages as GRPO.

    Computed in the paper's GSPO-token form, s_i,t = sg[s_i] pi_theta(o_i,t) / sg[pi_theta(o_i,t)] (as verl's
    `gspo` loss): every token carries the value of s_i, and the gradient of the token-mean of s_i,t is
    s_i (1/|o_i|) sum_t grad log pi_theta(o_i,t), the gradient of s_i itself. With one advantage per response
    (always, with group advantages) value and gradient are GSPO's exactly, under any aggregation, and equal TRL's
    `importance_sampling_level="sequence"`; per-token advantages would give GSPO-token. Clipping is per response:
    s_i outside the range removes the gradient of every token of o_i. The paper's objective is a mean over
    responses (`seq-mean-token-mean`, TRL `loss_type="grpo"`, verl forces it); no KL (`kl_loss_coef` adds one).
    The paper splits each rollout into 4 optimizer steps: on-policy (one step) s_i = 1 and nothing is clipped.
    """

    Config: ClassVar[type[GSPOConfig]] = GSPOConfig
    requires_reference: ClassVar[bool] = False

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        c, mask = self.config, batch.response_mask
        log_s = sequence_log_ratio(batch.logprobs, batch.old_logprobs, mask)
        # value log s_i at every token, gradient d log pi_theta(o_i,t): the stop-gradient form of the paper
        log_s_token = batch.logprobs - batch.logprobs.detach() + log_s.detach()[:, None]
        loss, ratio, flags = clipped_surrogate(
            log_s_token, torch.zeros_like(log_s_token), batch.advantages, c.clip_low, c.clip_high, c.dual_clip,
            c.log_ratio_clamp,
        )
        # Token fractions, as the paper's Figure 2 counts clipped tokens; a clipped response counts all its tokens.
        metrics = {f"actor/{name}_frac": masked_mean(flag.float(), mask) for name, flag in flags.items()}
        metrics["actor/ratio_mean"] = log_s.detach().exp().mean()  # mean of s_i over responses
        # The KL's bias-correction weight is s_i, differentiable through the mean (TRL's sequence-level coef_1);
        # it is not the token-level correction that makes r k3 unbiased.
        s = clamp_log_ratio(log_s, c.log_ratio_clamp).exp()[:, None]
        return with_kl_loss(loss, batch, c, metrics, ratio=s)


@hookimpl
def register_algorithms(register):
    register("gspo", GSPO)
