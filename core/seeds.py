"""Named seed streams: every seed a stage derives from its stage seed, in one place.

Each function is one stream; the offsets are large primes so that no two streams of a step share a
seed. Changing any value here changes what a pipeline samples, and so every number it reports.
"""

from __future__ import annotations

import torch

STEP = 1_000_003  # spreads the steps of one stage seed apart, so that seeds s and s + 1 share no stream
ROUND = 101  # separates a step's generation rounds (round 0 is the step's first)
RANK = 104_729  # separates the sampling seeds of data-parallel ranks (rank 0 keeps one process's)
REFILL = 7_919  # separates the prompt draws of a step's refill rounds
GUIDED = 15_485_867  # separates a step's guided samples from its rounds'
REPLAY = 15_485_863  # separates the replay draws from the other streams of a step
PRIORITY = 6_700_417  # separates the prioritised prompt draws from the other streams of a step
EPOCH = 100_003  # spreads the epochs of a seeded walk over the rows
PHASE = 1_000_003  # critique and revision calls draw other numbers than the answers they follow
ROLLOUT = 1_000_003  # step-label rollouts draw other numbers than the solutions they complete
TURN = 7_927  # separates the sampler calls of an episode's turns
EPISODE = 104_723  # separates environment seeds from sampling seeds


def generator(seed: int) -> torch.Generator:
    """A CPU generator at `seed`: the source of every seeded permutation and draw of the stages."""
    return torch.Generator().manual_seed(seed)


def init(seed: int) -> int:
    """The global torch seed a training stage sets before it builds its engine (value heads, LoRA, dropout)."""
    return seed


def epoch_order(seed: int, epoch: int) -> int:
    """The permutation of the rows in pass `epoch` of a seeded walk (`training.step_rows`)."""
    return seed * EPOCH + epoch


def round_rows(seed: int, round_: int) -> int:
    """The seed of the walk that picks an rl step's prompts for generation round `round_`."""
    return seed if round_ == 0 else seed + REFILL * round_


def rollout(seed: int, step: int, round_: int, rank: int) -> int:
    """The sampling seed of rl `step`'s generation round `round_` on data-parallel `rank`."""
    return seed * STEP + step * ROUND + round_ + rank * RANK


def guided(seed: int, step: int, rank: int) -> int:
    """The sampling seed of rl `step`'s guided samples on `rank`."""
    return seed * STEP + step * ROUND + rank * RANK + GUIDED


def priority(seed: int, step: int, round_: int) -> int:
    """The prioritised prompt draw of rl `step`'s round `round_`."""
    return seed * STEP + step * ROUND + round_ + PRIORITY


def replay(seed: int, step: int) -> int:
    """Which buffered groups rl `step` replays."""
    return seed * STEP + step + REPLAY


def minibatches(seed: int, step: int) -> int:
    """The order in which rl `step` puts its groups into minibatches. At step 0 the same value as round 0's
    sampling seed on rank 0, but of a CPU permutation, not the sampler's generator."""
    return seed * STEP + step


def chunk(seed: int, first: int) -> int:
    """The sampling seed of a sampler call whose first prompt is at place `first` of the call's rows."""
    return seed + first


def turn(seed: int, turn_: int) -> int:
    """The sampling seed of turn `turn_` of a batch of episodes whose call seed is `seed` (turn 0 keeps it)."""
    return seed + turn_ * TURN


def episode(seed: int, row: int) -> int:
    """The seed an environment starts the episodes of row `row` of a call with: one per row, so the group of
    episodes of one prompt starts alike."""
    return seed * EPISODE + row


def critique(seed: int, call: int) -> int:
    """The sampling seed of critique call `call` (1, 2, ... alternating critiques and revisions)."""
    return seed + call * PHASE


def step_label_rollouts(seed: int) -> int:
    """The sampling seed of the rollouts that label each step of a solution."""
    return seed + ROLLOUT


def selector(seed: int, step: int) -> str:
    """The `random.Random` seed of selector number `step` of a select stage."""
    return f"{seed}:{step}"
