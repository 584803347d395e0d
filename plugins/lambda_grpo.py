"""λ-GRPO: GRPO with a learnable per-response length preference (Wang et al., arXiv 2510.06870)."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor, nn

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import PolicyBatch
from alignflow.core.rl.capabilities import ExtraParameters
from alignflow.core.rl.parts import group_ids, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class LambdaGRPOConfig(GRPOConfig):
    kl_loss_coef: float = Field(0.0, ge=0.0)  # no KL-to-reference term by default
    loss_agg_mode: AggMode = "token-mean"  # lambda = 0 is then DAPO's token-level loss
    lambda_init: float = 0.0  # lambda at the start (learned from there); 0: DAPO's token-level loss
    lift: float = Field(1 / 9, gt=0.0)  # r in h_i = 1 + r z_i; r < 1/sqrt(G-1) keeps h > 0 for every group
    min_lift: float = Field(1e-6, gt=0.0)  # clamp on h, so h ** lambda stays defined for any r


class LambdaGRPO(ExtraParameters, GRPO):
    """λ-GRPO (Wang et al. 2025, arXiv 2510.06870): weights f_i = G softmax_i(h_i^λ) on each response's surrogate.

    From the paper (abstract and third-party summaries): standardised length z_i within the group, lift
    h_i = 1 + r z_i, softmax of h_i^λ over the group multiplying the token-level clipped surrogate, λ learned;
    λ = 0 is DAPO's token-level loss, λ < 0 favours short responses (GRPO-like), λ > 0 long ones.
    Not established by the paper (its exact lambda training is not public); our reconstruction: population std for z; the factor G so weights
    average 1; r = 1/9 fixed; h clamped at 1e-6; λ trained by the same loss with the policy's optimizer.
    """

    Config: ClassVar[type[LambdaGRPOConfig]] = LambdaGRPOConfig
    requires_reference: ClassVar[bool] = False
    requires_whole_groups: ClassVar[bool] = True  # the softmax runs over each prompt's responses

    def __init__(self, config: LambdaGRPOConfig | None = None):
        super().__init__(config)
        # shape [1], not a scalar: DeepSpeed's engine cannot broadcast 0-dim parameters
        self.lam = nn.Parameter(torch.tensor([float(self.config.lambda_init)]))

    def extra_parameters(self) -> list[nn.Parameter]:
        return [self.lam]

    def surrogate_weights(self, batch: PolicyBatch) -> Tensor:
        lengths = batch.response_mask.sum(-1).float()
        inverse, n = group_ids(batch.group)
        count = group_sum(torch.ones_like(lengths), inverse, n)
        mean = group_sum(lengths, inverse, n) / count
        centred = lengths - mean[inverse]
        std = (group_sum(centred**2, inverse, n) / count).sqrt()
        z = centred / std.clamp(min=1e-6)[inverse]  # equal lengths: z = 0, uniform weights
        lift = (1 + self.config.lift * z).clamp(min=self.config.min_lift)
        logits = lift ** self.lam.to(lift.device)
        # Softmax within each group; subtracting the group max keeps exp() finite and cancels exactly.
        group_max = torch.zeros(n, device=lift.device)
        group_max = group_max.scatter_reduce(0, inverse, logits.detach(), "amax", include_self=False)
        e = (logits - group_max[inverse]).exp()
        return count[inverse] * e / group_sum(e, inverse, n)[inverse]

    def loss(self, batch: PolicyBatch):
        loss, metrics = super().loss(batch)
        metrics["actor/lambda"] = self.lam.detach()[0].clone()
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("lambda_grpo", LambdaGRPO)
