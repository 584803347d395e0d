"""Stages on the vllm sampler give what they give on hf: the rl stage's rollouts step by step (its weights
synced into the engine after each update), the evaluate stage's samples byte for byte, and a
rejection_sampling stage on two ranks, each with its own engine, one hf process's rows.

Greedy decoding, so both samplers must make the same tokens; fp32, so the same log-probs. Runs where vLLM
is installed (`.ci/run` builds an environment for it); skipped elsewhere.
"""

import json

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # vLLM starts its engine core in a process of its own
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

import alignflow.plugins.hf  # noqa: E402
import alignflow.plugins.vllm_sampler  # noqa: E402
from alignflow.core import hookimpl  # noqa: E402
from alignflow.core.train.models import build_tiny  # noqa: E402
from alignflow.core.plugins import Plugins  # noqa: E402
from alignflow.core.spec.settings import EvaluateSettings, SampleSettings  # noqa: E402
from alignflow.core.spec.schema import StageSpec, parse_spec  # noqa: E402
from alignflow.flows.launch.ranks import run_in_processes  # noqa: E402
from alignflow.flows.stages import StageContext  # noqa: E402
from alignflow.flows.stages.evaluate import run_evaluate  # noqa: E402
from alignflow.flows.stages.rl.stage import run_rl  # noqa: E402
from alignflow.plugins.hf import HFSampler  # noqa: E402
from alignflow.plugins.vllm_sampler import VLLMSampler  # noqa: E402

from tests.flows.test_rejection_stage import Rewards  # noqa: E402
from tests.flows.stages.rl.test_rl_stage import make_ctx, plugins, tiny, weights, write_rows  # noqa: E402, F401

CALLS: dict[str, list] = {}


def recording(base):
    class Recording(base):
        """`base`, keeping every generation it makes under its registered name."""

        def generate(self, prompt_ids, n, gen, seed):
            out = super().generate(prompt_ids, n, gen, seed)
            CALLS.setdefault(base.__name__, []).append((prompt_ids, out.completion_ids, out.logprobs))
            return out

    return Recording


class Samplers:
    @staticmethod
    @hookimpl
    def register_samplers(register):
        register("rec_hf", recording(HFSampler))
        register("rec_vllm", recording(VLLMSampler))


@pytest.fixture(scope="module")
def samplers(plugins):  # noqa: F811
    plugins.add(Samplers, "test_vllm_stages")
    yield plugins
    plugins.remove("test_vllm_stages")


def test_rl_stage_rollouts_and_weights_match_hf(tmp_path, samplers, tiny):  # noqa: F811
    """REINFORCE++ whitens over the whole batch, so a greedy rollout (a group's samples alike) still has
    advantages; SGD at a large lr changes step 2's greedy completions, which vLLM only makes if the
    update reached its engine."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    CALLS.clear()
    runs = {}
    for name in ("rec_hf", "rec_vllm"):
        log = []
        ctx = make_ctx(tmp_path / name, samplers, tiny, "reinforce_pp", data, log, sampler=name,
                       rewards=("odd_prompt",), optimizer="sgd", lr=20.0, grad_clip=0.0,
                       generation={"max_new_tokens": 8, "temperature": 0.0})
        runs[name] = weights(run_rl(ctx).outputs["model"]), log
    hf, vllm = CALLS["HFSampler"], CALLS["VLLMSampler"]
    assert len(hf) == len(vllm) == 2
    assert hf[0][1] != hf[1][1]  # the first update changed the greedy completions
    for (p_h, ids_h, lp_h), (p_v, ids_v, lp_v) in zip(hf, vllm):
        assert p_h == p_v and ids_h == ids_v
        torch.testing.assert_close(torch.tensor(lp_v), torch.tensor(lp_h), atol=1e-4, rtol=0)
    (w_h, log_h), (w_v, log_v), w0 = runs["rec_hf"], runs["rec_vllm"], weights(tiny)
    for k in w_h:  # the steps are large (up to 33 at this lr), so float rounding shows at 1e-3 of them
        step = (w_h[k] - w0[k]).abs().max()
        assert (w_v[k] - w_h[k]).abs().max() <= 2e-3 * step + 1e-6, k
    for (step, m_h), (_, m_v) in zip(log_h[:-1], log_v[:-1]):
        assert m_v["rollout/logprob_abs_diff"] < 1e-4  # fp32: the engine's numbers are the trainer's
        rel = 1e-4 if step == 1 else 5e-3  # step 2 starts from weights that differ at 1e-3 of step 1
        for key in ("reward/total/mean", "response_length/mean", "advantages/std", "actor/grad_norm"):
            assert m_v[key] == pytest.approx(m_h[key], rel=rel, abs=1e-6), key


def test_evaluate_stage_writes_the_same_samples(tmp_path, samplers, tiny):  # noqa: F811
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 2}) + "\n"
                            for i in range(70)))  # two chunks of 64 prompts
    written = {}
    for name in ("hf", "vllm"):
        spec = StageSpec(kind="evaluate", inputs={"model": str(tiny), "dataset": str(data)}, rewards=["odd_prompt"],
                         sampler=name)
        settings = EvaluateSettings(n=1, generation={"max_new_tokens": 10, "temperature": 0.0})
        ctx = StageContext("eval", spec, settings, spec.inputs, tmp_path / name, tmp_path / f"{name}-ckpt", 0,
                           lambda m, s: None, samplers)
        ctx.work_dir.mkdir(parents=True)
        result = run_evaluate(ctx)
        written[name] = result.outputs["dataset"].read_bytes()
    assert written["hf"] == written["vllm"]


def test_two_ranks_each_with_an_engine_sample_what_one_hf_process_does(tmp_path):
    """A rejection_sampling stage on two ranks, each starting its own engine, over 70 prompts (two seeded
    chunks: one per rank), greedy: the pairs written are one hf process's, byte for byte."""
    plugs = Plugins()
    plugs.add(alignflow.plugins.hf, "hf")
    plugs.add(alignflow.plugins.vllm_sampler, "vllm")
    plugs.add(Rewards, "rewards")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(70)))
    inputs = {"model": build_tiny(tmp_path / "model", seed=1), "dataset": data}
    out = {}
    for sampler, ranks in (("hf", 1), ("vllm", 2)):
        spec = parse_spec({"name": "rs", "stages": {"rs": {
            "kind": "rejection_sampling", "inputs": {k: str(v) for k, v in inputs.items()}, "rewards": ["even_start"],
            "sampler": sampler, "settings": {"n": 1, "output": "sft",
                                             "generation": {"max_new_tokens": 6, "temperature": 0.0}}}}}, plugins=plugs)
        stage = spec.stages["rs"]
        (tmp_path / sampler).mkdir()
        ctx = StageContext("rs", stage, SampleSettings.model_validate(stage.settings), inputs, tmp_path / sampler,
                           tmp_path / f"ckpt-{sampler}", 7, lambda m, s: None, plugs)
        out[sampler] = run_in_processes("rejection_sampling", ctx, threads=1, ranks=ranks)
    assert out["vllm"].metrics == out["hf"].metrics and out["hf"].metrics["rows_written"] > 0
    assert out["vllm"].outputs["dataset"].read_bytes() == out["hf"].outputs["dataset"].read_bytes()

