import asyncio

import pytest

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.errors import AlignflowError, SpecError
from alignflow.core.plugins import Plugins
from alignflow.core.rewards import RewardError, RewardOutput, RewardSet, completion_lengths


def exact(prompts, completions, answer, **columns):
    """1.0 when the completion equals the answer."""
    return [float(c == a) for c, a in zip(completions, answer)]


def picky(prompts, completions, **columns):
    """Raises on any batch holding a 'bad' completion."""
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    return [1.0 for _ in completions]


def always_raises(prompts, completions, **columns):
    """Never works."""
    raise RuntimeError("backend down")


class Scaled:
    """A constant times the completion length."""

    class Config(PluginConfig):
        scale: float = 1.0

    def __init__(self, config):
        self.scale = config.scale

    def __call__(self, prompts, completions, **columns):
        return [self.scale * len(c) for c in completions]


async def slow_echo(prompts, completions, **columns):
    """An async reward: completion length after a pause."""
    await asyncio.sleep(0.05)
    return [float(len(c)) for c in completions]


class Rewards:
    @hookimpl
    def register_rewards(self, register):
        for name, obj in [("exact", exact), ("picky", picky), ("always_raises", always_raises),
                          ("scaled", Scaled), ("slow_echo", slow_echo), ("wrong_length", lambda **kw: [1.0]),
                          ("strings", lambda prompts, completions, **kw: ["1"] * len(completions)),
                          ("no_opinion", lambda prompts, completions, **kw: [None] * len(completions))]:
            register(name, obj)


@pytest.fixture
def plugins():
    p = Plugins()
    p.add(Rewards(), "test-rewards")
    return p


def test_weighted_total_and_raw_values(plugins):
    rs = RewardSet.from_refs([("exact", 2.0), ("scaled", 0.5, {"scale": 3.0})], plugins)
    out = rs(["p", "p"], ["ab", "xyz"], answer=["ab", "no"], unused=[1, 2])
    assert out.values == {"exact": [1.0, 0.0], "scaled": [6.0, 9.0]}
    assert out.total == [2.0 + 3.0, 4.5]
    assert out.metrics["reward/exact/mean"] == 0.5 and out.metrics["reward/exact/none"] == 0.0


def test_class_config_is_validated_with_the_field_named(plugins):
    with pytest.raises(SpecError, match=r"rewards\[0\] \(scaled\)\.config\.scael"):
        RewardSet.from_refs([("scaled", 1.0, {"scael": 2})], plugins)
    with pytest.raises(SpecError, match="takes no config"):
        RewardSet.from_refs([("exact", 1.0, {"x": 1})], plugins)


def test_a_sample_that_raises_becomes_none_and_is_counted(plugins):
    rs = RewardSet.from_refs([("picky", 1.0), ("scaled", 1.0)], plugins)
    out = rs(["p"] * 3, ["ok", "bad", "fine"])
    assert out.values["picky"] == [1.0, None, 1.0]
    assert out.total == [3.0, 3.0, 5.0]  # None adds 0; the other reward still counts
    assert out.metrics["reward/picky/none"] == 1.0 and out.metrics["reward/picky/failed"] == 1.0


def test_outputs_of_consecutive_batches_join_into_the_whole_batchs(plugins):
    """How ranks that each scored a share of the samples agree on one output: values in order, failures
    summed, means over all samples (the mean of the parts' total means would be (2.0 + 2.5) / 2)."""
    rs = RewardSet.from_refs([("picky", 1.0), ("scaled", 0.5)], plugins)
    completions = ["ok", "bad", "fine", "good"]
    whole = rs(["p"] * 4, completions)
    joined = RewardOutput.join([rs(["p"], completions[:1]), rs(["p"] * 3, completions[1:])])
    assert joined == whole
    assert joined.metrics["reward/total/mean"] == (2.0 + 1.5 + 3.0 + 3.0) / 4
    assert joined.metrics["reward/picky/none"] == joined.metrics["reward/picky/failed"] == 1.0


def test_a_reward_failing_on_every_sample_is_a_named_error(plugins):
    rs = RewardSet.from_refs([("exact", 1.0), ("always_raises", 1.0)], plugins)
    with pytest.raises(RewardError, match="'always_raises' failed on every sample.*backend down") as info:
        rs(["p", "p"], ["a", "b"], answer=["a", "b"])
    assert isinstance(info.value, AlignflowError)


def test_no_opinion_on_a_whole_batch_is_counted_not_fatal(plugins):
    rs = RewardSet.from_refs([("exact", 1.0), ("no_opinion", 1.0)], plugins)
    out = rs(["p", "p"], ["a", "b"], answer=["a", "b"])
    assert out.total == [1.0, 1.0] and out.values["no_opinion"] == [None, None]  # adds 0
    assert out.metrics["reward/no_opinion/none"] == 2.0 and out.metrics["reward/no_opinion/failed"] == 0.0


def test_contract_violations_are_errors_not_nones(plugins):
    with pytest.raises(RewardError, match="'wrong_length' returned 1 values for a batch of 2"):
        RewardSet.from_refs([("wrong_length", 1.0)], plugins)(["p", "p"], ["a", "b"])
    with pytest.raises(RewardError, match="'strings' returned '1'"):
        RewardSet.from_refs([("strings", 1.0)], plugins)(["p"], ["a"])


def test_async_rewards_are_awaited_together(plugins):
    import time

    rs = RewardSet.from_refs([("slow_echo", 1.0), ("slow_echo", 2.0)], plugins)
    start = time.perf_counter()
    out = rs(["p", "p"], ["a", "bcd"])
    assert time.perf_counter() - start < 0.09  # two 0.05 s rewards overlapped
    assert out.values == {"slow_echo_0": [1.0, 3.0], "slow_echo_1": [1.0, 3.0]}
    assert out.total == [3.0, 9.0]


def test_completion_lengths_prefers_token_counts():
    assert completion_lengths(["abc"], {"completion_lengths": [7], "completion_ids": [[1]]}) == [7]
    assert completion_lengths(["abc"], {"completion_ids": [[1, 2]]}) == [2]
    assert completion_lengths(["abc"], {}) == [3]


def test_builtin_rewards_are_registered():
    from alignflow.core import get_plugins

    rewards = get_plugins().rewards
    for name in ["math_accuracy", "format", "overlong", "length", "code_exec", "reward_model", "judge"]:
        assert rewards.entry(name).distribution == "alignflow"
