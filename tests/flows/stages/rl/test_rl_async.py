"""Asynchronous rollouts: a worker process generates step s + k's first round while step s trains."""

import dataclasses
import multiprocessing
import os
import signal

import pytest
import torch

from alignflow.core.errors import AlignflowError
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.spec.settings import GenerationSettings
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.asynchronous import AsyncRollouts
from alignflow.plugins.hf import HFSampler
from tests.flows.stages.rl.test_rl_stage import (ASCII, TestRewards, make_ctx, plugins, tiny,  # noqa: F401 - fixtures
                                                 write_rows)
from tests.helpers.plugins import registered

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's count: the same kernels, so the same samples on both sides
    yield
    torch.set_num_threads(before)


def run(tmp_path, plugins, tiny, **settings):
    log = []
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 8)
    shape = dict(max_steps=5, prompts_per_step=4, group_size=8, micro_batch_size=32, generation={"max_new_tokens": 3})
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, log, **{**shape, **settings})
    return run_rl(ctx), [m for _, m in log[:-1]]


@pytest.mark.system
@pytest.mark.parametrize("k, weights, staleness", [
    (1, "pinned", [0.0, 1.0, 1.0, 1.0, 1.0]),  # the one-step-off rollouts of before
    (2, "pinned", [0.0, 1.0, 2.0, 2.0, 2.0]),  # exactly k from step k on (step s < k: the stage's first weights)
    (3, "latest", None),  # the newest weights when the worker starts: at most k, by timing
])
def test_with_fixed_weights_the_asynchronous_rollouts_are_the_synchronous_ones(tmp_path, plugins, tiny, one_thread,
                                                                             k, weights, staleness):
    """lr 0: the worker's rounds (on published weights, same seeds) are exactly what the stage would generate,
    k steps ahead, and each step counts how stale its samples were."""
    _, sync = run(tmp_path / "sync", plugins, tiny, lr=0.0)
    _, ahead = run(tmp_path / "async", plugins, tiny, lr=0.0, async_rollouts=True, max_staleness=k,
                   async_weights=weights)
    got = [m["rollout/staleness"] for m in ahead]
    assert got == staleness if staleness else (got[0] == 0.0 and all(0 <= x <= k for x in got))
    assert [m["rollout/staleness"] for m in sync] == [0.0] * 5
    for m in ahead:  # the shares of samples (and of tokens) at each staleness sum to 1; waits are measured
        shares = [v for key, v in m.items() if key.startswith("rollout/staleness_share/")]
        assert sum(shares) == pytest.approx(1.0) and m["time/rollout_wait"] >= 0.0
        assert sum(v for key, v in m.items() if key.startswith("rollout/token_share/")) == pytest.approx(1.0)
    for key in ("reward/total/mean", "response_length/mean", "accuracy"):
        assert [m[key] for m in ahead] == [m[key] for m in sync], key


@pytest.mark.system
def test_max_staleness_0_is_the_synchronous_stage_and_pinned_runs_repeat_bit_for_bit(tmp_path, plugins, tiny,
                                                                                     one_thread):
    """k = 0 starts no worker: the weights are the synchronous stage's, bit for bit. k = 2 with pinned weights
    learns from 2-step-old samples yet repeats itself exactly: which weights generate which round is fixed by the
    step, not by timing, and the manifest says so."""
    learning = dict(lr=1e-2, generation={"max_new_tokens": 2})
    sync, _ = run(tmp_path / "sync", plugins, tiny, **learning)
    zero, log = run(tmp_path / "zero", plugins, tiny, async_rollouts=True, max_staleness=0, **learning)
    assert zero.fingerprint["async_rollouts"] is False and all(m["rollout/staleness"] == 0.0 for m in log)
    same = lambda a, b: all(torch.equal(a[key], b[key]) for key in a)  # noqa: E731
    state = lambda result: load_model(result.outputs["model"]).state_dict()  # noqa: E731
    assert same(state(sync), state(zero))
    first, log = run(tmp_path / "k2a", plugins, tiny, async_rollouts=True, max_staleness=2, **learning)
    second, _ = run(tmp_path / "k2b", plugins, tiny, async_rollouts=True, max_staleness=2, **learning)
    assert [m["rollout/staleness"] for m in log] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert same(state(first), state(second)) and not same(state(first), state(sync))
    assert (first.fingerprint["max_staleness"], first.fingerprint["timing_dependent"]) == (2, False)


