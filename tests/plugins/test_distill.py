"""On-policy distillation: per-token advantage log pi_teacher - log pi_old, clipped surrogate, token-mean."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.distill import Distill, DistillConfig

# 2 responses x 3 tokens; the second response has 2 tokens (its third position is padding).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, 0.0]])  # log pi_old of the sampled tokens
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -3.0, 0.0]])
# r_t = log pi_teacher - log pi_old: [0.5, -0.5, 0] and [0.5, -2.0, (pad)]
KL_ADVANTAGES = torch.tensor([[0.5, -0.5, 0.0], [0.5, -2.0, 0.0]])


def rollout(teacher=TEACHER, rewards=(1.0, 0.0)):
    return Rollout(rewards=torch.tensor(rewards), group=torch.tensor([0, 0]), response_mask=MASK, old_logprobs=OLD,
                   teacher_logprobs=teacher, max_new_tokens=3)


def step(algo, r, logprobs):
    """The step loss on the whole rollout and its metrics."""
    adv, returns = algo.advantages(r)
    assert returns is None
    per_token, metrics = algo.loss(r.minibatch(torch.arange(2), logprobs=logprobs, advantages=adv))
    return aggregate(per_token, MASK, algo.loss_agg_mode), metrics


def test_defaults_follow_the_recipe():
    algo = Distill()
    c = algo.config
    assert (c.kl_coef, c.kl_discount, c.reward_weight, c.scale_rewards) == (1.0, 0.0, 0.0, False)
    assert (c.clip_low, c.clip_high, c.kl_loss_coef) == (0.2, 0.2, 0.0)
    assert algo.loss_agg_mode == "token-mean"
    assert Distill.requires_teacher and not algo.requires_reference and not algo.requires_whole_groups
    assert Distill(DistillConfig(kl_loss_coef=0.01)).requires_reference  # an optional KL to a reference too


def test_advantage_is_the_negative_sampled_reverse_kl_per_token():
    adv, _ = Distill().advantages(rollout())
    torch.testing.assert_close(adv, KL_ADVANTAGES)
    adv, _ = Distill(DistillConfig(kl_coef=2.0)).advantages(rollout())
    torch.testing.assert_close(adv, 2 * KL_ADVANTAGES)


def test_loss_and_gradient_on_policy():
    logprobs = OLD.clone().requires_grad_()  # pi_theta = pi_old: every ratio is 1
    loss, metrics = step(Distill(), rollout(), logprobs)
    loss.backward()
    # token-mean of -A over 5 tokens: -(0.5 - 0.5 + 0 + 0.5 - 2.0) / 5 = 0.3
    assert loss.item() == pytest.approx(0.3)
    # d/dlogp (-A r) / 5 = -A / 5; padding gets nothing
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.1, 0.1, 0.0], [-0.1, 0.4, 0.0]]))
    # mean of log pi_old - log pi_teacher over the tokens: (-0.5 + 0.5 + 0 - 0.5 + 2.0) / 5
    assert metrics["distill/reverse_kl"].item() == pytest.approx(0.3)


def test_importance_weight_is_against_pi_old_and_clipped():
    # Off-policy: the advantages stay those of pi_old's samples; the surrogate weights them by r = pi/pi_old.
    shift = torch.tensor([[math.log(1.1), math.log(1.1), 0.0], [math.log(1.5), math.log(0.9), 0.0]])
    logprobs = (OLD + shift).requires_grad_()
    loss, _ = step(Distill(), rollout(), logprobs)
    loss.backward()
    # -(0.5*1.1 - 0.5*1.1 + 0 + 0.5*1.2 - 2.0*0.9) / 5: token (1, 0) has A > 0 and r = 1.5, clipped at 1.2
    assert loss.item() == pytest.approx(-(0.55 - 0.55 + 0.6 - 1.8) / 5)
    # gradient -A r / 5, and 0 where the clip holds r at 1.2
    expected = torch.tensor([[-0.5 * 1.1, 0.5 * 1.1, 0.0], [0.0, 2.0 * 0.9, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_a_teacher_equal_to_the_student_teaches_nothing():
    algo = Distill()
    adv, _ = algo.advantages(rollout(teacher=OLD.clone()))
    assert torch.equal(adv, torch.zeros_like(adv))
    logprobs = OLD.clone().requires_grad_()
    loss, metrics = step(algo, rollout(teacher=OLD.clone()), logprobs)
    loss.backward()
    assert loss.item() == 0.0 and metrics["distill/reverse_kl"].item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros_like(OLD))


def test_verifier_reward_is_mixed_in_with_its_weight():
    # rewards [1, 0] centred in their group: [0.5, -0.5]; weight 0.5 adds +0.25 / -0.25 on every response token
    adv, _ = Distill(DistillConfig(reward_weight=0.5)).advantages(rollout())
    torch.testing.assert_close(adv, torch.tensor([[0.75, -0.25, 0.25], [0.25, -2.25, 0.0]]))
    # scaled as GRPO: unbiased std of [1, 0] is sqrt(1/2), so +-0.5 / (sqrt(0.5) + 1e-6)
    adv, _ = Distill(DistillConfig(reward_weight=0.5, scale_rewards=True)).advantages(rollout())
    a = 0.5 * 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, KL_ADVANTAGES + torch.tensor([[a], [-a]]) * MASK)


def test_discount_accumulates_the_future_rewards():
    # gamma 0.5: [0.5 + 0.5 * (-0.5 + 0.5 * 0), -0.5, 0] and [0.5 + 0.5 * (-2.0), -2.0, (pad)]
    adv, _ = Distill(DistillConfig(kl_discount=0.5)).advantages(rollout())
    torch.testing.assert_close(adv, torch.tensor([[0.25, -0.5, 0.0], [-0.5, -2.0, 0.0]]))
    # gamma 1: the return-to-go, the sampled reverse KL of the rest of the sequence
    adv, _ = Distill(DistillConfig(kl_discount=1.0)).advantages(rollout())
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.5, 0.0], [-1.5, -2.0, 0.0]]))


def test_a_teacher_that_rules_a_token_out_is_clamped():
    # log pi_teacher = -30 against log pi_old = -1: r = -29, clamped at -10 nats (KL_CLAMP)
    teacher = TEACHER.clone()
    teacher[0, 0] = -30.0
    adv, _ = Distill().advantages(rollout(teacher=teacher))
    assert adv[0, 0].item() == -10.0


def test_the_minibatch_carries_the_teacher_rows_and_a_missing_teacher_is_an_error():
    r = rollout()
    view = r.minibatch(torch.tensor([1]), logprobs=OLD[1:], advantages=KL_ADVANTAGES)
    assert torch.equal(view.teacher_logprobs, TEACHER[1:])
    assert torch.equal(r.select(torch.tensor([False, True])).teacher_logprobs, TEACHER[1:])
    no_teacher = Rollout(rewards=torch.tensor([1.0, 0.0]), group=torch.tensor([0, 0]), response_mask=MASK,
                         old_logprobs=OLD, max_new_tokens=3)
    with pytest.raises(ValueError, match="teacher_logprobs.*`teacher` input"):
        Distill().advantages(no_teacher)
