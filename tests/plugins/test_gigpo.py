"""GiGPO: GRPO's episode advantage plus a step advantage among the steps of a group that start from one state."""

import math

import pytest
import torch

from alignflow.core.rl.capabilities import EpisodeTurns, has
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.plugins.gigpo import GiGPO, GiGPOConfig
from alignflow.plugins.grpo import GRPO
from helpers.rollouts import make_rollout

S0, A, B, C = 10, 11, 12, 13  # state hashes: S0 the prompt, shared by every first turn
# Group 0: four episodes with terminal rewards 1, 0, 1, 0 and the states of their turns; group 1: two
# single-turn episodes, both rewarded 1, whose first state has the same hash as group 0's (other group).
EPISODES = [  # (group, reward, states of turns 0, 1, ...)
    (0, 1.0, [S0, A, B]),
    (0, 0.0, [S0, A]),
    (0, 1.0, [S0, C]),
    (0, 0.0, [S0, B, A]),
    (1, 1.0, [S0]),
    (1, 1.0, [S0]),
]
TOKENS = 2  # each turn: 2 model tokens, then 1 reply token (mask 0); a 1-token prompt first


def episode_rollout():
    """Rows laid out as the stage lays them: prompt, then per turn 2 model tokens and a reply token."""
    width = 1 + 3 * max(len(s) for _, _, s in EPISODES)
    mask = torch.zeros(len(EPISODES), width)
    turns = torch.full((len(EPISODES), width), -1)
    states = torch.zeros((len(EPISODES), width), dtype=torch.long)
    for row, (_, _, seq) in enumerate(EPISODES):
        for t, s in enumerate(seq):
            lo = 1 + 3 * t
            mask[row, lo: lo + TOKENS], turns[row, lo: lo + TOKENS], states[row, lo: lo + TOKENS] = 1, t, s
    return make_rollout([r for _, r, _ in EPISODES], group=[g for g, _, _ in EPISODES], mask=mask,
                        turns=turns, states=states)


def by_hand(scale=True, episode_stats="episodes"):
    """{(row, turn): A} worked out with gamma 0.95, omega 1."""
    eps = 1e-6
    # episode level, group 0: R = 1, 0, 1, 0, mean 0.5, centred +-0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    ae = 0.5 / (math.sqrt(1 / 3) + eps) if scale else 0.5  # 0.866025
    if episode_stats == "steps":  # each return once per turn: 1, 1, 1 | 0, 0 | 1, 1 | 0, 0, 0: mean 0.5 again,
        ae = 0.5 / (math.sqrt(10 * 0.25 / 9) + eps)  # std sqrt(10 x 0.25 / 9) = 0.527046: 0.948683
    a_e = [ae, -ae, ae, -ae, 0.0, 0.0]  # group 1: 1, 1 -> 0
    # step returns R_t = 0.95^(L - t) R, L the last turn:
    #   row 0 (L 2): S0 0.9025, A 0.95, B 1 | row 1 (L 1): S0 0, A 0 | row 2 (L 1): S0 0.95, C 1
    #   row 3 (L 2): S0 0, B 0, A 0       | rows 4, 5 (L 0): S0 1 each (group 1's own step group)
    # step group S0 of group 0: 0.9025, 0, 0.95, 0; mean 0.463125
    s0 = [0.9025, 0.0, 0.95, 0.0]
    mean = sum(s0) / 4
    centred = [x - mean for x in s0]  # 0.439375, -0.463125, 0.486875, -0.463125
    std = math.sqrt(sum(c * c for c in centred) / 3)  # sqrt(0.859067 / 3) = 0.535122
    a_s0 = [c / (std + eps) if scale else c for c in centred]  # 0.821074, -0.865457, 0.909839, -0.865457
    # step group A: row 0 turn 1 (0.95), row 1 turn 1 (0), row 3 turn 2 (0): mean 0.316667,
    # centred 0.633333, -0.316667, -0.316667, std sqrt((0.401111 + 2 * 0.100278) / 2) = 0.548483
    a_mean = 0.95 / 3
    a_std = math.sqrt(((0.95 - a_mean) ** 2 + 2 * a_mean**2) / 2)
    a_a = [(x - a_mean) / (a_std + eps) if scale else x - a_mean for x in (0.95, 0.0, 0.0)]  # 1.1547, -0.57735 x2
    # step group B: row 0 turn 2 (1), row 3 turn 1 (0): +-0.5 / (std sqrt(0.5) + eps) = +-0.707107
    a_b = 0.5 / (math.sqrt(0.5) + eps) if scale else 0.5
    # step group C: row 2 turn 1 alone: 0
    a_c = 0.0
    a_s = {(0, 0): a_s0[0], (0, 1): a_a[0], (0, 2): a_b, (1, 0): a_s0[1], (1, 1): a_a[1], (2, 0): a_s0[2],
           (2, 1): a_c, (3, 0): a_s0[3], (3, 1): -a_b, (3, 2): a_a[2], (4, 0): 0.0, (5, 0): 0.0}
    return {k: a_e[k[0]] + v for k, v in a_s.items()}


