"""SLiC-HF's hinge calibration loss, as a third-party preference algorithm."""

import torch
from pydantic import Field

from alignflow.core import PairBatch, PluginConfig, PreferenceAlgorithm


class Hinge(PreferenceAlgorithm):
    """Hinge preference loss max(0, δ − β·h) (SLiC-HF, Zhao et al. 2023, arXiv 2305.10425)."""

    class Config(PluginConfig):
        beta: float = Field(1.0, gt=0)  # scale of the log-ratio difference h
        delta: float = Field(1.0, ge=0)  # margin δ

    requires_reference = True

    def pair_losses(self, batch: PairBatch):
        chosen = self.config.beta * (batch.policy_chosen_logps - batch.ref_chosen_logps)
        rejected = self.config.beta * (batch.policy_rejected_logps - batch.ref_rejected_logps)
        losses = torch.relu(self.config.delta - (chosen - rejected))
        return losses, chosen.detach(), rejected.detach()
