"""Math-Shepherd process reward model loss (Wang et al. 2024, arXiv 2312.08935): step-wise cross-entropy."""

import torch
import torch.nn.functional as F

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import OfflineAlgorithm, StepBatch


class MathShepherd(OfflineAlgorithm):
    """-[y log sigma(s) + (1 - y) log(1 - sigma(s))] at each step's last token, averaged over steps.

    y is the step's label: hard (1 when some completion of the prefix reaches the answer) or soft
    (the share that does). The mean runs over the labelled steps of the whole optimizer step, as
    TRL's PRM trainer averages over labelled tokens; the paper writes a per-solution sum.
    """

    class Config(PluginConfig):
        pass

    stage = "prm"
    batch_type = StepBatch

    def loss(self, batch: StepBatch, norm: StepNorm | None = None):
        mask = batch.mask.bool()
        losses = F.binary_cross_entropy_with_logits(batch.scores, batch.labels.to(batch.scores.dtype),
                                                    reduction="none")
        losses = torch.where(mask, losses, 0.0)
        count = norm.num_tokens if norm is not None else float(mask.sum())
        with torch.no_grad():
            steps = mask.sum().clamp(min=1)
            predicted, wanted = batch.scores > 0, batch.labels > 0.5
            metrics = {
                "loss": losses.sum() / steps,
                "accuracy": ((predicted == wanted) & mask).sum() / steps,
                "steps/positive": (wanted & mask).sum() / steps,
                "steps/score": torch.where(mask, torch.sigmoid(batch.scores), 0.0).sum() / steps,
            }
        return losses.sum() / max(count, 1.0), metrics


@hookimpl
def register_algorithms(register):
    register("math_shepherd", MathShepherd)
