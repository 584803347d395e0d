"""docs/concepts/contracts.md: its examples register and run as the contracts say.

The settings tables it once held are generated at build time (docs/reference/settings.md, from
`alignflow.core.describe.settings_tables`): tested here on what they must contain.
"""

import math
import random
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.describe import settings_tables
from alignflow.core.plugins import Plugins
from alignflow.core.rewards import RewardSet, Scores
from alignflow.core.rl.algorithm import RLAlgorithm, Rollout
from alignflow.core.spec.schema import validate_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "contracts.md"
# What each ```python block of the doc registers, in order.
EXAMPLES = [("algorithm", "loo_clip"), ("reward", "contains_answer"), ("selector", "cap_per_value")]


def blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def registered(index: int, monkeypatch):
    """Exec block `index` as a fresh module, register it with fresh Plugins: (plugins, its one entry)."""
    name = f"contracts_doc_example_{index}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # pydantic and dataclasses resolve names through it
    exec(compile(blocks()[index], f"{DOC}:python block {index}", "exec"), module.__dict__)
    plugins = Plugins()
    plugins.add(module, name)
    entries = plugins.entries()
    assert [(e.kind, e.name) for e in entries] == [EXAMPLES[index]]
    assert entries[0].description and entries[0].entry_point == name
    return plugins, entries[0]


def test_the_doc_has_one_python_block_per_example():
    assert len(blocks()) == len(EXAMPLES)


def rollout() -> Rollout:
    """Two prompts x two responses over T = 5 positions: prompt tokens, then the response, then padding."""
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0]], dtype=torch.float)
    return Rollout(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group=torch.tensor([3, 3, 7, 7]),
                   response_mask=mask, old_logprobs=-1.0 * mask, ref_logprobs=-1.5 * mask, max_new_tokens=4)


def test_rl_example(monkeypatch):
    plugins, entry = registered(0, monkeypatch)
    cls = entry.obj
    assert issubclass(cls, RLAlgorithm) and cls.stage == "rl"
    algo = cls(validate_config(cls, {"kl_coef": 0.1}, "config"))
    assert algo.requires_reference and not cls(validate_config(cls, {"kl_coef": 0.0}, "config")).requires_reference
    r = rollout()
    advantages, returns = algo.advantages(r)
    assert returns is None
    # leave-one-out within each group: +-1, on the response tokens only
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None] * r.response_mask)
    rows = torch.tensor([0, 1])
    logprobs = (-0.9 * r.response_mask[rows]).requires_grad_()  # current policy, 0 off the mask
    batch = r.minibatch(rows, logprobs=logprobs, advantages=advantages)
    per_token, metrics = algo.loss(batch)
    assert per_token.shape == (2, 5) and torch.isfinite(per_token).all()
    loss = aggregate(per_token, batch.response_mask, algo.loss_agg_mode)
    loss.backward()
    assert math.isfinite(loss.item()) and logprobs.grad.abs().sum() > 0
    assert set(metrics) == {"actor/clip_frac", "actor/ratio_mean", "actor/kl_ref"}
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert metrics["actor/ratio_mean"].item() == pytest.approx(math.exp(0.1))


def test_reward_example(monkeypatch):
    plugins, entry = registered(1, monkeypatch)
    reward = entry.obj(validate_config(entry.obj, {}, "config"))
    out = reward(["q1", "q2"], ["The answer is 42.", "No idea"], answer=["42", "7"], completion_lengths=[5, 2])
    assert isinstance(out, Scores) and list(out) == [1.0, 0.0] and out.counts == {"no_reference": 0.0}
    # As the stage runs it: weighted from the YAML form; a None adds nothing and is counted.
    rewards = RewardSet.from_refs([("contains_answer", 0.5, {"case_sensitive": True})], plugins)
    got = rewards(["q1", "q2"], ["ANSWER: Yes", "answer: yes"], answer=["Yes", None])
    assert got.total == [0.5, 0.0] and got.values == {"contains_answer": [1.0, None]}
    assert got.metrics["reward/contains_answer/none"] == 1.0
    assert got.metrics["reward/contains_answer/no_reference"] == 1.0


def test_selector_example(monkeypatch):
    plugins, entry = registered(2, monkeypatch)
    selector = entry.obj(validate_config(entry.obj, {"k": 2}, "config"))
    rows = [{"prompt": f"p{i}", "level": level} for i, level in enumerate([1, 1, 1, 2, 2, 3, 1])]
    kept = selector(rows, random.Random(0))
    assert kept == selector(rows, random.Random(0))  # seeded
    assert [r["level"] for r in kept].count(1) == 2 and len(kept) == 5
    assert kept == [r for r in rows if r in kept]  # a subset, in input order
    assert entry.obj(validate_config(entry.obj, {}, "config"))(rows, random.Random(0)) != rows


def test_settings_tables_cover_every_stage_kind_and_field():
    from alignflow.core.spec.kinds import SETTINGS

    tables = settings_tables()
    for kind, model in SETTINGS.items():
        assert f"`{kind}`" in tables.split(f"**{model.__name__}**", 1)[1].split("\n", 1)[0], kind
    for name in ("lr", "prompts_per_step", "group_size", "tis_cap", "max_new_tokens", "target_modules"):
        assert f"| `{name}` |" in tables, name
    assert "| `lr` | `float (>= 0.0)` | `0.0001` |" in tables  # the bound from the Field, the type from the annotation
