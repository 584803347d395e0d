"""The named seed streams give exactly the values of the expressions they replaced (numbers unchanged)."""

import random

import pytest
import torch

from alignflow.core import seeds

CASES = [(0, 0, 0, 0), (0, 3, 1, 0), (7, 12, 2, 1), (42, 999, 0, 3), (123_456, 5, 4, 7)]


@pytest.mark.parametrize("seed,step,round_,rank", CASES)
def test_each_stream_is_the_old_expression(seed, step, round_, rank):
    assert seeds.rollout(seed, step, round_, rank) == seed * 1_000_003 + step * 101 + round_ + rank * 104_729
    assert seeds.guided(seed, step, rank) == seed * 1_000_003 + step * 101 + rank * 104_729 + 15_485_867
    assert seeds.priority(seed, step, round_) == seed * 1_000_003 + step * 101 + round_ + 6_700_417
    assert seeds.replay(seed, step) == seed * 1_000_003 + step + 15_485_863
    assert seeds.minibatches(seed, step) == seed * 1_000_003 + step
    assert seeds.round_rows(seed, round_) == (seed if round_ == 0 else seed + 7_919 * round_)
    assert seeds.epoch_order(seed, step) == seed * 100_003 + step
    assert seeds.chunk(seed, 64 * round_) == seed + 64 * round_
    assert seeds.critique(seed, 2 * round_ + 1) == seed + (2 * round_ + 1) * 1_000_003
    assert seeds.step_label_rollouts(seed) == seed + 1_000_003
    assert seeds.selector(seed, step) == f"{seed}:{step}" and seeds.init(seed) == seed


def test_a_named_generator_draws_what_the_old_one_drew():
    old = torch.randperm(10, generator=torch.Generator().manual_seed(5 * 1_000_003 + 2 + 15_485_863))
    assert torch.equal(torch.randperm(10, generator=seeds.generator(seeds.replay(5, 2))), old)
    assert random.Random(seeds.selector(3, 1)).random() == random.Random("3:1").random()


def test_the_streams_of_one_step_never_share_a_seed():
    """Rounds, ranks, guided samples, prioritised draws and replay of a step stay apart (the minibatch order
    is another generator's, and equals round 0's sampling seed at step 0: kept, as today's numbers)."""
    seed, step = 11, 4
    values = [seeds.rollout(seed, step, r, k) for r in range(4) for k in range(8)]
    values += [seeds.guided(seed, step, k) for k in range(8)]
    values += [seeds.priority(seed, step, r) for r in range(4)] + [seeds.replay(seed, step)]
    assert len(set(values)) == len(values)


def test_the_minibatch_order_shares_step_0s_value_with_the_first_round():
    assert seeds.minibatches(9, 0) == seeds.rollout(9, 0, 0, 0)
