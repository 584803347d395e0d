"""RePO: GRPO advantages of R_i - lambda_k [C_i]^+, projected dual ascent on lambda, fail-closed costs, the
weight-0 cost reward (stage and preflight), and lambda across a resumed rl stage."""

import json
import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core import SpecError, hookimpl
from alignflow.core.errors import AlignflowError
from alignflow.core.train.models import load_model
from alignflow.core.rl.algorithm import Rollout, cost_reward_problem
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import RewardRef, StageSpec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.plugins.grpo import GRPO
from alignflow.plugins.repo import RePO, RePOConfig
from helpers.plugins import registered

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def rollout(rewards, costs, group=(0, 0, 0, 0)):
    n = len(rewards)
    return Rollout(rewards=torch.tensor(rewards), group=torch.tensor(group), response_mask=MASK[:n],
                   old_logprobs=torch.full((n, 3), -1.0), max_new_tokens=3, costs=torch.tensor(costs))


def test_defaults_are_grpos_and_the_cost_reward_is_required():
    algo = RePO(RePOConfig(cost_reward="forbidden"))
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, c.kl_loss_estimator) == (0.2, 0.2, 0.04, "k3")
    assert algo.loss_agg_mode == "seq-mean-token-mean" and algo.requires_reference and c.scale_rewards
    assert (c.lambda_init, c.lambda_lr, c.threshold, c.failed_violation) == (1.0, 0.1, 0.0, 1.0)
    assert algo.cost_reward == "forbidden" and GRPO().cost_reward is None
    with pytest.raises(ValidationError, match="cost_reward"):
        RePOConfig()
    with pytest.raises(ValidationError, match="lambda_init"):
        RePOConfig(cost_reward="c", lambda_init=-1.0)


def test_advantages_and_lambda_update_follow_the_formula():
    algo = RePO(RePOConfig(cost_reward="c", lambda_init=1.0, lambda_lr=0.1))
    adv, returns = algo.advantages(rollout([1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 1.0, -1.0]))
    # v = [C]^+ = [2, 0, 1, 0]; rectified R - 1 * v = [-1, 1, -1, 0]; mean -0.25, centred [-0.75, 1.25, -0.75, 0.25]
    # unbiased var (0.5625 + 1.5625 + 0.5625 + 0.0625) / 3 = 11/12; A = centred / (sqrt(11/12) + 1e-6)
    std = math.sqrt(11 / 12) + 1e-6
    torch.testing.assert_close(adv, torch.tensor([-0.75, 1.25, -0.75, 0.25])[:, None] / std * MASK)
    assert returns is None
    # lambda_1 = max(0, 1 + 0.1 * mean(v)) = 1 + 0.1 * 3/4 = 1.075
    assert algo.lam == pytest.approx(1.075)
    assert algo.stats == {"repo/lambda": 1.0, "repo/violation_rate": 0.5, "repo/cost_mean": 0.5,
                          "repo/cost_failed": 0.0}
    # The next rollout uses lambda_1: R = [1, 0], v = [1, 0] -> rectified [1 - 1.075, 0] = [-0.075, 0]
    # mean -0.0375, centred [-0.0375, 0.0375], unbiased std 0.0375 * sqrt(2): A = [-1, 1] / sqrt(2)
    adv, _ = algo.advantages(rollout([1.0, 0.0], [1.0, 0.0], group=(0, 0)))
    a = 0.0375 / (0.0375 * math.sqrt(2) + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-a, a]))
    assert algo.stats["repo/lambda"] == pytest.approx(1.075) and algo.lam == pytest.approx(1.075 + 0.1 * 0.5)


def test_lambda_holds_when_nothing_violates_and_groups_stay_apart():
    algo = RePO(RePOConfig(cost_reward="c", lambda_init=0.5))
    # C <= 0 everywhere: the advantages are GRPO's, lambda stays
    r = rollout([1.0, 0.0, 0.0, 1.0], [0.0, -3.0, -1.0, 0.0], group=(0, 0, 1, 1))
    adv, _ = algo.advantages(r)
    torch.testing.assert_close(adv, GRPO().advantages(r)[0])
    assert algo.lam == 0.5 and algo.stats["repo/violation_rate"] == 0.0


