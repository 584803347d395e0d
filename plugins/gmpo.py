"""GMPO: the geometric mean of clipped token ratios per response (Zhao et al. 2025, arXiv 2507.20673)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import KLLossConfig, PolicyBatch, broadcast, with_kl_loss
from alignflow.core.rl.parts import clamp_log_ratio, masked_mean
from alignflow.plugins.grpo import GRPO


class GMPOConfig(KLLossConfig):
    # Log space, hence names of their own (a GRPO `clip_low: 0.2` would silently mean something else): token
    # log-ratios are clipped to [-log_clip_low, log_clip_high]; the paper's ratio range (e^-0.4, e^0.4).
    log_clip_low: float = Field(0.4, gt=0.0)
    log_clip_high: float = Field(0.4, gt=0.0)  # upper bound of a token's log-ratio
    kl_loss_coef: float = Field(0.0, ge=0.0)  # official scripts: --beta 0
    # (1/G) sum_i of one value per response: the 1/|o_i| already sits in the geometric mean's exponent.
    loss_agg_mode: AggMode = "seq-mean-token-mean"
    scale_rewards: bool = True  # official code: --critic_type grpo, (R - mean) / std


class GMPO(GRPO):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): loss_i = -A_i exp((1/|o_i|) sum_t l_i,t), the geometric mean
    of token ratios, with l_i,t = min(log r_t, clip(log r_t)) for A_i > 0 and max(...) for A_i < 0.

    That is the paper's sgn(A_i) prod_t |min(r_t A_i, clip(r_t, e^-eps, e^eps) A_i)|^(1/|o_i|): tokens are
    clipped one by one, in log space, pessimistically for the advantage's sign (official code
    callsys/GMPO `train_zero_math_gmpo.py`, verl `geo_mean`, TRL `GMPOTrainer`), before the mean. A clipped
    token loses its gradient; the others keep theirs, each weighted A_i * ratio_i / |o_i|. The advantage of a
    response is the mean of its token advantages (verl); with group advantages that is A_i. A_i = 0 gives 0.
    """

    Config: ClassVar[type[GMPOConfig]] = GMPOConfig
    requires_reference: ClassVar[bool] = False

    def loss(self, batch: PolicyBatch) -> tuple[Tensor, dict[str, Tensor]]:
        c, mask = self.config, batch.response_mask
        weights = mask.to(batch.logprobs.dtype)
        lengths = weights.sum(-1).clamp(min=1.0)
        adv = (batch.advantages * weights).sum(-1) / lengths
        # Past the clamp a token's log-ratio counts as +-log_ratio_clamp in the mean: None to follow TRL exactly.
        log_ratio = clamp_log_ratio(batch.logprobs - batch.old_logprobs, c.log_ratio_clamp)
        bounded = log_ratio.clamp(-c.log_clip_low, c.log_clip_high)
        positive, negative = (adv > 0)[:, None], (adv < 0)[:, None]
        # PPO's pessimism per token: with A > 0 a ratio above e^eps_high stops pulling, with A < 0 one below e^-eps_low
        kept = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
        ratio = ((kept * weights).sum(-1) / lengths).exp()
        loss = broadcast(-adv * ratio, weights)
        metrics = {
            "actor/clip_low_frac": masked_mean((negative & (log_ratio < -c.log_clip_low)).float(), mask),
            "actor/clip_high_frac": masked_mean((positive & (log_ratio > c.log_clip_high)).float(), mask),
            "actor/ratio_mean": ratio.mean(),  # mean over responses of the geometric-mean ratio
        }
        return with_kl_loss(loss, batch, c, metrics)


@hookimpl
def register_algorithms(register):
    register("gmpo", GMPO)
