"""Opt-in capabilities of an RL algorithm: what only some algorithms need from the `rl` stage.

An algorithm subclasses a capability beside its RL base (`class ExPO(GuidedSamples, GRPO)`) and overrides
its members; the stage asks `has(algo, Capability)` and drives the feature only then:

    GuidedSamples    guided_prompt, guided_samples            ExPO's self-explanations for unsolved groups
    Replay           fresh_groups, buffer_steps, replay_groups groups of earlier steps trained on again
    Regenerate       max_gen_batches                          refill rounds after `filter_groups` (DAPO)
    CostConstrained  cost_reward                              a weight-0 reward's raw values as Rollout.costs
    Stateful         state_dict, load_state_dict              state kept in the stage's checkpoints (RePO)
    ExtraParameters  extra_parameters                         trainable parameters beside the model's (λ-GRPO)
    RewardComponents (a marker)                               each reward's raw values as Rollout.reward_values (GDPO)
    TeacherDistributions uses_teacher_logits, distribution_loss a loss on the teacher's and student's logits (GKD)
    EpisodeTurns     anchor_state                             each token's turn and state: Rollout.turns, states (GiGPO)

The same members on a plain `RLAlgorithm` subclass still work for one release (see `LegacyMembers`).
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from alignflow.core.rewards import reward_labels

if TYPE_CHECKING:
    from alignflow.core.rl.algorithm import RLAlgorithm


class GuidedSamples:
    """For a group whose completions are all wrong, the stage samples `guided_samples` completions after
    `guided_prompt(prompt, answer)` and adds those the verifier accepts as `guided` rows of the group."""

    def guided_prompt(self, prompt: str, answer: str) -> str | None:
        """A prompt showing the reference `answer`; None: no guided samples for this prompt."""
        return None

    @property
    def guided_samples(self) -> int:
        """Completions drawn after each `guided_prompt`."""
        return 0


class Replay:
    """Each step generates `fresh_groups` groups and trains on them plus groups of the last `buffer_steps`
    steps, which `replay_groups` picks; a replayed row keeps the pi_old it was generated with."""

    def fresh_groups(self, prompts_per_step: int) -> int:
        """Prompt groups generated at each step; the batch's other groups are replayed from earlier steps."""
        return prompts_per_step

    @property
    def buffer_steps(self) -> int:
        """Steps a generated group stays replayable after the step that generated it (0: none is kept)."""
        return 0

    def replay_groups(self, ages: Tensor, n: int, generator: torch.Generator) -> Tensor:
        """Indices of the buffered groups to train on again (`ages`: steps since each was generated), at
        most n. Default: n of them uniformly at random, without replacement."""
        return torch.randperm(len(ages), generator=generator)[:n]


class Regenerate:
    """The stage generates more rounds while `filter_groups` leaves the batch short."""

    @property
    def max_gen_batches(self) -> int:
        """Generation rounds the stage may run to refill a batch that `filter_groups` shrank (0: no cap)."""
        return 1


class CostConstrained:
    """The raw values of the stage reward labelled `cost_reward` reach `advantages` as `Rollout.costs`, apart
    from the total reward (so that reward must have weight 0)."""

    @property
    def cost_reward(self) -> str | None:
        """The label of the cost reward; None: no costs."""
        return None


class Stateful:
    """State the algorithm updates itself, outside any optimizer (RePO's multiplier): the stage saves
    `state_dict()` with each checkpoint and hands it to `load_state_dict` on resume."""

    def state_dict(self) -> dict:
        """Plain Python values."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""


class ExtraParameters:
    """Trainable parameters that are not the model's (λ-GRPO's λ): the stage adds them to its optimizer."""

    def extra_parameters(self) -> list[nn.Parameter]:
        return []


class RewardComponents:
    """Each stage reward's raw values reach `advantages` as `Rollout.reward_values` [B, K] (NaN where the reward
    returned None), their weights as `Rollout.reward_weights`, beside the weighted total."""


class TeacherDistributions:
    """When `uses_teacher_logits`, each micro-step runs the frozen teacher on the micro-batch (no_grad) and calls
    `distribution_loss` with both models' next-token logits at the response positions, instead of `loss`."""

    @property
    def uses_teacher_logits(self) -> bool:
        return False

    def distribution_loss(self, batch, student_logits: Tensor, teacher_logits: Tensor):
        """[b, T] per-token loss and detached metrics from [b, T, V] logits (position t predicts token t)."""
        raise NotImplementedError


