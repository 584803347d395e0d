"""Bradley-Terry pairwise reward-model loss (Bradley and Terry 1952; as in InstructGPT, arXiv 2203.02155)."""

import torch
import torch.nn.functional as F
from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import OfflineAlgorithm, RewardBatch, example_mean


class BradleyTerry(OfflineAlgorithm):
    """Bradley-Terry reward model: -log sigma(r(x, y_w) - r(x, y_l) - m), optional reward centring.

    The margin m comes from the dataset's `margin` column when it has one (Llama 2), else from the config.
    Centring adds c * (r_w + r_l)^2 (Eisenstein et al. 2023; TRL's center_rewards_coefficient).
    """

    class Config(PluginConfig):
        margin: float = 0.0  # m in -log sigmoid(r_chosen - r_rejected - m), for rows without a `margin` column
        center_rewards_coefficient: float = Field(0.0, ge=0.0)  # Eisenstein et al. use 0.01

    stage = "reward_model"
    requires_pairs = True
    batch_type = RewardBatch

    def loss(self, batch: RewardBatch, norm: StepNorm | None = None):
        chosen, rejected = batch.chosen_scores, batch.rejected_scores
        margin = batch.margin if batch.margin is not None else self.config.margin
        losses = -F.logsigmoid(chosen - rejected - margin)
        losses = losses + self.config.center_rewards_coefficient * (chosen + rejected) ** 2
        with torch.no_grad():
            metrics = {
                "loss": losses.mean(),
                "accuracy": (chosen > rejected).float().mean(),
                "rewards/chosen": chosen.mean(),
                "rewards/rejected": rejected.mean(),
                "rewards/margins": (chosen - rejected).mean(),
            }
        return example_mean(losses, norm), metrics


@hookimpl
def register_algorithms(register):
    register("bradley_terry", BradleyTerry)