def per_turn(adv, rollout):
    """{(row, turn): the advantage every token of that turn holds} (asserting they all hold the same)."""
    out = {}
    for row in range(adv.shape[0]):
        for t in rollout.turns[row].unique().tolist():
            if t >= 0:
                values = adv[row][rollout.turns[row] == t]
                assert torch.all(values == values[0])
                out[(row, t)] = values[0].item()
    return out


def test_defaults_and_capability():
    c = GiGPOConfig()
    assert (c.gamma, c.step_weight, c.scale_rewards, c.anchor_state, c.episode_stats) == (
        0.95, 1.0, True, "observation", "episodes")
    assert (c.kl_loss_coef, c.clip_low, c.loss_agg_mode) == (0.04, 0.2, "seq-mean-token-mean")  # GRPO's loss
    assert has(GiGPO(), EpisodeTurns) and not has(GRPO(), EpisodeTurns)
    assert GiGPO(GiGPOConfig(anchor_state="history")).anchor_state == "history"


@pytest.mark.parametrize("scale, stats", [(True, "episodes"), (False, "episodes"), (True, "steps")])
def test_advantages_by_hand(scale, stats):
    r = episode_rollout()
    algo = GiGPO(GiGPOConfig(scale_rewards=scale, episode_stats=stats))
    adv, returns = algo.advantages(r)
    assert returns is None
    got, want = per_turn(adv, r), by_hand(scale, stats)
    assert got == pytest.approx(want, abs=1e-5)
    assert adv[r.response_mask == 0].abs().sum() == 0  # prompt, replies, padding: no advantage
    if stats == "steps":
        assert got[(2, 1)] == pytest.approx(0.948683, abs=1e-5)  # a lone step: the episode's advantage alone
    if scale and stats == "episodes":
        assert got[(0, 0)] == pytest.approx(0.866025 + 0.821074, abs=1e-5)
        assert got[(0, 1)] == pytest.approx(0.866025 + 1.154701, abs=1e-5)
        assert got[(3, 2)] == pytest.approx(-0.866025 - 0.577350, abs=1e-5)
        assert got[(2, 1)] == pytest.approx(0.866025, abs=1e-5)  # a lone step: the episode's advantage alone
    # 10 of group 0's 10 steps but C's one share a state; group 1's two steps share S0: 11 of 12
    assert algo.step_metrics()["gigpo/anchored_steps"] == pytest.approx(11 / 12)


def test_step_weight_and_gamma():
    r = episode_rollout()
    full, _ = GiGPO().advantages(r)
    episode_only, _ = GiGPO(GiGPOConfig(step_weight=0.0)).advantages(r)
    half, _ = GiGPO(GiGPOConfig(step_weight=0.5)).advantages(r)
    torch.testing.assert_close(half, (full + episode_only) / 2)
    # gamma 1: every step of group 0's S0 group returns its episode's reward 1, 0, 1, 0: A^S0 = A^E
    undiscounted = per_turn(GiGPO(GiGPOConfig(gamma=1.0)).advantages(r)[0], r)
    assert undiscounted[(0, 0)] == pytest.approx(2 * 0.866025, abs=1e-5)