class EpisodeTurns:
    """On multi-turn episodes (a stage with an `environment:`), `Rollout.turns` [B, T] numbers each model
    token's turn in its episode (0, 1, ...; -1 on prompt, reply and padding positions) and `Rollout.states`
    [B, T] holds on the same tokens a 63-bit hash of the state that turn started from (0 elsewhere): with
    `anchor_state` "history" everything the model had read before the turn (prompt, its earlier turns and the
    environment's replies, as token ids), with "observation" the environment's latest observation alone (the
    prompt's messages before turn 0, else its reply to the previous turn, as messages). Equal hashes: equal
    states. The stage refuses an algorithm with this capability on a stage without an environment."""

    @property
    def anchor_state(self) -> str:
        return "history"


CAPABILITIES = (GuidedSamples, Replay, Regenerate, CostConstrained, Stateful, ExtraParameters, RewardComponents)


def members(capability: type) -> list[str]:
    """The public members a capability defines."""
    return [name for name in vars(capability) if not name.startswith("_")]


class LegacyMembers:
    """Deprecated: every capability's members on `RLAlgorithm` itself, as before capabilities existed. An
    algorithm that overrides one without subclassing its capability is still treated as having it (`has`),
    with a DeprecationWarning; this base goes in the next release."""


for _capability in CAPABILITIES:  # the same functions and defaults, so old and new paths give the same numbers
    for _name in members(_capability):
        setattr(LegacyMembers, _name, vars(_capability)[_name])

_warned: set[tuple[type, str]] = set()


@lru_cache(maxsize=None)
def _legacy_overrides(cls: type, capability: type) -> tuple[str, ...]:
    """The members of `capability` that `cls` overrides on top of `LegacyMembers` (pre-capability code); a
    class's answer never changes, and the rl stage asks every step."""
    owners = {name: next((c for c in cls.__mro__ if name in vars(c)), None) for name in members(capability)}
    return tuple(name for name, owner in owners.items() if owner not in (None, LegacyMembers))


def has(algo: "RLAlgorithm", capability: type) -> bool:
    """Whether the stage drives `capability` for `algo`: it subclasses it, or (deprecated) overrides one
    of its members on a plain RLAlgorithm subclass."""
    if isinstance(algo, capability):
        return True
    legacy = _legacy_overrides(type(algo), capability)
    for name in legacy:
        if (type(algo), name) not in _warned:
            _warned.add((type(algo), name))
            warnings.warn(f"{type(algo).__name__}.{name} overrides the deprecated RLAlgorithm.{name}: subclass "
                          f"{capability.__module__}.{capability.__name__} too (RLAlgorithm.{name} goes in "
                          "the next release)", DeprecationWarning, stacklevel=2)
    return bool(legacy)


def cost_reward_problem(algo: "RLAlgorithm", rewards: list) -> str | None:
    """What keeps a stage's rewards (spec `RewardRef`s: name, weight) from giving `algo` its costs; None when
    nothing does. Rewards are labelled as the stage's RewardSet labels them (NAME, NAME_i for a repeated one)."""
    name = algo.cost_reward if has(algo, CostConstrained) else None
    if name is None:
        return None
    weights = dict(zip(reward_labels([r.name for r in rewards]), (r.weight for r in rewards)))
    if name not in weights:
        return (f"algorithm.config.cost_reward: {name!r} is not a reward of the stage (rewards: "
                f"{', '.join(weights) or 'none'})")
    if weights[name] != 0:
        return (f"rewards: {name!r} is the algorithm's cost_reward, which must stay out of the total reward: "
                f"give it weight: 0 (it has weight {weights[name]:g})")
    return None
