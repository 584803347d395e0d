"""Rows whose loss and gradient are exactly 0 (groups with all-zero advantages) are not forwarded in the update:
the same weights as training them, in fewer forwards."""

import json

import pytest
import torch

from alignflow.core import hookimpl
from alignflow.core.train.models import load_model
from alignflow.core.rl.algorithm import PolicyGradient, Rollout
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.plugins.expo import ExPO
from alignflow.plugins.grpo import GRPO
from alignflow.plugins.ppo import PPO
from helpers.plugins import registered


def first_even(prompts, completions, completion_ids, answer, **columns):
    """0 for every row whose answer is "dead" (a group of these has all-zero advantages); else the parity of the
    first completion token."""
    return [0.0 if a == "dead" else float(ids[0] % 2 == 0) for ids, a in zip(completion_ids, answer)]


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("first_even", first_even)


@pytest.fixture(scope="module")
def plugins():
    with registered(Rewards, "test_rl_inert") as p:
        yield p


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def rollout(groups, advantages_rows, guided=None):
    mask = torch.ones(len(groups), 3)
    return Rollout(rewards=torch.zeros(len(groups)), group=torch.tensor(groups), response_mask=mask,
                   old_logprobs=torch.zeros_like(mask), max_new_tokens=3, guided=guided), \
        torch.tensor(advantages_rows, dtype=torch.float32)[:, None] * mask


def test_inert_rows_are_whole_groups_with_every_advantage_zero():
    r, adv = rollout([5, 5, 7, 7, 9, 9], [1.0, -1.0, 0.0, 0.0, 0.0, 0.5])
    adv[0, 2] = 0.0  # a zero token in a live row does not make the row inert
    assert GRPO(GRPO.Config(kl_loss_coef=0.0)).inert_rows(r, adv).tolist() == [False, False, True, True, False, False]
    # group 9 has one zero row: not inert, since a loss coupling a group's rows must see the whole group


def test_no_row_is_inert_under_a_kl_term_a_critic_or_a_guided_sft_term():
    r, adv = rollout([1, 1, 2, 2], [0.0, 0.0, 0.0, 0.0], guided=torch.tensor([False, False, False, True]))
    assert GRPO(GRPO.Config(kl_loss_coef=0.04)).inert_rows(r, adv) is None  # the KL term has a gradient
    assert PPO(PPO.Config(kl_loss_coef=0.0)).inert_rows(r, adv) is None  # the critic trains on every row
    assert ExPO(ExPO.Config(kl_loss_coef=0.0)).inert_rows(r, adv).tolist() == [True, True, True, False]


def stage(tmp_path, plugins, tiny, data, log):
    spec = StageSpec(kind="rl", inputs={"model": str(tiny), "dataset": str(data)},
                     algorithm={"name": "grpo", "config": {"kl_loss_coef": 0.0}}, rewards=["first_even"], sampler="hf")
    s = RLSettings(max_steps=2, prompts_per_step=4, group_size=4, micro_batch_size=4, lr=1e-2, save_every=10,
                   generation={"max_new_tokens": 3})
    (tmp_path / "work").mkdir(parents=True)
    return StageContext("rl", spec, s, {"model": tiny, "dataset": data}, tmp_path / "work",
                        tmp_path / "checkpoints", 0, lambda m, step: log.append(m), plugins)


@pytest.mark.parametrize("answers, trained_per_step", [
    (["dead", "x", "dead", "x"], 8),  # the two dead groups (8 of 16 rows) never reach the loss
    (["dead"] * 4, 4),  # every row inert: one micro-batch of 4 at weight 0 stands for the step's zero gradient
])
def test_skipping_inert_rows_gives_the_weights_of_training_them(tmp_path, plugins, tiny, monkeypatch, answers,
                                                                trained_per_step):
    """Prompts whose rows always score 0 are skipped, and the weights after two steps are those of the update
    that forwards and backwards every row (the step's normaliser counts the skipped rows)."""
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": a}) + "\n" for i, a in enumerate(answers)))
    forwards = []
    real = PolicyGradient.loss
    monkeypatch.setattr(PolicyGradient, "loss", lambda self, batch: forwards.append(len(batch.group)) or
                        real(self, batch))
    log = []
    skipping = load_model(run_rl(stage(tmp_path / "a", plugins, tiny, data, log)).outputs["model"])
    trained = sum(forwards)
    monkeypatch.setattr(PolicyGradient, "inert_rows", lambda self, r, a: None)
    forwards.clear()
    full = load_model(run_rl(stage(tmp_path / "b", plugins, tiny, data, [])).outputs["model"])
    assert sum(forwards) == 2 * 16  # 2 steps of 16 rows
    assert trained <= 2 * trained_per_step
    assert all(m["actor/skipped_rows"] >= answers.count("dead") / 4 for m in log[:2])
    a, b = skipping.state_dict(), full.state_dict()
    if "x" in answers:
        assert any(not torch.equal(v, v0) for v, v0 in zip(a.values(), load_model(tiny).state_dict().values()))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
