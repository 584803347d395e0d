"""DPO: Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290)."""

import torch.nn.functional as F
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.train.offline import PairBatch, PreferenceAlgorithm


class DPO(PreferenceAlgorithm):
    """Direct Preference Optimization (Rafailov et al. 2023): -log sigma(beta * log-ratio margin).

    With label_smoothing eps > 0 it is conservative DPO (Mitchell 2023): -(1 - eps) log sigma(m) - eps log sigma(-m).
    TRL 1.16's `sigmoid` loss ignores label_smoothing, and its `robust` loss (Chowdhury et al. 2024) is a
    different formula: (-(1 - eps) log sigma(m) + eps log sigma(-m)) / (1 - 2 eps).
    """

    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0.0)  # paper: beta = 0.1 for most experiments
        label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)  # probability that a preference label is flipped

    requires_reference = True

    def pair_losses(self, batch: PairBatch):
        beta, eps = self.config.beta, self.config.label_smoothing
        chosen = beta * (batch.policy_chosen_logps - batch.ref_chosen_logps)
        rejected = beta * (batch.policy_rejected_logps - batch.ref_rejected_logps)
        margin = chosen - rejected  # beta * h
        losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return losses, chosen.detach(), rejected.detach()


@hookimpl
def register_algorithms(register):
    register("dpo", DPO)
