"""The rl stage on several data-parallel ranks: the rollouts, updates and evaluation one process would make."""

import dataclasses

import pytest
import torch

from alignflow.core import SpecError
from alignflow.core.plugins import get_plugins
from alignflow.flows.launch.ranks import run_in_processes
from alignflow.flows.stages.rl.stage import check_ranks, run_rl
from recording import Samplers
from test_rl_environment import ECHO, TestEnvironments, rl_ctx, rows
from test_rl_stage import TestRewards, make_ctx, weights, with_prm, write_rows

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def plugins():
    p = get_plugins()
    p.add(TestRewards, "test_rl_stage")
    p.add(Samplers, "recording")
    p.add(TestEnvironments, "test_rl_environment")
    yield p
    p.remove("test_rl_environment")
    p.remove("recording")
    p.remove("test_rl_stage")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def test_two_ranks_play_and_train_on_the_episodes_one_process_does(tmp_path, plugins, tiny_model):
    """PPO on greedy multi-turn episodes (alike whatever a rank's seed): each rank plays its prompts' episodes,
    every rank then holds them all with their loss masks and episode records; metrics and weights agree."""
    import shutil

    from alignflow.core.train.models import load_model
    from helpers.stopping import stop_early

    model = tmp_path / "stopping"
    shutil.copytree(tiny_model(), model)
    stop_early(load_model(model)).save_pretrained(model)
    data = rows(tmp_path / "rl.jsonl")
    settings = dict(group_size=2, micro_batch_size=2, generation={"max_new_tokens": 6, "temperature": 0.0})
    runs = {}
    for ranks in (1, 2):
        log = []
        ctx = rl_ctx(tmp_path / f"ranks{ranks}", plugins, model, data, log, ECHO, "ppo", **settings)
        runs[ranks] = (run_rl(ctx) if ranks == 1 else run_in_processes("rl", ctx, threads=1, ranks=2)), log
    (one, one_log), (two, two_log) = runs[1], runs[2]
    assert one_log[0][1]["episode/turns"] > 1
    for (_, a), (_, b) in zip(one_log, two_log):
        for key in a:
            if not key.startswith(("time/", "perf/tokens_per_s", "perf/completions_per_s")):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    a, b = weights(one.outputs["model"]), weights(two.outputs["model"])
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4  # Adam steps of ~1e-3: float rounding


@pytest.mark.parametrize("algorithm,zero", [("ppo", 0), ("ppo", 2), ("ppo_process", 0)])
def test_two_ranks_train_as_one_process_does_on_the_same_rollouts(tmp_path, plugins, tiny, algorithm, zero,
                                                                   monkeypatch):
    """PPO on greedy rollouts (alike whatever a rank's seed): each of two ranks generates for one prompt and
    trains one micro-batch a step, one process both; the logged metrics and the weights agree. Run with
    one rank's rows only, the critic's values, the whitened advantages and the loss would differ. The
    evaluation after each step shares its 130 prompts (3 chunks) between the ranks. `ppo_process` also
    carries each rank's PRM step rewards through the gather."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    evals = write_rows(tmp_path / "eval.jsonl", ["x"] * 130)
    new_tokens = 24 if algorithm == "ppo_process" else 4  # long enough to hold steps
    settings = dict(group_size=2, micro_batch_size=2, generation={"max_new_tokens": new_tokens, "temperature": 0.0},
                    eval_every=1, eval_generation={"max_new_tokens": 4, "temperature": 0.0}, zero_stage=zero)
    runs = {}
    for ranks in (1, 2):
        log = []
        ctx = make_ctx(tmp_path / f"ranks{ranks}", plugins, tiny, algorithm, data, log, rewards=["odd_prompt"],
                       sampler="counting_hf", **settings)
        monkeypatch.setenv("CALLS_FILE", str(tmp_path / f"calls{ranks}"))
        ctx.inputs["eval_dataset"] = evals
        if algorithm == "ppo_process":
            with_prm(ctx, tiny, tmp_path / f"ranks{ranks}", outcome="odd_prompt")
        runs[ranks] = (run_rl(ctx) if ranks == 1 else run_in_processes("rl", ctx, threads=1, ranks=2)), log
    (one, one_log), (two, two_log) = runs[1], runs[2]
    assert [s for s, _ in two_log] == [s for s, _ in one_log] == [1, 2, 2]
    for (_, a), (_, b) in zip(one_log, two_log):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith(("time/", "perf/tokens_per_s", "perf/completions_per_s")):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert one_log[0][1]["reward/total/std"] > 0  # one prompt of each step is odd
    assert one_log[0][1]["eval/accuracy"] == 0.5 and one_log[-1][1]["eval/response_length/mean"] > 0
    # each rank generated its prompt of a round; of the evaluation's chunks (64, 64, 2 prompts) rank 1 took
    # the second alone, rank 0 the others
    calls = set((tmp_path / "calls2").read_text().splitlines())
    assert {"0 generate 1", "1 generate 1", "0 generate 64", "0 generate 2", "1 generate 64"} <= calls
    assert "1 generate 2" not in calls
    if algorithm == "ppo_process":  # step rewards reached the rollout
        assert one_log[0][1]["reward/prm/mean"] > 0
    a, b = weights(one.outputs["model"]), weights(two.outputs["model"])
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert {p.name for p in (tmp_path / "ranks2").rglob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}


def test_dapo_refills_over_two_ranks(tmp_path, plugins, tiny):
    """Sampled rollouts on two ranks, each its own seed: every rank filters the same gathered round, so
    the refill rounds and the kept groups agree and the update steps together."""
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["dead", "x", "dead", "dead"])
    ctx = make_ctx(tmp_path, plugins, tiny, "dapo", data, log, max_steps=1, group_size=8, micro_batch_size=8)
    result = run_in_processes("rl", ctx, threads=1, ranks=2)
    metrics = log[0][1]
    assert metrics["sampling/rounds"] >= 2 and metrics["sampling/groups_kept"] == 2
    assert metrics["perf/tokens"] > 0 and metrics["actor/grad_norm"] > 0
    before, after = weights(tiny), weights(result.outputs["model"])
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert {p.name for p in tmp_path.rglob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}  # two ranks ran


def test_several_ranks_need_a_prompt_each_and_no_zero3(tmp_path, plugins, tiny, monkeypatch):
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    def on_four(**settings):  # the context of a stage the launcher gives 4 ranks
        return dataclasses.replace(make_ctx(tmp_path, plugins, tiny, "grpo", data, [], **settings), world=4)

    check_ranks(on_four(prompts_per_step=4))
    with pytest.raises(SpecError, match="prompts_per_step: 2 prompts cannot be shared by 4 processes"):
        check_ranks(on_four())
    with pytest.raises(SpecError, match="zero_stage: an rl stage on 4 processes.*use zero_stage 0, 1 or 2"):
        check_ranks(on_four(prompts_per_step=4, zero_stage=3))
    # 4 prompts x 4 = 16 completions a minibatch: micro-batches of 8 cannot give each of 4 ranks one
    with pytest.raises(SpecError, match="micro_batch_size: each minibatch of 16 completions .* shared by 4 "
                                        "processes .* 16 must be a multiple of 8 x 4"):
        check_ranks(on_four(prompts_per_step=4, micro_batch_size=8))