@pytest.mark.system
def test_overlapped_rollouts_are_one_step_off_policy_and_still_learn(tmp_path, plugins, tiny, one_thread):
    """Each round after the first comes from the weights before the last update: the trainer's log-probs
    of its tokens then differ from the sampler's (the ratio corrects for it), and GRPO still learns. Over 10
    steps: Adam's first steps move a weight whose gradient is near 0 by a whole lr either way, so float rounding
    alone (log-probs by log-softmax, not logsumexp: 1e-7 apart) moved the gain after 6 steps from 0.23 to 0.07,
    after 10 from 0.45 to 0.32."""
    result, log = run(tmp_path, plugins, tiny, lr=1e-2, async_rollouts=True, max_steps=10,
                      generation={"max_new_tokens": 1})
    assert [m["rollout/staleness"] for m in log] == [0.0] + [1.0] * 9
    assert log[0]["rollout/logprob_abs_diff"] < 1e-5  # generated on the very weights that train on it
    assert all(m["rollout/logprob_abs_diff"] > 1e-3 for m in log[1:])  # generated one update earlier

    def p_ascii(path):
        tok, model = load_tokenizer(path), load_model(path)
        with torch.no_grad():
            logits = model(torch.tensor(tok(["3+3="]).input_ids)).logits[0, -1]
        return logits.softmax(-1)[:ASCII].sum().item()

    assert p_ascii(result.outputs["model"]) > p_ascii(tiny) + 0.1


@pytest.mark.system
def test_a_worker_that_dies_is_an_error_not_a_hang(tiny):
    model, tok = load_model(tiny), load_tokenizer(tiny)
    inner = HFSampler()
    inner.load(model, tok)
    sampler = AsyncRollouts(inner, model, tok)
    try:
        gen = GenerationSettings(max_new_tokens=2)
        sampler.submit([tok.encode("1+1=")], 2, gen, 0)
        sampler.process.kill()
        sampler.process.join()
        with pytest.raises(AlignflowError, match="worker process died"):
            sampler.generate([tok.encode("1+1=")], 2, gen, 0)
    finally:
        sampler.close()


@pytest.mark.parametrize("settings, sampler, env, message", [
    ({"zero_stage": 3}, "hf", {}, "ZeRO-3 shards"),
    ({}, "vllm", {}, "engine of its own"),
    ({}, "hf", {"WORLD_SIZE": "2"}, "2 processes: asynchronous rollouts run beside one process"),
])
def test_async_refuses_what_it_cannot_run(tmp_path, plugins, tiny, monkeypatch, settings, sampler, env, message):
    from alignflow.core import SpecError

    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, [], sampler=sampler, async_rollouts=True, **settings)
    ctx = dataclasses.replace(ctx, world=int(env.get("WORLD_SIZE", 1)))  # the ranks the launcher gave it
    with pytest.raises(SpecError, match=message):
        run_rl(ctx)


@pytest.mark.overlap_auto
@pytest.mark.parametrize("settings, sampler, env, threads, on, why", [
    ({}, "hf", {}, 1, True, "auto: 1 of 2 cores spare, the worker takes 1"),
    ({}, "hf", {}, 2, False, "auto: no spare core: 2 torch threads on 2 cores"),
    ({"async_threads": 2}, "hf", {}, 1, False, "auto: no spare core: 1 torch threads on 2 cores"),
    ({"zero_stage": 3}, "hf", {}, 1, False, "auto: ZeRO-3 shards"),
    ({}, "vllm", {}, 1, False, "auto: sampler 'vllm' runs an engine of its own"),
    ({"recompute_old_logprobs": True}, "hf", {}, 1, False, "auto: recompute_old_logprobs"),
    ({}, "hf", {"WORLD_SIZE": "2"}, 1, False, "auto: 2 processes"),
    ({}, "hf", {"ALIGNFLOW_AUTO_OVERLAP": "false"}, 1, False, "auto: ALIGNFLOW_AUTO_OVERLAP"),
    ({"async_rollouts": False}, "hf", {}, 1, False, "set"),
    ({"async_rollouts": True}, "hf", {}, 2, True, "set"),
])
def test_auto_overlaps_only_where_the_worker_gets_a_core_of_its_own(tmp_path, plugins, tiny, monkeypatch, settings,
                                                                    sampler, env, threads, on, why):
    """On a machine of 2 cores: a stage on 1 torch thread leaves one to the worker; on 2 it leaves none (a
    worker beside it would take the trainer's core), and what cannot overlap (ZeRO-3, an engine of its own,
    pi_old recomputed, several ranks) stays synchronous."""
    from alignflow.core.rl.algorithm import RLAlgorithm
    from alignflow.flows.stages.rl.setup import async_choice

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for key, value in env.items():
        if key != "WORLD_SIZE":
            monkeypatch.setenv(key, value)
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, [], sampler=sampler, **settings)
    ctx = dataclasses.replace(ctx, world=int(env.get("WORLD_SIZE", 1)))  # the ranks the launcher gave it
    algo = plugins.algorithms.get("grpo")()
    got, reason = async_choice(ctx, algo, plugins.samplers.get(sampler))
    assert got is on and reason.startswith(why)
    monkeypatch.setattr(RLAlgorithm, "needs_old_logprobs", False)
    if settings.get("async_rollouts") is None and on:  # an algorithm without a ratio to pi_old: no lag allowed
        assert async_choice(ctx, algo, plugins.samplers.get(sampler)) == (
            False, "auto: algorithm 'grpo' takes no ratio to pi_old")