def test_threshold_shifts_the_constraint():
    algo = RePO(RePOConfig(cost_reward="c", threshold=1.5, lambda_lr=1.0, lambda_init=0.0))
    algo.advantages(rollout([0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 1.5, 3.5]))
    # v = [C - 1.5]^+ = [0.5, 0, 0, 2]: lambda_1 = 0 + 1.0 * 2.5 / 4
    assert algo.lam == pytest.approx(0.625) and algo.stats["repo/violation_rate"] == 0.5


def test_a_failed_cost_counts_as_a_violation():
    algo = RePO(RePOConfig(cost_reward="c", lambda_init=2.0, lambda_lr=0.1, failed_violation=1.0))
    adv, _ = algo.advantages(rollout([1.0, 1.0, 1.0, 1.0], [math.nan, 0.0, 0.0, 0.0]))
    # v = [1, 0, 0, 0] (failed: failed_violation); rectified [1 - 2, 1, 1, 1] = [-1, 1, 1, 1]: mean 0.5,
    # centred [-1.5, 0.5, 0.5, 0.5], unbiased var (2.25 + 3 * 0.25) / 3 = 1
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.5, 0.5, 0.5, 0.5]) / (1 + 1e-6))
    assert algo.lam == pytest.approx(2.0 + 0.1 * 0.25)
    assert algo.stats["repo/cost_failed"] == 1.0 and algo.stats["repo/cost_mean"] == 0.0  # over scored costs
    no_costs = Rollout(rewards=torch.ones(2), group=torch.zeros(2, dtype=torch.long),
                       response_mask=torch.ones(2, 1), old_logprobs=torch.zeros(2, 1), max_new_tokens=1)
    with pytest.raises(AlignflowError, match="Rollout.costs from the reward named by cost_reward"):
        algo.advantages(no_costs)


def test_the_step_metrics_give_lambda_and_the_violations():
    algo = RePO(RePOConfig(cost_reward="c", kl_loss_coef=0.0))
    assert algo.step_metrics()["repo/lambda"] == 1.0  # before any rollout: lambda_0
    r = rollout([1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0])
    algo.advantages(r)
    # the lambda the advantages used (1.0), not the one after this rollout's ascent step (1.0 + 0.1 x 0.25)
    assert algo.step_metrics() == {"repo/lambda": 1.0, "repo/violation_rate": 0.25, "repo/cost_mean": 0.25,
                                   "repo/cost_failed": 0.0}


def test_state_dict_restores_lambda():
    algo = RePO(RePOConfig(cost_reward="c"))
    algo.advantages(rollout([1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]))
    fresh = RePO(RePOConfig(cost_reward="c"))
    fresh.load_state_dict(algo.state_dict())
    assert algo.state_dict() == {"lambda": pytest.approx(1.05)} and fresh.lam == algo.lam
    fresh.load_state_dict({})  # a checkpoint of a run without algorithm state: lambda is left as it is
    assert fresh.lam == algo.lam


def test_to_batch_gives_the_cost_rewards_raw_values_nan_where_it_failed():
    samples = Samples(prompt_ids=[[1], [1]], completion_ids=[[2], [3, 4]], logprobs=None, group=[0, 0],
                      reward=[1.0, 0.0], correct=[True, False], truncated=[False, False],
                      values={"math_accuracy": [1.0, 0.0], "forbidden": [2.0, None]})
    costs = to_batch(samples, 0, 4, "forbidden").rollout.costs
    assert costs[0].item() == 2.0 and math.isnan(costs[1].item())
    assert to_batch(samples, 0, 4).rollout.costs is None


def test_the_cost_reward_must_be_a_weight_zero_reward_of_the_stage():
    algo = RePO(RePOConfig(cost_reward="forbidden"))
    ok = [RewardRef(name="math_accuracy"), RewardRef(name="forbidden", weight=0)]
    assert cost_reward_problem(algo, ok) is None and cost_reward_problem(GRPO(), []) is None
    weighted = [RewardRef(name="math_accuracy"), RewardRef(name="forbidden", weight=-1)]
    assert "'forbidden' is the algorithm's cost_reward" in cost_reward_problem(algo, weighted)
    assert "give it weight: 0 (it has weight -1)" in cost_reward_problem(algo, weighted)
    missing = cost_reward_problem(algo, ok[:1])
    assert missing.startswith("algorithm.config.cost_reward: 'forbidden' is not a reward of the stage")
    # a reward listed twice is labelled NAME_i, as the stage's RewardSet labels it
    twice = [RewardRef(name="forbidden", weight=0), RewardRef(name="forbidden", weight=0)]
    assert cost_reward_problem(RePO(RePOConfig(cost_reward="forbidden_1")), twice) is None