def test_single_turn_episodes_are_grpo_scaled_by_one_plus_omega():
    """The first turns of a group share the prompt's state, so on single-turn episodes A^S = A^E: omega 0 gives
    GRPO's advantages exactly, omega 1 twice them, and the loss follows."""
    rewards, group = (1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.tensor([[1, 1, 1, 0]] * 4 + [[1, 1, 0, 0]] * 4)
    turns = torch.where(mask.bool(), 0, -1)
    states = torch.where(mask.bool(), 7 + group[:, None], 0)
    r = make_rollout(rewards, group=group, mask=mask, ref=-1.2, turns=turns, states=states)
    grpo, _ = GRPO().advantages(r)
    assert grpo.abs().sum() > 0
    torch.testing.assert_close(GiGPO(GiGPOConfig(step_weight=0.0)).advantages(r)[0], grpo)
    torch.testing.assert_close(GiGPO().advantages(r)[0], 2 * grpo)
    logprobs = torch.full(mask.shape, -0.9, requires_grad=True)
    batch = r.minibatch(torch.arange(8), logprobs=logprobs, advantages=grpo)
    torch.testing.assert_close(GiGPO(GiGPOConfig(step_weight=0.0)).loss(batch)[0], GRPO().loss(batch)[0])


@pytest.mark.parametrize("scale", [True, False])
def test_a_group_of_one_episode_gets_no_advantage(scale):
    """Eq. 3 on a group of one episode: R - mean_j R_j = 0, so A^E = 0 (as GRPO's group of one), with or without
    the std. verl-agent gives such a group mean 0 and std 1, so A^E = R there (1 on every model token below). Its
    two steps are alone in their states: A^S = 0, so the episode trains nothing here. Pinned: a deliberate
    difference, the paper's formula."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])  # a prompt token, two turns of two model tokens, a reply between
    turns = torch.tensor([[-1, 0, 0, -1, 1, 1]])
    states = torch.tensor([[0, S0, S0, 0, A, A]])
    r = make_rollout([1.0], group=[0], mask=mask, turns=turns, states=states)
    adv, _ = GiGPO(GiGPOConfig(scale_rewards=scale)).advantages(r)
    assert torch.equal(adv, torch.zeros(1, 6))


def test_refuses_a_rollout_without_episodes():
    with pytest.raises(ValueError, match="multi-turn episodes"):
        GiGPO().advantages(make_rollout())


def test_the_stage_marks_each_turn_and_its_anchor_state():
    """to_batch places the episodes' turn starts and state hashes on the model's tokens of each turn."""
    # one episode: prompt of 2 tokens; completion = turn 0 (3 tokens), reply (2), turn 1 (2 tokens)
    episodes = {"turn_starts": [[0, 5]], "turn_history": [[101, 102]], "turn_observation": [[201, 202]],
                "turns": [2]}
    samples = Samples(prompt_ids=[[1, 2]], completion_ids=[[3, 4, 5, 6, 7, 8, 9]], logprobs=None, group=[0],
                      reward=[1.0], correct=[True], truncated=[False], values={}, loss_mask=[[1, 1, 1, 0, 0, 1, 1]],
                      episodes=episodes)
    plain = to_batch(samples, 0, 16).rollout
    assert plain.turns is None and plain.states is None  # only for an EpisodeTurns algorithm
    r = to_batch(samples, 0, 16, anchor="observation").rollout
    assert r.turns.tolist() == [[-1, -1, 0, 0, 0, -1, -1, 1, 1]]
    assert r.states.tolist() == [[0, 0, 201, 201, 201, 0, 0, 202, 202]]
    assert to_batch(samples, 0, 16, anchor="history").rollout.states.tolist() == [[0, 0, 101, 101, 101, 0, 0, 102,
                                                                                    102]]
