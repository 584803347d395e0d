"""SFT: supervised fine-tuning on completions, prompt tokens masked."""

from typing import Literal

import torch

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rl.aggregation import StepNorm, aggregate
from alignflow.core.train.offline import OfflineAlgorithm, TokenBatch


class SFT(OfflineAlgorithm):
    """Supervised fine-tuning: negative log-likelihood of the completion tokens (prompt masked)."""

    class Config(PluginConfig):
        # token-mean: every completion token of the step weighs the same (HF Trainer, TRL SFTTrainer).
        loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"

    stage = "sft"
    batch_type = TokenBatch

    def loss(self, batch: TokenBatch, norm: StepNorm | None = None):
        mask = batch.mask.bool()
        nll = torch.where(mask, -batch.logps, 0.0)  # where: padded positions may hold -inf
        loss = aggregate(nll, mask, self.config.loss_agg_mode, norm)
        with torch.no_grad():
            tokens = mask.sum().clamp(min=1)
            metrics = {"loss": nll.sum() / tokens}
            if batch.correct is not None:
                metrics["token_accuracy"] = (batch.correct.bool() & mask).sum() / tokens
        return loss, metrics


@hookimpl
def register_algorithms(register):
    register("sft", SFT)
