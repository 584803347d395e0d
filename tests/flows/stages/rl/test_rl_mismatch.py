"""The rollout/trainer mismatch: its metric, and truncated importance sampling (TIS) in the policy loss.

A sampler whose reported log-probs sit log 4 below the trainer's (mu = pi / 4 on every sampled token)
makes both exact: the gap is log 4, the k3 estimate of KL(mu || pi) is 4 - 1 - log 4, and every TIS
weight min(pi_old / mu, 2) is 2, so with SGD the step moves the weights exactly twice as far as the same
step with pi_old recomputed and no correction.
"""

import math

import pytest
import torch

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import PolicyBatch, sampler_corrected
from alignflow.core.spec.settings import RLSettings
from alignflow.flows.stages.rl.update import mismatch_weights
from alignflow.plugins.grpo import GRPO, GRPOConfig
from alignflow.plugins.hf import HFSampler
from alignflow.plugins.kimi import Kimi

from tests.flows.stages.rl.test_rl_stage import make_ctx, plugins, tiny, weights, write_rows  # noqa: F401

SHIFT = math.log(4.0)


class ShiftedSampler(HFSampler):
    """The hf sampler with every reported log-prob lowered by log 4."""

    def generate(self, prompt_ids, n, gen, seed):
        out = super().generate(prompt_ids, n, gen, seed)
        out.logprobs = [[v - SHIFT for v in row] for row in out.logprobs]
        return out


class Shifted:
    @staticmethod
    @hookimpl
    def register_samplers(register):
        register("shifted", ShiftedSampler)


@pytest.fixture(scope="module")
def shifted(plugins):  # noqa: F811
    plugins.add(Shifted, "test_rl_mismatch")
    yield plugins
    plugins.remove("test_rl_mismatch")


def run(tmp_path, plugins, model, algorithm="grpo", **settings):
    from alignflow.flows.stages.rl.stage import run_rl

    log = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, model, algorithm, data, log, sampler="shifted", max_steps=1, optimizer="sgd",
                   lr=0.5, grad_clip=0.0, **settings)
    return weights(run_rl(ctx).outputs["model"]), log[0][1]


def test_the_gap_between_sampler_and_trainer_is_measured(tmp_path, shifted, tiny):  # noqa: F811
    _, metrics = run(tmp_path, shifted, tiny, recompute_old_logprobs=True)
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(SHIFT, abs=1e-5)
    assert metrics["rollout/kl_sampler_trainer"] == pytest.approx(4 - 1 - SHIFT, abs=1e-4)


@pytest.mark.parametrize("algorithm", ["grpo", "kimi"])
def test_tis_weights_every_token_by_its_capped_ratio(tmp_path, shifted, tiny, algorithm):  # noqa: F811
    """grpo weights its policy term itself (its KL term, whose gradient is 0 on this first step, is not weighted);
    kimi does not (`applies_policy_weights` False), so the stage weights its whole loss."""
    start = weights(tiny)
    plain, _ = run(tmp_path / "plain", shifted, tiny, algorithm, recompute_old_logprobs=True)
    corrected, metrics = run(tmp_path / "tis", shifted, tiny, algorithm, tis_cap=2.0)
    assert metrics["rollout/tis_capped_frac"] == pytest.approx(1.0)  # pi_old / mu = 4 > 2 everywhere
    moved = [k for k in start if not torch.equal(start[k], plain[k])]
    assert moved
    step = torch.cat([(plain[k] - start[k]).flatten() for k in moved])
    step_tis = torch.cat([(corrected[k] - start[k]).flatten() for k in moved])
    assert (step_tis.norm() / step.norm()).item() == pytest.approx(2.0, rel=1e-4)
    torch.testing.assert_close(step_tis, 2 * step, rtol=1e-3, atol=1e-6)  # weights' own rounding in the deltas


def test_mismatch_weights_by_hand():
    """k = pi_old / mu per token: 1, 0.25, 9, and the IcePop band's own bounds 0.5 and 5 (kept: bounds included)."""
    old = torch.tensor([[0.5, 0.2, 0.9, 0.1, 0.5]]).log()
    mu = torch.tensor([[0.5, 0.8, 0.1, 0.2, 0.1]]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    w, m = mismatch_weights(old, mu, mask, icepop=(0.5, 5.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0, 0.5, 5.0]]))  # 0.25 < 0.5 and 9 > 5 dropped
    assert m["rollout/icepop_masked_frac"].item() == pytest.approx(2 / 5)
    w, m = mismatch_weights(old, mu, mask, tis_cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.25, 2.0, 0.5, 2.0]]))  # min(k, 2)
    assert m["rollout/tis_capped_frac"].item() == pytest.approx(2 / 5)


