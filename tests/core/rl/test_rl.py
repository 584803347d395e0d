"""The RL contract: Rollout slicing, the base algorithm defaults, the shared clipped policy-gradient loss."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm, aggregate
from alignflow.core.rl.algorithm import PolicyGradient, PolicyGradientConfig, RLAlgorithm, Rollout


def make_rollout(**overrides) -> Rollout:
    fields = dict(
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        group=torch.tensor([0, 0, 1, 1]),
        response_mask=torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]),
        old_logprobs=torch.full((4, 3), -1.0),
        max_new_tokens=3,
        correct=torch.tensor([1.0, 0.0, 0.0, 1.0]),
    )
    return Rollout(**{**fields, **overrides})


def test_rollout_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="old_logprobs has 2 positions"):
        make_rollout(old_logprobs=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="rewards has 3 rows"):
        make_rollout(rewards=torch.zeros(3))


def test_rollout_select_and_lengths():
    r = make_rollout()
    assert r.lengths.tolist() == [2, 3, 1, 2]
    kept = r.select(torch.tensor([False, False, True, True]))
    assert kept.group.tolist() == [1, 1] and kept.rewards.tolist() == [0.0, 1.0]
    assert kept.ref_logprobs is None and kept.max_new_tokens == 3


def test_rollout_cat_keeps_groups_of_rounds_apart():
    r = make_rollout()
    joined = Rollout.cat([r, r.select(torch.tensor([2, 3]))])
    assert joined.group.tolist() == [0, 0, 1, 1, 3, 3]
    assert joined.response_mask.shape == (6, 3) and joined.correct.tolist()[-2:] == [0.0, 1.0]


def test_minibatch_slices_rollout_tensors_but_not_current_outputs():
    r = make_rollout(values=torch.arange(12.0).view(4, 3))
    adv = torch.arange(12.0).view(4, 3) * 10
    idx = torch.tensor([1, 3])
    current = torch.zeros(2, 3, requires_grad=True)
    b = r.minibatch(idx, logprobs=current, advantages=adv, returns=adv + 1, values=current)
    assert b.logprobs is current and b.values is current
    torch.testing.assert_close(b.advantages, adv[idx])
    torch.testing.assert_close(b.returns, adv[idx] + 1)
    torch.testing.assert_close(b.old_values, r.values[idx])
    assert b.group.tolist() == [0, 1] and b.correct.tolist() == [0.0, 1.0]


def test_base_algorithm_defaults():
    algo = RLAlgorithm()
    r = make_rollout()
    assert algo.stage == "rl" and algo.filter_groups(r).all() and algo.extra_parameters() == []
    assert algo.max_gen_batches == 1 and algo.norm_constant(r) is None and algo.loss_agg_mode == "token-mean"


class Centred(PolicyGradient):
    """A test variant: advantage = reward on every token."""

    def advantages(self, rollout):
        return rollout.rewards[:, None] * rollout.response_mask, None


def test_policy_gradient_reference_follows_kl_coefficient():
    assert not Centred().requires_reference
    assert Centred(PolicyGradientConfig(kl_loss_coef=0.1)).requires_reference


def test_policy_gradient_loss_adds_weighted_kl_and_reports_metrics():
    algo = Centred(PolicyGradientConfig(kl_loss_coef=0.5, kl_loss_estimator="k1"))
    r = make_rollout(ref_logprobs=torch.full((4, 3), -1.5))
    adv, _ = algo.advantages(r)
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])) - 1.0
    loss, metrics = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    # token (0,0): ratio 1.5, A = 1, clipped to -1.2; k1 = log p - log ref = (log 1.5 - 1) + 1.5
    assert loss[0, 0].item() == pytest.approx(-1.2 + 0.5 * (math.log(1.5) + 0.5))
    # token (1,0): ratio 1, A = 0: only the KL term 0.5 * 0.5
    assert loss[1, 0].item() == pytest.approx(0.25)
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(1 / 8)  # 8 valid tokens
    assert metrics["actor/clip_low_frac"].item() == 0.0
    assert metrics["actor/ratio_mean"].item() == pytest.approx((1.5 + 7) / 8)
    assert metrics["actor/kl_ref"].item() == pytest.approx((math.log(1.5) + 0.5 + 7 * 0.5) / 8)


def test_micro_batches_sum_to_the_full_batch_loss():
    algo = Centred()
    r = make_rollout()
    adv, _ = algo.advantages(r)
    logprobs = torch.randn(4, 3) * 0.1 - 1.0
    full, _ = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    whole = aggregate(full, r.response_mask, algo.loss_agg_mode)
    parts = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    norm = StepNorm.of([r.response_mask[p] for p in parts])
    summed = sum(
        aggregate(algo.loss(r.minibatch(p, logprobs=logprobs[p], advantages=adv))[0], r.response_mask[p],
                  algo.loss_agg_mode, norm)
        for p in parts
    )
    torch.testing.assert_close(summed, whole)


def drive(algo, rollout) -> torch.Tensor:
    """One optimizer step as the rl stage runs it, naming no algorithm; returns the step loss."""
    rollout = rollout.select(algo.filter_groups(rollout))
    advantages, returns = algo.advantages(rollout)
    parts = [torch.arange(0, 4), torch.arange(4, 8)]  # whole groups of G = 4
    norm = StepNorm.of([rollout.response_mask[p] for p in parts], algo.norm_constant(rollout))
    torch.manual_seed(0)
    total = 0.0
    for p in parts:
        logprobs = (rollout.old_logprobs[p] + 0.05 * torch.randn(4, 5)).requires_grad_()
        values = (rollout.values[p] + 0.1).requires_grad_()
        batch = rollout.minibatch(p, logprobs=logprobs, advantages=advantages, returns=returns, values=values)
        per_token, metrics = algo.loss(batch)
        loss = aggregate(per_token, batch.response_mask, algo.loss_agg_mode, norm)
        if algo.requires_critic:
            loss = loss + aggregate(algo.value_loss(batch)[0], batch.response_mask, algo.loss_agg_mode, norm)
        loss.backward()
        assert torch.isfinite(logprobs.grad).all() and logprobs.grad.abs().sum() > 0
        assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
        total = total + loss.detach()
    return total


REQUIRED_CONFIG = {"repo": {"cost_reward": "cost"}}  # config fields without a default


def test_every_registered_rl_algorithm_runs_through_the_contract():
    from alignflow.core import get_plugins

    rl = [e for e in get_plugins().algorithms if getattr(e.obj, "stage", None) == "rl"]
    expected = {"grpo", "dapo", "dr_grpo", "lambda_grpo", "reinforce_pp", "rloo", "disco", "ppo",
                      "ngrpo", "gspo", "gmpo", "cispo", "sapo", "kimi", "offpolicy_grpo", "distill", "rto",
                      "expo"}
    assert expected <= {e.name for e in rl}
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]] * 2)
    correct = torch.tensor([1.0, 0, 0, 1, 0, 1, 0, 0])
    step_mask = torch.zeros(8, 5)
    step_mask[:, 0] = 1.0  # one step per response (for process-supervised algorithms)
    rollout = make_rollout(rewards=correct, correct=correct, group=torch.arange(8) // 4, response_mask=mask,
                           old_logprobs=torch.full((8, 5), -1.0), ref_logprobs=torch.full((8, 5), -1.1),
                           values=torch.full((8, 5), 0.5), teacher_logprobs=torch.full((8, 5), -0.9),
                           max_new_tokens=5,
                           step_rewards=step_mask * torch.linspace(0, 1, 8)[:, None], step_mask=step_mask,
                           costs=torch.tensor([1.0, 0, -1, 0, 2, 0, 0, float("nan")]),
                           # two turns per episode (for EpisodeTurns algorithms): the first from the prompt's state,
                           # the second from one of two states
                           turns=torch.where(mask.bool(), (torch.arange(5) >= 2).long(), -1),
                           states=torch.where(mask.bool(), torch.where(torch.arange(5) >= 2,
                                                                       torch.arange(8)[:, None] % 2 + 1, 0), 0))
    for entry in rl:
        algo = entry.obj(entry.obj.Config(**REQUIRED_CONFIG.get(entry.name, {})))
        assert isinstance(algo, RLAlgorithm)
        assert torch.isfinite(drive(algo, rollout)), entry.name
