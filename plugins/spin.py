"""SPIN: Self-Play Fine-Tuning (Chen et al. 2024, ICML, arXiv 2401.01335), one iteration's loss."""

from typing import ClassVar

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.plugins.dpo import DPO


class SPIN(DPO):
    """SPIN's loss: DPO's logistic loss on (data completion y, the model's own generation y').

    l(lambda log p(y)/p_t(y) - lambda log p(y')/p_t(y')), l(t) = log(1 + exp(-t)), with p_t the model the
    iteration starts from. That is DPO with y_w = y, y_l = y' and the reference = the stage's initial policy
    (give the stage no `reference` input), so this is a DPO preset: lambda is DPO's beta, 0.1 as in the
    official uclaml/SPIN configs, and there is no label smoothing (SPIN's target is the data, not a noisy
    label). Building y' and chaining the iterations are the pipeline's job.
    """

    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0.0)  # the paper's lambda; uclaml/SPIN `beta: 0.1` in every iteration
        label_smoothing: ClassVar[float] = 0.0  # not a field: DPO's loss reads it, a YAML value is rejected


@hookimpl
def register_algorithms(register):
    register("spin", SPIN)
