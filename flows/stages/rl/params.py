"""Trainable parameters of an `ExtraParameters` algorithm (λ-GRPO's λ) in the `rl` stage: they ride on the
policy module, so the optimizer steps them and checkpoints hold them, and leave it before the model is saved."""

from __future__ import annotations

import torch

from alignflow.core.errors import SpecError
from alignflow.core.rl.capabilities import ExtraParameters, has

EXTRA = "rl_extra_parameters"  # the submodule of the policy that holds them


def attach_parameters(ctx, model: torch.nn.Module, algo) -> None:
    """Add the algorithm's own parameters to the policy module (none without `ExtraParameters`)."""
    params = algo.extra_parameters() if has(algo, ExtraParameters) else []
    if not params:
        return
    if ctx.settings.zero_stage == 3:  # ZeRO-3 partitions them, and the loss reads them outside any forward
        raise SpecError(f"stage {ctx.name!r}, settings.zero_stage: {ctx.spec.algorithm.name} trains its own "
                        "parameters in the loss, which ZeRO-3 would partition: use zero_stage 0, 1 or 2")
    model.add_module(EXTRA, torch.nn.ParameterList(params))


def detach_parameters(model: torch.nn.Module) -> None:
    """Remove them again: the stage's output is an ordinary transformers checkpoint."""
    if hasattr(model, EXTRA):
        delattr(model, EXTRA)
