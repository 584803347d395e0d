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
from alignflow.core.spec.settings import RLSettings
from alignflow.flows.stages.rl.update import mismatch_weights
from alignflow.plugins.hf import HFSampler

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


def run(tmp_path, plugins, model, **settings):
    from alignflow.flows.stages.rl.stage import run_rl

    log = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, model, "grpo", data, log, sampler="shifted", max_steps=1, optimizer="sgd",
                   lr=0.5, grad_clip=0.0, **settings)
    return weights(run_rl(ctx).outputs["model"]), log[0][1]


def test_the_gap_between_sampler_and_trainer_is_measured(tmp_path, shifted, tiny):  # noqa: F811
    _, metrics = run(tmp_path, shifted, tiny, recompute_old_logprobs=True)
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(SHIFT, abs=1e-5)
    assert metrics["rollout/kl_sampler_trainer"] == pytest.approx(4 - 1 - SHIFT, abs=1e-4)


def test_tis_weights_every_token_by_its_capped_ratio(tmp_path, shifted, tiny):  # noqa: F811
    start = weights(tiny)
    plain, _ = run(tmp_path / "plain", shifted, tiny, recompute_old_logprobs=True)
    corrected, metrics = run(tmp_path / "tis", shifted, tiny, tis_cap=2.0)
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
    times the uncorrected one; outside [0.5, 3] every token is dropped and nothing moves."""
    start = weights(tiny)
    plain, _ = run(tmp_path / "plain", shifted, tiny, recompute_old_logprobs=True)
    kept, metrics = run(tmp_path / "kept", shifted, tiny, icepop=(0.5, 5.0))
    assert metrics["rollout/icepop_masked_frac"] == 0.0
    moved = [k for k in start if not torch.equal(start[k], plain[k])]
    step = torch.cat([(plain[k] - start[k]).flatten() for k in moved])
    step_kept = torch.cat([(kept[k] - start[k]).flatten() for k in moved])
    torch.testing.assert_close(step_kept, 4 * step, rtol=1e-3, atol=1e-6)
    dropped, metrics = run(tmp_path / "dropped", shifted, tiny, icepop=(0.5, 3.0))
    assert metrics["rollout/icepop_masked_frac"] == pytest.approx(1.0)
    assert all(torch.equal(start[k], dropped[k]) for k in start)


def test_icepop_and_tis_are_one_choice():
    with pytest.raises(ValueError, match="set one of them"):
        RLSettings(icepop=(0.5, 5.0), tis_cap=2.0)
    with pytest.raises(ValueError, match=r"0 <= alpha <= 1 <= beta, got \[2.0, 5.0\]"):
        RLSettings(icepop=(2.0, 5.0))