def test_icepop_weights_tokens_in_its_band_and_drops_the_rest(tmp_path, shifted, tiny):  # noqa: F811
    """pi_old / mu = 4 on every token: inside [0.5, 5] each token's loss is weighted by 4, so the SGD step is 4
    times the uncorrected one; outside [0.5, 3] every token's policy term is dropped and, with no KL term (the
    weights never reach one), nothing moves."""
    start = weights(tiny)
    plain, _ = run(tmp_path / "plain", shifted, tiny, recompute_old_logprobs=True)
    kept, metrics = run(tmp_path / "kept", shifted, tiny, icepop=(0.5, 5.0))
    assert metrics["rollout/icepop_masked_frac"] == 0.0
    moved = [k for k in start if not torch.equal(start[k], plain[k])]
    step = torch.cat([(plain[k] - start[k]).flatten() for k in moved])
    step_kept = torch.cat([(kept[k] - start[k]).flatten() for k in moved])
    torch.testing.assert_close(step_kept, 4 * step, rtol=1e-3, atol=1e-6)
    no_kl = {"name": "grpo", "config": {"kl_loss_coef": 0.0}}
    dropped, metrics = run(tmp_path / "dropped", shifted, tiny, no_kl, icepop=(0.5, 3.0))
    assert metrics["rollout/icepop_masked_frac"] == pytest.approx(1.0)
    assert all(torch.equal(start[k], dropped[k]) for k in start)


def test_decoupled_weights_every_token_by_the_behaviour_ratio(tmp_path, shifted, tiny):  # noqa: F811
    """The decoupled objective: the ratio against the proximal policy (pi_old recomputed: the same weights, so 1)
    and each token weighted by pi_prox / mu = 4, uncapped: with SGD the step is 4 times the uncorrected one."""
    start = weights(tiny)
    plain, _ = run(tmp_path / "plain", shifted, tiny, recompute_old_logprobs=True)
    decoupled, metrics = run(tmp_path / "decoupled", shifted, tiny, decoupled=True)
    assert metrics["rollout/behaviour_weight_mean"] == pytest.approx(4.0, rel=1e-4)
    moved = [k for k in start if not torch.equal(start[k], plain[k])]
    step = torch.cat([(plain[k] - start[k]).flatten() for k in moved])
    step_decoupled = torch.cat([(decoupled[k] - start[k]).flatten() for k in moved])
    torch.testing.assert_close(step_decoupled, 4 * step, rtol=1e-3, atol=1e-6)


def test_icepop_and_tis_are_one_choice():
    with pytest.raises(ValueError, match="set one of them"):
        RLSettings(icepop=(0.5, 5.0), tis_cap=2.0)
    with pytest.raises(ValueError, match=r"0 <= alpha <= 1 <= beta, got \[2.0, 5.0\]"):
        RLSettings(icepop=(2.0, 5.0))