@pytest.mark.system
@pytest.mark.overlap_auto
def test_the_default_overlaps_where_a_core_is_spare_and_the_manifest_says_so(tmp_path, plugins, tiny, one_thread,
                                                                              monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    result, log = run(tmp_path, plugins, tiny, max_steps=3)
    assert [m["rollout/staleness"] for m in log] == [0.0, 1.0, 1.0]
    assert {k: result.fingerprint[k] for k in ("async_rollouts", "async_setting", "max_staleness",
                                               "timing_dependent")} == {
        "async_rollouts": True, "async_setting": "auto", "max_staleness": 1, "timing_dependent": False}


ASYNC = dict(max_steps=6, prompts_per_step=4, group_size=4, micro_batch_size=16, lr=1e-2, save_every=2,
             generation={"max_new_tokens": 2}, async_rollouts=True, max_staleness=2)


def _killed_at_step_3(root, model, data):  # in a child process: SIGKILL itself once step 3 is logged
    torch.set_num_threads(1)
    with registered(TestRewards, "test_rl_stage") as plugins:  # noqa: F811
        ctx = make_ctx(root, plugins, model, "grpo", data, [], **ASYNC)
        ctx.log_metrics = lambda metrics, step: step == 3 and os.kill(os.getpid(), signal.SIGKILL)
        run_rl(ctx)


@pytest.mark.system
def test_a_killed_asynchronous_stage_resumes_with_each_rollout_used_once(tmp_path, plugins, tiny, one_thread):
    """SIGKILL after step 3's update (its worker then generating steps 4 and 5): the rerun resumes from the step-2
    checkpoint, and its log of consumed groups holds every step once, with the groups an uninterrupted run used
    (no rollout used twice, none lost); the killed stage's worker did not outlive it."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 8)
    whole = make_ctx(tmp_path / "a", plugins, tiny, "grpo", data, [], **ASYNC)
    run_rl(whole)
    killed = multiprocessing.get_context("spawn").Process(target=_killed_at_step_3, args=(tmp_path / "b", tiny, data))
    killed.start()
    killed.join(timeout=300)
    assert killed.exitcode == -signal.SIGKILL
    log = []
    ctx = make_ctx(tmp_path / "b", plugins, tiny, "grpo", data, log, **ASYNC)
    run_rl(ctx)
    assert log[0][0] == 3  # resumed after step 2's checkpoint (steps 0-1 done), not started over
    consumed = [last_state(root)["consumed"] for root in (tmp_path / "a", tmp_path / "b")]
    assert [e["step"] for e in consumed[1]] == list(range(6))
    assert [e["groups"] for e in consumed[0]] == [e["groups"] for e in consumed[1]]
    # steps 0-1 from the checkpoint; the resumed run starts its worker anew at step 2
    assert [e["staleness"] for e in consumed[1]] == [0.0, 1.0, 0.0, 1.0, 2.0, 2.0]
    assert not [c for c in multiprocessing.active_children() if c.name == "alignflow-rollouts"]


def last_state(root):
    """The rl stage's data state in its last checkpoint (DeepSpeed keeps the client state with the model)."""
    path = sorted((root / "checkpoints").glob("step-*"))[-1] / "ds" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["data"]
