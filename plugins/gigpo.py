"""GiGPO: GRPO's episode-level advantage plus a step-level one among the steps of a group that start from the same
state (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training", arXiv 2505.10978)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from alignflow.core import hookimpl
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.rl.capabilities import EpisodeTurns
from alignflow.core.rl.parts import group_normalize, group_sum
from alignflow.plugins.grpo import GRPO, GRPOConfig


class GiGPOConfig(GRPOConfig):
    gamma: float = Field(0.95, ge=0.0, le=1.0)  # discount of the step returns R_t (the paper's)
    step_weight: float = Field(1.0, ge=0.0)  # omega in A = A^E + omega A^S (the paper's 1)
    # what makes two turns' states equal: the environment's latest observation (the paper's, and verl-agent's
    # anchor observation) or everything the model had read before the turn (a stricter key: equal histories)
    anchor_state: Literal["observation", "history"] = "observation"
    # A^E's mean and std over the group's episodes (the paper's), or over its steps, each episode's return once
    # per turn it took (verl-agent's default, `compute_mean_std_cross_steps`)
    episode_stats: Literal["episodes", "steps"] = "episodes"
    # scale_rewards (GRPO's) sets F_norm at both levels: the group's std (the paper's), or 1 (its "w/o std")


def gigpo_advantages(rewards: Tensor, group: Tensor, turns: Tensor, states: Tensor, gamma: float = 0.95,
                     step_weight: float = 1.0, scale: bool = True, episode_stats: str = "episodes"
                     ) -> tuple[Tensor, Tensor]:
    """[B, T] A^E + step_weight A^S on each model token of a turn (0 where `turns` is -1), and [S] the size of
    each step's group.

    A step is one (episode, turn); its return R_t = gamma^(L - t) R, L the episode's last turn and R its reward
    (placed at the last turn). Steps of one prompt group whose `states` are equal form a step group; A^S =
    (R_t - mean) / (std + 1e-6) within it, std unbiased, 0 for a step alone (`scale=False`: R_t - mean)."""
    rewards = rewards.float()
    rows, cols = (turns >= 0).nonzero(as_tuple=True)
    width = int(turns.max()) + 1 if rows.numel() else 1
    keys, inverse = torch.unique(rows * width + turns[rows, cols], return_inverse=True)  # one key per step
    step_row, step_turn = keys // width, keys % width
    step_state = torch.zeros_like(keys).scatter(0, inverse, states[rows, cols])
    last = torch.zeros_like(rewards, dtype=torch.long).scatter_reduce(0, step_row, step_turn, "amax")
    returns = gamma ** (last[step_row] - step_turn).float() * rewards[step_row]
    _, step_group = torch.unique(torch.stack([group[step_row], step_state], 1), dim=0, return_inverse=True)
    n = int(step_group.max()) + 1 if step_group.numel() else 0
    size = group_sum(torch.ones_like(returns), step_group, n)[step_group]
    if episode_stats == "steps":
        episode = group_normalize(rewards[step_row], group[step_row], scale=scale)
    else:
        episode = group_normalize(rewards, group, scale=scale)[step_row]
    step = episode + step_weight * group_normalize(returns, step_group, scale=scale)
    out = torch.zeros(turns.shape, dtype=torch.float32, device=turns.device)
    out[rows, cols] = step[inverse]
    return out, size


class GiGPO(EpisodeTurns, GRPO):
    """GiGPO (Feng et al. 2025, arXiv 2505.10978): for the G episodes of a prompt,

        A^E(tau_i) = (R(tau_i) - mean_j R(tau_j)) / F_norm           episode level: GRPO on episode returns
        A^S(s, a_t^i) = (R_t^i - mean R_t over U_s) / F_norm          step level, within the anchor state s
        A = A^E + omega A^S                                           on every token of the model's turn t

    Anchor states: a state s the model acts from at several steps (turns) of the group's episodes, in one
    episode or in several, at any turn index, gathers those steps into a step group U_s. Their discounted
    returns R_t = sum_{k >= t} gamma^(k-t) r_k compare the actions taken from the same state, a per-step
    credit a critic would otherwise give, at no extra rollout: only hashing. The stage's reward is the
    episode's total, placed at its last turn L, so R_t = gamma^(L-t) R. A step alone in its state gets A^S = 0,
    as in the paper and verl-agent. F_norm is the group's unbiased std + 1e-6 (`scale_rewards: false`: 1, at
    both levels). A group of one episode gets A^E = 0, the paper's Eq. 3 (R minus its own mean), as GRPO;
    verl-agent gives it mean 0 and std 1, so A^E = R there. A^E's statistics are over the episodes; verl-agent
    by default takes them over the steps (each episode once per turn), `episode_stats: steps`. States match
    exactly (verl-agent can also cluster similar observations, which is not offered here).

    A state is a hash of the environment's latest observation (`anchor_state: observation`: the prompt before
    the first turn, a tool's result after a call), the paper's choice and verl-agent's; `history` hashes
    every token before the turn, so only steps after identical histories share a group. The loss is this
    project's GRPO (clip 0.2, k3 KL 0.04, seq-mean-token-mean), so it differs from `grpo` only in its
    advantages; verl-agent's recipes set their own KL and aggregation, settable here.

    Every episode of a group starts from the same prompt, so the first turns always form a step group: on
    single-turn episodes A^S = A^E and A = (1 + omega) A^E, GRPO's advantage scaled (GRPO's exactly with
    omega = 0). Without episodes (a stage with no environment) there are no turns: the stage refuses, and so
    does `advantages` on a rollout without `turns`.
    """

    Config: ClassVar[type[GiGPOConfig]] = GiGPOConfig

    def __init__(self, config=None):
        super().__init__(config)
        self._metrics: dict[str, float] = {}

    @property
    def anchor_state(self) -> str:
        return self.config.anchor_state

    def advantages(self, rollout: Rollout):
        c = self.config
        if rollout.turns is None or rollout.states is None:
            raise ValueError("gigpo needs multi-turn episodes (Rollout.turns and states): run it on a stage with "
                             "an `environment:`, or use grpo on single completions")
        turns = rollout.turns.where(rollout.response_mask.bool(), -1)
        adv, size = gigpo_advantages(rollout.rewards, rollout.group, turns, rollout.states, c.gamma, c.step_weight,
                                     c.scale_rewards, c.episode_stats)
        self._metrics = {"gigpo/anchored_steps": (size > 1).float().mean().item() if size.numel() else 0.0,
                         "gigpo/step_group_size": size.mean().item() if size.numel() else 0.0}
        return adv, None

    def step_metrics(self) -> dict[str, float]:
        """The share of steps whose state another step of the group shares, and the size of a step's group,
        averaged over steps."""
        return dict(self._metrics)


@hookimpl
def register_algorithms(register):
    register("gigpo", GiGPO)
