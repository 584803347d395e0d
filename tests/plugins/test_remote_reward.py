"""The remote reward against a real HTTP scorer (tests/helpers/scorer.py) that scores by a rule: values in order
over batches, both wire formats, retries, a scorer down, hung or answering nonsense, the concurrency limit."""

import asyncio
import random
import time

import pytest
from helpers.scorer import Scorer
from pydantic import ValidationError

from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import RewardError, RewardSet
from alignflow.plugins.remote_reward import Remote

PROMPTS = [f"{i}+{i}=" for i in range(8)]
COMPLETIONS = [str(2 * i if i % 3 else i) for i in range(8)]  # samples 0, 3 and 6 wrong (but 0+0=0)
ANSWERS = [str(2 * i) for i in range(8)]


def exact(prompts, completions, answers):
    """The scorer's rule: 1 for the reference answer, else minus the completion's length."""
    return [1.0 if c == a else -float(len(c)) for c, a in zip(completions, answers)]


def alignflow_rule(scorer, path, body):
    return 200, {"rewards": exact(body["prompts"], body["completions"], body["columns"]["answer"])}


def remote(url, **config):
    """The reward as a stage builds it: by name, from the installed plugins, with its validated config."""
    config = {"url": url, "model": "exact-rm", "version": "1", "columns": ["answer"], "backoff_s": 0.01, **config}
    return RewardSet.from_refs([("remote", 1.0, config)], get_plugins())


def score(url, prompts=PROMPTS, completions=COMPLETIONS, answers=ANSWERS, **config):
    return remote(url, **config)(prompts, completions, answer=answers)


