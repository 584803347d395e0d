"""An rl stage training LoRA adapters on the vllm sampler (the adapters synced alone, through vLLM's LoRA
serving) makes the rollouts the hf sampler makes on the same policy, step by step.

Greedy decoding and fp32, as tests/flows/test_vllm_stages.py. Runs where vLLM is installed; skipped elsewhere.
"""

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # vLLM starts its engine core in a process of its own
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

from alignflow.flows.stages.rl.stage import run_rl  # noqa: E402
from alignflow.plugins.vllm_sampler import VLLMSampler  # noqa: E402

from tests.flows.stages.rl.test_rl_stage import make_ctx, plugins, tiny, write_rows  # noqa: E402, F401
from tests.flows.test_vllm_stages import CALLS, samplers  # noqa: E402, F401


def test_lora_rl_stage_on_vllm_adapters_rolls_out_as_hf(tmp_path, samplers, tiny, monkeypatch):  # noqa: F811
    """LoRA r 8 on every linear layer; SGD at a large lr moves B off zero in step 1, so step 2's greedy
    completions differ from step 1's, which vLLM makes only if the adapters reached its engine."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    CALLS.clear()
    synced = []
    sync = VLLMSampler._sync_adapters

    def spy(self, model):
        sync(self, model)
        synced.append((self.lora.lora_int_id, self.sync_bytes))

    monkeypatch.setattr(VLLMSampler, "_sync_adapters", spy)
    for name in ("rec_hf", "rec_vllm"):
        ctx = make_ctx(tmp_path / name, samplers, tiny, "reinforce_pp", data, [], sampler=name,
                       rewards=("odd_prompt",), optimizer="sgd", lr=20.0, grad_clip=0.0, lora={"r": 8},
                       generation={"max_new_tokens": 8, "temperature": 0.0})
        run_rl(ctx)
    # the policy's adapters at the start, then after each of the 2 updates: 90112 fp32 numbers each
    # (tests/plugins/test_vllm_sampler.py), never the 1.0M of the whole model
    assert [i for i, _ in synced] == [1, 2, 3] and all(360448 < b < 400000 for _, b in synced)
    hf, vllm = CALLS["HFSampler"], CALLS["VLLMSampler"]
    assert len(hf) == len(vllm) == 2
    assert hf[0][1] != hf[1][1]  # the first update changed the greedy completions
    for (p_h, ids_h, lp_h), (p_v, ids_v, lp_v) in zip(hf, vllm):
        assert p_h == p_v and ids_h == ids_v
        for x, y in zip(lp_v, lp_h):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