# One response of two tokens, A = 1, GRPO's clip 0.2 and k3 KL with beta 0.1 (float64):
# pi_theta (0.5, 0.2), pi_old (0.25, 0.4), pi_ref (0.25, 0.1), the sampler's mu (0.05, 0.04).
# r = pi_theta / pi_old = (2, 0.5): surrogate max(-A r, -A clip(r, 0.8, 1.2)) = (-1.2, -0.5), the first clipped
# (gradient 0), the second's gradient d(-r)/d log pi_theta = -0.5. rho = pi_ref / pi_theta = 0.5 on both tokens:
# k3 = rho - 1 - ln rho = ln 2 - 0.5 = 0.193147, gradient 1 - rho = 0.5. k = pi_old / mu = (5, 10).
K3 = math.log(2.0) - 0.5
CASES = {  # weights w; per-token loss and its gradient: now w S + beta k3, before w (S + beta k3)
    # IcePop [0.5, 5]: k = 5 kept (a bound is in the band), k = 10 dropped
    "icepop": ((5.0, 0.0), dict(icepop=(0.5, 5.0)),
               [5 * -1.2 + 0.1 * K3, 0 * -0.5 + 0.1 * K3], [5 * 0 + 0.05, 0 * -0.5 + 0.05],  # -5.980685, 0.019315
               [5 * (-1.2 + 0.1 * K3), 0.0], [5 * 0.05, 0.0]),  # -5.903426, 0
    # decoupled PPO (AReaL's behaviour importance weight, no cap): k itself, (5, 10)
    "decoupled": ((5.0, 10.0), dict(),
                  [5 * -1.2 + 0.1 * K3, 10 * -0.5 + 0.1 * K3], [5 * 0 + 0.05, 10 * -0.5 + 0.05],  # -5.98, -4.98
                  [5 * (-1.2 + 0.1 * K3), 10 * (-0.5 + 0.1 * K3)], [5 * 0.05, 10 * (-0.5 + 0.05)]),
    # TIS cap 2: both capped
    "tis": ((2.0, 2.0), dict(tis_cap=2.0),
            [2 * -1.2 + 0.1 * K3, 2 * -0.5 + 0.1 * K3], [2 * 0 + 0.05, 2 * -0.5 + 0.05],  # -2.380685, -0.980685
            [2 * (-1.2 + 0.1 * K3), 2 * (-0.5 + 0.1 * K3)], [2 * 0.05, 2 * (-0.5 + 0.05)]),  # -2.361371, -0.961371
}


class WholeLoss(GRPO):
    applies_policy_weights = False  # GRPO's loss, weighted as a whole by the stage


@pytest.mark.parametrize("case", CASES)
def test_the_sampler_correction_weights_the_policy_term_not_the_kl_term(case):
    """IcePop and TIS multiply GRPO's clipped surrogate by k, and add beta k3 unweighted: verl adds its KL loss
    outside the weighted policy loss, TRL adds beta * kl after its vLLM ratio, IcePop's objective weights the
    policy term only. Weighting the sum (before) changed `grpo`'s default (beta 0.04) under either setting."""
    weights, setting, loss, grad, loss_before, grad_before = CASES[case]
    f64 = torch.float64
    old, mu = torch.tensor([[0.25, 0.4]], dtype=f64).log(), torch.tensor([[0.05, 0.04]], dtype=f64).log()
    mask = torch.ones(1, 2, dtype=f64)
    w, counted = mismatch_weights(old, mu, mask, **setting)
    torch.testing.assert_close(w, torch.tensor([weights], dtype=f64))
    # the share dropped (IcePop) or capped (TIS); decoupled: the mean weight
    assert [v.item() for v in counted.values()] == [pytest.approx({"icepop": 0.5, "tis": 1.0, "decoupled": 7.5}[case])]
    logprobs = torch.tensor([[0.5, 0.2]], dtype=f64).log().requires_grad_(True)
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=torch.ones(1, 2, dtype=f64),
                        response_mask=mask, group=torch.zeros(1, dtype=torch.long),
                        ref_logprobs=torch.tensor([[0.25, 0.1]], dtype=f64).log(), policy_weights=w)
    algo = GRPO(GRPOConfig(kl_loss_coef=0.1))
    assert algo.applies_policy_weights and not Kimi.applies_policy_weights
    per_token, _ = sampler_corrected(algo, batch)
    per_token.sum().backward()
    torch.testing.assert_close(per_token.detach()[0], torch.tensor(loss, dtype=f64))
    torch.testing.assert_close(logprobs.grad[0], torch.tensor(grad, dtype=f64))
    # before: the stage multiplied the whole per-token loss, the KL term included, as it still does for a loss that
    # does not apply the weights itself
    logprobs.grad = None
    whole, _ = sampler_corrected(WholeLoss(GRPOConfig(kl_loss_coef=0.1)), batch)
    whole.sum().backward()
    torch.testing.assert_close(whole.detach()[0], torch.tensor(loss_before, dtype=f64))
    torch.testing.assert_close(logprobs.grad[0], torch.tensor(grad_before, dtype=f64))
    # token-mean of the step: now -2.980685 (IcePop) / -1.680685 (TIS), before -2.951713 / -1.661371
    mean = aggregate(per_token.detach(), mask, "seq-mean-token-mean").item()
    assert mean == pytest.approx(sum(loss) / 2, abs=1e-12) and mean != pytest.approx(sum(loss_before) / 2)