@pytest.mark.system
def test_values_come_back_in_order_over_batches():
    with Scorer(alignflow_rule) as scorer:
        out = score(scorer.url + "/score", batch_size=3)
    assert out.values["remote"] == exact(PROMPTS, COMPLETIONS, ANSWERS) == [1.0, 1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
    bodies = sorted((r["body"] for r in scorer.requests), key=lambda b: b["prompts"][0])
    assert [b["prompts"] for b in bodies] == [PROMPTS[0:3], PROMPTS[3:6], PROMPTS[6:8]]
    assert bodies[1] == {"model": "exact-rm", "prompts": PROMPTS[3:6], "completions": COMPLETIONS[3:6],
                         "columns": {"answer": ANSWERS[3:6]}}
    assert {r["path"] for r in scorer.requests} == {"/score"}
    assert out.metrics["reward/remote/failed"] == 0 and out.metrics["reward/remote/retries"] == 0


@pytest.mark.system
@pytest.mark.parametrize("shape", ["rewards", "scores", "list"])
def test_openrlhf_format(shape):
    """OpenRLHF's --remote_rm_url body (query = prompt + completion, labels from the first column), and each reply
    shape its servers give."""
    def rule(scorer, path, body):
        rewards = [1.0 if q.endswith(label) else 0.0 for q, label in zip(body["query"], body["labels"])]
        return 200, rewards if shape == "list" else {shape: rewards}

    with Scorer(rule) as scorer:
        out = score(scorer.url + "/get_reward", format="openrlhf", batch_size=4)
    assert out.values["remote"] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    first = min((r["body"] for r in scorer.requests), key=lambda b: b["prompts"][0])
    assert first == {"query": [p + c for p, c in zip(PROMPTS[:4], COMPLETIONS[:4])], "prompts": PROMPTS[:4],
                     "labels": ANSWERS[:4]}


@pytest.mark.system
def test_a_503_is_retried_then_scored():
    def rule(scorer, path, body):
        if scorer.count(body["prompts"][0]) == 1:
            return 503, {"error": "warming up"}
        return alignflow_rule(scorer, path, body)

    random.seed(7)
    state = random.getstate()
    with Scorer(rule) as scorer:
        out = score(scorer.url, batch_size=4)
    assert out.values["remote"] == exact(PROMPTS, COMPLETIONS, ANSWERS)
    assert scorer.attempts == {PROMPTS[0]: 2, PROMPTS[4]: 2} and len(scorer.requests) == 4
    assert out.metrics["reward/remote/retries"] == 2 and out.metrics["reward/remote/failed"] == 0
    assert random.getstate() == state  # the jitter draws from its own generator, not the stage's seeded one


@pytest.mark.system
def test_a_batch_its_scorer_keeps_failing_costs_only_its_samples():
    """Samples 3-5 always get a 500: after 1 + 2 retries they are None, counted; the other batches are scored."""
    def rule(scorer, path, body):
        scorer.count(body["prompts"][0])
        if PROMPTS[3] in body["prompts"]:
            return 500, b"internal error"
        return alignflow_rule(scorer, path, body)

    with Scorer(rule) as scorer:
        out = score(scorer.url, batch_size=3, retries=2, backoff_s=0.1)
    expected = exact(PROMPTS, COMPLETIONS, ANSWERS)
    assert out.values["remote"] == expected[:3] + [None] * 3 + expected[6:]
    assert scorer.attempts[PROMPTS[3]] == 3 and scorer.attempts[PROMPTS[0]] == scorer.attempts[PROMPTS[6]] == 1
    at = [r["at"] for r in scorer.requests if r["body"]["prompts"][0] == PROMPTS[3]]
    first, second = at[1] - at[0], at[2] - at[1]
    assert 0.1 <= first < 1.0 and 0.2 <= second < 1.5, (first, second)  # backoff_s, then doubled (+ jitter)
    m = out.metrics
    assert (m["reward/remote/failed"], m["reward/remote/http_error"], m["reward/remote/retries"]) == (3, 3, 2)
    assert m["reward/remote/none"] == 3 and m["reward/total/mean"] == sum(expected[:3] + expected[6:]) / 8


@pytest.mark.system
def test_a_scorer_that_is_not_there_gives_none_counted(caplog):
    with Scorer(alignflow_rule) as scorer:
        url = scorer.url  # a port that nothing listens on once the server is stopped
    out = score(url, batch_size=4, retries=1)
    assert out.values["remote"] == [None] * 8
    assert out.metrics["reward/remote/unreachable"] == 8 and out.metrics["reward/remote/retries"] == 2
    warnings = [r.getMessage() for r in caplog.records if "unscored" in r.getMessage()]
    assert len(warnings) == 1 and "8 of 8 samples unscored (unreachable 8)" in warnings[0]  # one per call


@pytest.mark.system
def test_a_hung_scorer_times_out_fast_and_is_not_retried():
    def rule(scorer, path, body):
        scorer.count(body["prompts"][0])
        return scorer.hang() if PROMPTS[4] in body["prompts"] else alignflow_rule(scorer, path, body)

    with Scorer(rule) as scorer:
        start = time.perf_counter()
        out = score(scorer.url, batch_size=4, timeout_s=0.5, retries=3)
        wall = time.perf_counter() - start
    assert out.values["remote"] == exact(PROMPTS, COMPLETIONS, ANSWERS)[:4] + [None] * 4
    assert 0.5 <= wall < 3.0, wall  # one timeout, not four
    assert scorer.attempts[PROMPTS[4]] == 1
    assert out.metrics["reward/remote/timeout"] == out.metrics["reward/remote/failed"] == 4


@pytest.mark.system
def test_no_more_requests_in_flight_than_max_concurrency():
    def rule(scorer, path, body):
        time.sleep(0.1)  # long enough for every allowed request to overlap
        return alignflow_rule(scorer, path, body)

    with Scorer(rule) as scorer:
        out = score(scorer.url, prompts=PROMPTS * 2, completions=COMPLETIONS * 2, answers=ANSWERS * 2,
                    batch_size=1, max_concurrency=3)
    assert len(scorer.requests) == 16 and scorer.peak == 3
    assert out.values["remote"] == exact(PROMPTS, COMPLETIONS, ANSWERS) * 2


@pytest.mark.system
def test_a_malformed_reply_costs_its_batch_or_its_sample():
    """Too few rewards: the whole batch (it cannot be aligned); not JSON: the batch; a string, true or NaN
    among numbers: that sample only. null is the scorer's no-opinion, not a failure."""
    def rule(scorer, path, body):
        first = body["prompts"][0]
        if first == PROMPTS[0]:
            return 200, {"rewards": [1.0]}
        if first == PROMPTS[2]:
            return 200, b"<html>gateway</html>"
        if first == PROMPTS[4]:
            return 200, {"rewards": ["high", 0.5]}
        return 200, {"rewards": [None, float("nan")]}  # json.dumps writes NaN

    with Scorer(rule) as scorer:
        out = score(scorer.url, batch_size=2)
    assert out.values["remote"] == [None, None, None, None, None, 0.5, None, None]
    m = out.metrics
    assert (m["reward/remote/malformed"], m["reward/remote/failed"], m["reward/remote/none"]) == (6, 6, 7)


@pytest.mark.system
def test_the_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("TEST_SCORER_KEY", "s3cret")
    with Scorer(alignflow_rule) as scorer:
        score(scorer.url, api_key_env="TEST_SCORER_KEY", headers={"X-Team": "rl"}, batch_size=8)
    headers = {k.lower(): v for k, v in scorer.requests[0]["headers"].items()}
    assert headers["authorization"] == "Bearer s3cret" and headers["x-team"] == "rl"


def test_config_takes_a_variable_name_never_a_key(monkeypatch):
    base = {"url": "http://127.0.0.1:9", "model": "m", "version": "1"}
    with pytest.raises(ValidationError, match="NAME of an environment variable"):
        Remote.Config(**base, api_key_env="sk-live-1234")
    with pytest.raises(ValidationError, match="api_key_env"):
        Remote.Config(**base, headers={"Authorization": "Bearer sk"})
    with pytest.raises(ValidationError, match="version"):
        Remote.Config(url="http://127.0.0.1:9", model="m")
    with pytest.raises(ValidationError, match="http:// or https:// URL"):
        Remote.Config(**{**base, "url": "rm-host:8000/score"})
    monkeypatch.delenv("UNSET_SCORER_KEY", raising=False)
    with pytest.raises(ValueError, match="UNSET_SCORER_KEY is not set"):
        Remote(Remote.Config(**base, api_key_env="UNSET_SCORER_KEY"))


def test_a_column_missing_from_the_batch_stops_the_stage_named():
    """A pipeline error, not the scorer's: nothing is sent, and the stage stops naming the column."""
    rewards = remote("http://127.0.0.1:9", columns=["answer", "solution"])
    with pytest.raises(RewardError, match="'solution'.*not in the batch"):
        rewards(PROMPTS[:2], COMPLETIONS[:2], answer=ANSWERS[:2])


def test_an_empty_batch_sends_nothing():
    reward = Remote(Remote.Config(url="http://127.0.0.1:9", model="m", version="1"))
    assert asyncio.run(reward([], [])) == []
