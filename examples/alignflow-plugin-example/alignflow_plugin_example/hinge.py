"""SLiC-HF's hinge calibration loss, as a third-party preference algorithm."""

import torch
from pydantic import Field

from alignflow.core import Algorithm, PluginConfig


class Hinge(Algorithm):
    """Hinge preference loss max(0, δ − β·h) (SLiC-HF, Zhao et al. 2023, arXiv 2305.10425)."""

    class Config(PluginConfig):
        beta: float = Field(1.0, gt=0)  # scale of the log-ratio difference
        delta: float = Field(1.0, ge=0)  # margin δ

    stage = "preference"
    requires_pairs = True
    requires_reference = True

    def loss(self, batch):
        """Per-pair loss and metrics from summed completion log-probs."""
        h = (batch.policy_chosen_logps - batch.ref_chosen_logps) - (
            batch.policy_rejected_logps - batch.ref_rejected_logps
        )
        losses = torch.relu(self.config.delta - self.config.beta * h)
        return losses, {"loss": losses.detach().mean(), "rewards/margins": h.detach().mean()}
