"""Overlapped rollouts: the next step's first round generates in a worker process on the previous weights."""

import pytest
import torch

from alignflow.core.errors import AlignflowError
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.spec.settings import GenerationSettings
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.overlap import Overlapped
from alignflow.plugins.hf import HFSampler
from tests.flows.stages.rl.test_rl_stage import ASCII, make_ctx, plugins, tiny, write_rows  # noqa: F401 - fixtures

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
def test_with_fixed_weights_the_overlapped_rollouts_are_the_synchronous_ones(tmp_path, plugins, tiny, one_thread):
    """lr 0: the worker's rounds (on staged weights, same seeds) are exactly what the stage would generate."""
    _, sync = run(tmp_path / "sync", plugins, tiny, lr=0.0)
    _, overlapped = run(tmp_path / "overlap", plugins, tiny, lr=0.0, overlap_rollouts=True)
    assert [m["rollout/staleness"] for m in overlapped] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [m["rollout/staleness"] for m in sync] == [0.0] * 5
    for key in ("reward/total/mean", "response_length/mean", "accuracy"):
        assert [m[key] for m in overlapped] == [m[key] for m in sync], key


@pytest.mark.system
def test_overlapped_rollouts_are_one_step_off_policy_and_still_learn(tmp_path, plugins, tiny, one_thread):
    """Each round after the first comes from the weights before the last update: the trainer's log-probs
    of its tokens then differ from the sampler's (the ratio corrects for it), and GRPO still learns."""
    result, log = run(tmp_path, plugins, tiny, lr=1e-2, overlap_rollouts=True, max_steps=6,
                      generation={"max_new_tokens": 1})
    assert [m["rollout/staleness"] for m in log] == [0.0] + [1.0] * 5
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
    sampler = Overlapped(inner, model, tok)
    try:
        gen = GenerationSettings(max_new_tokens=2)
        sampler.prefetch([tok.encode("1+1=")], 2, gen, 0)
        sampler.process.kill()
        sampler.process.join()
        with pytest.raises(AlignflowError, match="worker process died"):
            sampler.generate([tok.encode("1+1=")], 2, gen, 0)
    finally:
        sampler.close()


@pytest.mark.parametrize("settings, sampler, message", [
    ({"zero_stage": 3}, "hf", "ZeRO-3 shards"),
    ({}, "vllm", "engine of its own"),
])
def test_overlap_refuses_what_it_cannot_copy(tmp_path, plugins, tiny, settings, sampler, message):
    from alignflow.core import SpecError

    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, [], sampler=sampler, overlap_rollouts=True, **settings)
    with pytest.raises(SpecError, match=message):
        run_rl(ctx)
