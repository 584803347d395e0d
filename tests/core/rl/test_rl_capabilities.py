"""Opt-in capabilities of RL algorithms: detected on the built-ins, the deprecated members still honoured."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import RewardSet
from alignflow.core.rl.algorithm import RLAlgorithm
from alignflow.core.rl.capabilities import (CAPABILITIES, CostConstrained, ExtraParameters, GuidedSamples,
                                            LegacyMembers, Regenerate, Replay, RewardComponents, Stateful, has,
                                            members)
from alignflow.core.spec.settings import RLSettings
from alignflow.flows.stages.rl.costs import cost_label
from alignflow.flows.stages.rl.guided import with_guided
from alignflow.flows.stages.rl.params import EXTRA, attach_parameters
from alignflow.flows.stages.rl.replay import ReplayBuffer
from alignflow.flows.stages.rl.rollout import Samples
from alignflow.flows.stages.rl.state import checkpoint_state, resume
from alignflow.plugins.grpo import GRPO

EXPECTED = {  # built-in algorithm -> the capabilities it opts into
    "expo": {GuidedSamples}, "repo": {CostConstrained, Stateful}, "offpolicy_grpo": {Replay},
    "dapo": {Regenerate}, "ngrpo": {Regenerate}, "lambda_grpo": {ExtraParameters},
    "gdpo": {RewardComponents},
}
REQUIRED_CONFIG = {"repo": {"cost_reward": "cost"}}
RL = sorted(e.name for e in get_plugins().algorithms if getattr(e.obj, "stage", None) == "rl")


@pytest.mark.parametrize("name", RL)
def test_each_builtin_has_exactly_its_capabilities_without_a_warning(name):
    cls = get_plugins().algorithms.get(name)
    algo = cls(cls.Config(**REQUIRED_CONFIG.get(name, {})))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a built-in on the deprecated members would raise here
        found = {c for c in CAPABILITIES if has(algo, c)}
    assert found == EXPECTED.get(name, set())


def test_the_base_class_is_small_and_holds_no_capability_member():
    own = {n for n in vars(RLAlgorithm) if not n.startswith("_")}
    assert len(own) <= 15, sorted(own)
    assert {"advantages", "loss", "value_loss", "inert_rows", "norm_constant", "step_metrics",
            "loss_agg_mode", "filter_groups"} <= own
    capability_members = {m for c in CAPABILITIES for m in members(c)}
    assert not own & capability_members
    # the deprecated aliases: every capability member, with the capability's own default
    assert {n for n in vars(LegacyMembers) if not n.startswith("_")} == capability_members
    assert all(getattr(RLAlgorithm, m) is vars(c)[m] for c in CAPABILITIES for m in members(c))


def test_a_capability_without_overrides_gives_todays_defaults():
    class Refills(Regenerate, GRPO):
        pass

    algo, plain = Refills(), GRPO()
    assert has(algo, Regenerate) and algo.max_gen_batches == 1 == plain.max_gen_batches
    assert plain.guided_prompt("1+1=", "2") is None and plain.guided_samples == 0 and plain.cost_reward is None
    assert plain.fresh_groups(8) == 8 and plain.buffer_steps == 0 and plain.extra_parameters() == []
    assert plain.state_dict() == {} and plain.load_state_dict({"x": 1}) is None


class LegacyGuided(GRPO):
    """A third-party plugin written before capabilities: it overrides the members on a plain subclass."""

    def guided_prompt(self, prompt, answer):
        return f"{answer}|{prompt}"

    @property
    def guided_samples(self):
        return 2


def test_a_legacy_override_counts_as_the_capability_and_warns_once_naming_both():
    with pytest.warns(DeprecationWarning) as caught:
        assert has(LegacyGuided(), GuidedSamples)
    text = sorted(str(w.message) for w in caught)
    assert len(text) == 2 and "LegacyGuided.guided_prompt" in text[0] and "LegacyGuided.guided_samples" in text[1]
    assert all(f"subclass {GuidedSamples.__module__}.GuidedSamples too" in t for t in text)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class and member
        assert has(LegacyGuided(), GuidedSamples) and not has(LegacyGuided(), Replay)


def test_legacy_overrides_drive_every_capabilitys_stage_code():
    class Legacy(RLAlgorithm):
        lam = torch.nn.Parameter(torch.zeros(()))
        loaded = None

        def fresh_groups(self, prompts_per_step):
            return prompts_per_step // 2

        @property
        def buffer_steps(self):
            return 3

        @property
        def cost_reward(self):
            return "cost"

        def state_dict(self):
            return {"lambda": 0.5}

        def load_state_dict(self, state):
            Legacy.loaded = state

        def extra_parameters(self):
            return [self.lam]

    algo = Legacy()
    with pytest.warns(DeprecationWarning):
        buffer = ReplayBuffer(algo, prompts_per_step=4, seed=0)
        assert (buffer.fresh, buffer.replayed, buffer.keep) == (2, 2, 3)
        assert cost_label(algo) == "cost" and cost_label(GRPO()) is None
        ctx = SimpleNamespace(settings=RLSettings(prompts_per_step=4), seed=0, name="rl")
        resume(ctx, algo, {"algorithm": {"lambda": 2.0}}, n_rows=8)
        assert Legacy.loaded == {"lambda": 2.0}
        assert checkpoint_state(0, algo, buffer, resume(ctx, GRPO(), {}, 8)[1], [])["algorithm"] == {"lambda": 0.5}
        model = torch.nn.Linear(1, 1)
        attach_parameters(SimpleNamespace(settings=SimpleNamespace(zero_stage=0)), model, algo)
        assert list(getattr(model, EXTRA)) == [algo.lam]


def test_the_guided_stage_code_runs_for_a_legacy_override(monkeypatch):
    """with_guided asks a legacy plugin for its hints, as it asks ExPO; an algorithm without the capability
    is never asked."""
    import alignflow.flows.stages.rl.guided as guided

    asked = []

    def fake_round(p, rows, groups, n, gen, seed, episodes=None):
        asked.append(([r["prompt"] for r in rows], n))
        return Samples([[1]] * n * len(rows), [[2]] * n * len(rows), None, [g for g in groups for _ in range(n)],
                       [1.0] * n * len(rows), [True] * n * len(rows), [False] * n * len(rows),
                       {"r": [1.0] * n * len(rows)}), {}

    monkeypatch.setattr(guided, "generate_round", fake_round)
    monkeypatch.setattr(guided, "prompt_ids", lambda tok, rows: [[9]] * len(rows))
    kept = Samples([[1]], [[2]], None, [0], [0.0], [False], [False], {"r": [0.0]})
    ctx = SimpleNamespace(settings=RLSettings(), seed=0)
    parts = lambda algo: SimpleNamespace(algo=algo, sampler=None, tokenizer=None, rewards=RewardSet([]),  # noqa: E731
                                         process_reward=None)
    out, metrics = with_guided(ctx, parts(GRPO()), 0, kept, {0: {"prompt": "1+1=", "answer": "2"}})
    assert out is kept and metrics == {} and not asked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its warning is the test above's
        out, metrics = with_guided(ctx, parts(LegacyGuided()), 0, kept, {0: {"prompt": "1+1=", "answer": "2"}})
    assert asked == [(["2|1+1="], 2)] and out.guided == [False, True, True] and metrics["guided/rows"] == 2.0

