"""RePO: rectified policy optimization, a safety constraint on every prompt (Peng et al., arXiv 2410.19933)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.errors import AlignflowError
from alignflow.core.rl.algorithm import Rollout, broadcast
from alignflow.core.rl.capabilities import CostConstrained, Stateful
from alignflow.core.rl.parts import group_normalize
from alignflow.plugins.grpo import GRPO, GRPOConfig


class RePOConfig(GRPOConfig):
    cost_reward: str = Field(description="label of the stage reward that gives the cost C (listed with weight: 0)")
    # lambda_0 and its step size: Safe-RLHF's PPO-Lagrangian script (threshold 0, lambda_init 1, lambda_lr 0.1,
    # there a step on log lambda), whose code the paper's builds on; the paper's own values were not found.
    # lambda_0 = 1 makes a correct answer that violates by 1 worth no more than a wrong one.
    lambda_init: float = Field(1.0, ge=0.0)  # lambda_0, the multiplier's start
    lambda_lr: float = Field(0.1, ge=0.0)  # step size of lambda's projected dual ascent, once per rollout
    threshold: float = 0.0  # the constraint is C - threshold <= 0 (0: the paper's C <= 0)
    # A response whose cost reward failed (None) counts as violating by this much: the constraint fails closed.
    failed_violation: float = Field(1.0, gt=0.0)


class RePO(CostConstrained, Stateful, GRPO):
    """RePO (Peng et al. 2024, arXiv 2410.19933): max over pi, min over lambda >= 0 of
    L(pi, lambda) = E[R(x, y) - lambda [C(x, y)]^+], the per-prompt constraint C(x, y) <= 0 in place of
    Safe-RLHF's E[C] <= 0, so only responses that violate pay, and a safe one never buys slack for another.

    From the paper (its abstract and a third-party summary: the full text and its code were not reachable here):
    the rectified penalty [C]^+, the min-max objective L(pi, lambda) with one multiplier, a PPO clipped surrogate.
    This implementation's choices (the paper uses PPO with token-level reward and cost critics):
    critic-free, each response's rectified reward R_i - lambda_k v_i, v_i = [C_i - threshold]^+, normalised
    within its prompt's group exactly as GRPO (its clip, k3 KL and aggregation defaults); lambda updated once
    per rollout, after the advantages used lambda_k, by projected dual ascent
    lambda_{k+1} = max(0, lambda_k + lambda_lr * mean_i v_i) (-dL/dlambda = E[v]: it grows while any response
    violates and holds when none does). One lambda, as the paper's L(pi, lambda): a per-prompt lambda_x would
    move only when prompt x is drawn again (about twice in a 40-step run over 1500 prompts), and the rectifier
    already confines the penalty to the responses that violate. A failed cost (None) counts as a violation of
    `failed_violation`. With std scaling, lambda's size only matters in groups whose rewards differ: in a group
    of equal R any lambda > 0 gives the same advantages, and a group whose every response violates alike gets
    no push at all (no on-policy gradient can tell those responses apart).
    """

    Config: ClassVar[type[RePOConfig]] = RePOConfig

    def __init__(self, config: RePOConfig | None = None):
        super().__init__(config)
        self.lam = float(self.config.lambda_init)
        # of the last rollout (`step_metrics`): the lambda its advantages used, share violating, mean C
        self.stats = {"repo/lambda": self.lam, "repo/violation_rate": 0.0, "repo/cost_mean": 0.0,
                      "repo/cost_failed": 0.0}

    @property
    def cost_reward(self) -> str:
        return self.config.cost_reward

    def violations(self, costs: Tensor) -> Tensor:
        """[B] v_i = [C_i - threshold]^+, and `failed_violation` where the cost reward failed (NaN)."""
        failed = torch.full_like(costs, self.config.failed_violation)
        return torch.where(costs.isnan(), failed, (costs - self.config.threshold).clamp(min=0.0))

    def advantages(self, rollout: Rollout):
        if rollout.costs is None:
            raise AlignflowError(f"repo reads each response's cost, but the rollout has none: the rl stage fills "
                            f"Rollout.costs from the reward named by cost_reward ({self.config.cost_reward!r})")
        v = self.violations(rollout.costs.float())
        rectified = rollout.rewards.float() - self.lam * v
        scores = group_normalize(rectified, rollout.group, scale=self.config.scale_rewards)
        scored = rollout.costs[~rollout.costs.isnan()]
        self.stats = {"repo/lambda": self.lam, "repo/violation_rate": (v > 0).float().mean().item(),
                      "repo/cost_mean": scored.float().mean().item() if len(scored) else math.nan,
                      "repo/cost_failed": float(len(v) - len(scored))}
        self.lam = max(0.0, self.lam + self.config.lambda_lr * v.mean().item())
        return broadcast(scores, rollout.response_mask), None

    def step_metrics(self) -> dict[str, float]:
        return {k: v for k, v in self.stats.items() if math.isfinite(v)}

    def state_dict(self) -> dict:
        return {"lambda": self.lam}

    def load_state_dict(self, state: dict) -> None:
        if "lambda" in state:
            self.lam = float(state["lambda"])


@hookimpl
def register_algorithms(register):
    register("repo", RePO)
