"""Dr. GRPO: GRPO without the length and std normalisations (Liu et al., arXiv 2503.20783)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import AggMode
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.grpo import GRPO, GRPOConfig


class DrGRPOConfig(GRPOConfig):
    kl_loss_coef: float = Field(0.0, ge=0.0)  # official scripts: --beta 0
    loss_agg_mode: AggMode = "seq-mean-token-sum-norm"
    scale_rewards: bool = False  # A_i = R_i - mean_j R_j
    norm_constant: int | None = Field(None, ge=1)  # None: the generation budget max_new_tokens


class DrGRPO(GRPO):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

    Loss (1/B) sum_i sum_t l_{i,t} / L with L the generation budget, as the official oat code
    (`generate_max_length`), not the realised or padded length; advantages are not divided by the std.
    """

    Config: ClassVar[type[DrGRPOConfig]] = DrGRPOConfig
    requires_reference: ClassVar[bool] = False

    def norm_constant(self, rollout: Rollout) -> float:
        return float(self.config.norm_constant or rollout.max_new_tokens)


@hookimpl
def register_algorithms(register):
    register("dr_grpo", DrGRPO)
