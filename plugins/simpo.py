"""SimPO: Simple Preference Optimization with a Reference-Free Reward (Meng et al. 2024, arXiv 2405.14734)."""

import torch.nn.functional as F
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm, per_token


class SimPO(PreferenceAlgorithm):
    """SimPO (Meng et al. 2024): -log sigma(beta/|y_w| log pi(y_w) - beta/|y_l| log pi(y_l) - gamma).

    No reference model. gamma = gamma_beta_ratio * beta, as in the official code (TRL's CPOTrainer
    instead takes an absolute `simpo_gamma`).
    """

    class Config(PluginConfig):
        beta: float = Field(2.0, gt=0.0)  # official SimPOConfig default; released models use 2.0-10
        gamma_beta_ratio: float = Field(0.25, ge=0.0)  # official default; README suggests tuning in [0, 1]

    def pair_losses(self, batch: PairBatch):
        beta = self.config.beta
        chosen = beta * per_token(batch.policy_chosen_logps, batch.chosen_lengths)
        rejected = beta * per_token(batch.policy_rejected_logps, batch.rejected_lengths)
        losses = -F.logsigmoid(chosen - rejected - self.config.gamma_beta_ratio * beta)
        return losses, chosen.detach(), rejected.detach()


@hookimpl
def register_algorithms(register):
    register("simpo", SimPO)