PIPELINE = """
name: p
stages:
  rl:
    kind: rl
    inputs: {{model: "builtin:tiny", dataset: rl.jsonl}}
    algorithm: {{name: repo, config: {{cost_reward: {cost}}}}}
    rewards: [math_accuracy, {{name: forbidden, weight: {weight}, config: {{strings: ["2<"]}}}}]
    settings: {{max_steps: 1, prompts_per_step: 1, group_size: 2, micro_batch_size: 2}}
"""


@pytest.mark.parametrize("cost, weight, message", [
    ("forbidden", 1, "stage 'rl', rewards: 'forbidden' is the algorithm's cost_reward"),
    ("forbiden", 0, "stage 'rl', algorithm.config.cost_reward: 'forbiden' is not a reward of the stage"),
])
def test_preflight_names_the_stage_and_the_field(tmp_path, cost, weight, message):
    from alignflow.flows.preflight import check_pipeline

    (tmp_path / "rl.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "p.yaml").write_text(PIPELINE.format(cost=cost, weight=weight))
    with pytest.raises(SpecError, match=message):
        check_pipeline(tmp_path / "p.yaml", project=tmp_path)
    (tmp_path / "p.yaml").write_text(PIPELINE.format(cost="forbidden", weight=0))
    check_pipeline(tmp_path / "p.yaml", project=tmp_path)


# -- through the rl stage on the tiny model ------------------------------------------------------------------


def always_violates(prompts, completions, **columns):
    """A cost of 1 for every completion, None (failed) for the prompt "0+0=": every response violates."""
    return [None if p == "0+0=" else 1.0 for p in prompts]


class CostRewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("always_violates", always_violates)


@pytest.fixture(scope="module")
def plugins():
    with registered(CostRewards, "test_repo") as p:
        yield p


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def make_ctx(tmp_path, plugins, model, log, weight=0.0, max_steps=3):
    (tmp_path / "work").mkdir(parents=True, exist_ok=True)
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(data)},
                     algorithm={"name": "repo", "config": {"cost_reward": "always_violates", "lambda_init": 0.5,
                                                           "lambda_lr": 0.25}},
                     rewards=["math_accuracy", {"name": "always_violates", "weight": weight}], sampler="hf")
    settings = RLSettings(max_steps=max_steps, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-3,
                          generation={"max_new_tokens": 4}, save_every=1)
    return StageContext("repo", spec, settings, {"model": model, "dataset": data}, tmp_path / "work",
                        tmp_path / "checkpoints", 0, lambda m, step: log.append((step, m)), plugins)


def test_the_stage_refuses_a_weighted_cost_reward(tmp_path, plugins, tiny):
    with pytest.raises(SpecError, match="stage 'repo', rewards: 'always_violates' is the algorithm's cost_reward"):
        run_rl(make_ctx(tmp_path, plugins, tiny, [], weight=1.0))


def test_a_resumed_stage_goes_on_with_the_saved_lambda(tmp_path, plugins, tiny):
    log = []
    whole = run_rl(make_ctx(tmp_path / "a", plugins, tiny, log))
    lambdas = [m["repo/lambda"] for _, m in log[:-1]]
    # every response violates by 1 (row 0's failed cost counts as 1): lambda_k = 0.5 + 0.25 k
    assert lambdas == pytest.approx([0.5, 0.75, 1.0])
    assert all(m["repo/violation_rate"] == 1.0 for _, m in log[:-1])
    assert sum(m["repo/cost_failed"] for _, m in log[:-1]) > 0  # row 0 was drawn, its None counted

    def crash(metrics, step):
        if step == 2:
            raise KeyboardInterrupt

    ctx = make_ctx(tmp_path / "b", plugins, tiny, [])
    ctx.log_metrics = crash
    with pytest.raises(KeyboardInterrupt):
        run_rl(ctx)
    resumed_log = []
    resumed = run_rl(make_ctx(tmp_path / "b", plugins, tiny, resumed_log))
    # resumed from the step-1 checkpoint: lambda_1 = 0.75 came back with it (a fresh one would be 0.5)
    assert [(s, m["repo/lambda"]) for s, m in resumed_log[:-1]] == [(2, 0.75), (3, 1.0)]
    a, b = load_model(whole.outputs["model"]).state_dict(), load_model(resumed.outputs["model"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
