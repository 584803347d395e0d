"""LoRA adapters on the tiny model: which weights train, the base under the adapters as a reference, merged
weights without touching the module, and saved adapters loading back as their base plus them."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.errors import AlignflowError
from alignflow.core.train.adapters import AdaptersOff, has_adapters, is_adapter_dir, merged_state_dict, with_lora
from alignflow.core.train.models import load_model, token_logprobs
from alignflow.core.spec.settings import LoraSettings, PolicySettings, TrainSettings


@pytest.fixture(scope="module")
def base_dir(tiny_model):
    return tiny_model()


def adapted(base_dir, **lora):
    return with_lora(load_model(base_dir), LoraSettings(**{"r": 8, **lora}), str(base_dir))


def perturb(model, seed=1):
    """Non-zero adapters (B starts at zero, so fresh adapters change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def batch():
    ids = torch.tensor([[5, 9, 14, 20, 7, 3], [2, 11, 4, 8, 0, 0]]) + 3
    return ids, torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def test_only_the_adapters_train_and_their_count_is_r_times_in_plus_out(base_dir):
    model = adapted(base_dir)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    # "all-linear" on each of the 4 tiny layers (hidden 128, 2 KV heads of 32, MLP 512), r (in + out) each:
    # q 8(128+128)=2048, k 8(128+64)=1536, v 1536, o 2048, gate 8(128+512)=5120, up 5120, down 5120: 22528 a
    # layer, 90112 in all; the tied output head is not adapted.
    assert sum(trained.values()) == 4 * 22528 == 90112
    assert not any("lm_head" in n or "embed" in n for n in trained)
    # a list of names adapts those only: q_proj and v_proj, 2048 + 1536 a layer
    narrow = adapted(base_dir, target_modules=["q_proj", "v_proj"])
    assert sum(p.numel() for p in narrow.parameters() if p.requires_grad) == 4 * (2048 + 1536)


def test_fresh_adapters_are_the_base_and_adapters_off_is_the_base_after_training(base_dir):
    base = load_model(base_dir)
    model = adapted(base_dir)
    ids, mask = batch()
    with torch.no_grad():
        want = token_logprobs(base, ids, mask)
        assert torch.equal(token_logprobs(model, ids, mask), want)  # B = 0: W + 0
        perturb(model)
        reference = AdaptersOff(model)
        assert (token_logprobs(model, ids, mask) - want).abs().max() > 1e-3  # the adapters now matter
        torch.testing.assert_close(token_logprobs(reference, ids, mask), want, rtol=0, atol=1e-6)
    model.train()
    reference(ids, attention_mask=mask)
    assert model.training  # the policy's mode is put back
    assert reference.state_dict() == {} and not list(reference.children())  # nothing to freeze, move or save
    assert next(reference.parameters()) is next(model.parameters())  # dtype and device probes read the policy's
    assert has_adapters(model) and not has_adapters(base)


def test_merged_state_dict_is_peft_merge_and_leaves_the_module_alone(base_dir):
    model = perturb(adapted(base_dir, alpha=16.0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_state_dict(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == want.keys() == load_model(base_dir).state_dict().keys()
    for k in want:
        torch.testing.assert_close(merged[k], want[k], rtol=0, atol=1e-6)
    # by hand on one weight: W + (alpha / r) B A = W + 2 B A
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], by_hand, rtol=0, atol=1e-6)


def test_saved_adapters_load_as_base_plus_adapters(base_dir, tmp_path):
    model = perturb(adapted(base_dir))
    model.save_pretrained(tmp_path / "a")
    assert is_adapter_dir(tmp_path / "a") and not is_adapter_dir(base_dir)
    files = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert files and all("lora_" in k for k in files)  # adapters only, no base weight
    loaded = load_model(tmp_path / "a")
    assert not has_adapters(loaded)  # merged: an ordinary model
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(loaded, ids, mask), token_logprobs(model, ids, mask),
                                   rtol=0, atol=1e-5)


def test_builtin_tiny_as_the_base_is_rebuilt(base_dir, tmp_path):
    model = perturb(with_lora(load_model(base_dir), LoraSettings(r=4), "builtin:tiny"))
    model.save_pretrained(tmp_path / "a")
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(load_model(tmp_path / "a"), ids, mask),
                                   token_logprobs(model, ids, mask), rtol=0, atol=1e-5)


def test_bad_lora_settings_are_named(base_dir):
    with pytest.raises(AlignflowError, match="settings.lora.target_modules"):
        adapted(base_dir, target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match="lora"):
        TrainSettings.model_validate({"lora": {"r": 8}})  # reward_model and prm stages take no adapters
    assert PolicySettings().lora.r == 0  # off unless asked for


def test_vllm_sync_writes_merged_weights_under_base_names(base_dir, tmp_path):
    from alignflow.plugins.vllm_sampler import VLLMSampler

    model = perturb(adapted(base_dir))
    VLLMSampler._write_weights(model, tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    want = merged_state_dict(model)
    assert written.keys() == want.keys()
    assert all(torch.equal(written[k], want[k]) for k in want)


def test_the_adapters_init_follows_the_seed_alone(base_dir):
    """A resumed or rerun stage starts from the same A (B is zero): drawn from the stage's seed, not from
    wherever the global RNG happens to be; the caller's RNG is left as it was."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = adapted(base_dir).state_dict()
    assert torch.equal(state, torch.get_rng_state())
    torch.rand(7)  # move the global RNG: the adapters do not follow it
    b = adapted(base_dir).state_dict()
    c = with_lora(load_model(base_dir), LoraSettings(r=8), str(base_dir), seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)


def test_the_hf_sampler_generates_with_the_adapters(base_dir):
    """The rl stage's `hf` sampler holds the peft policy itself: its sampled tokens' log-probs are the adapted
    model's (teacher-forced), not the base's."""
    from alignflow.core.train.models import load_tokenizer
    from alignflow.core.spec.settings import GenerationSettings
    from alignflow.plugins.hf import HFSampler

    model, tok = perturb(adapted(base_dir)).eval(), load_tokenizer(base_dir)
    base = load_model(base_dir).eval()
    sampler = HFSampler(HFSampler.Config())
    sampler.load(model, tok)
    prompt = tok.encode("12+3=")
    out = sampler.generate([prompt], 2, GenerationSettings(max_new_tokens=6, temperature=1.0), seed=3)
    for ids, lp in zip(out.completion_ids, out.logprobs):
        full = torch.tensor([prompt + ids])
        scored = torch.zeros_like(full)
        scored[:, len(prompt):] = 1
        with torch.no_grad():
            mine = token_logprobs(model, full, torch.ones_like(full), scored)[0, len(prompt):]
            theirs = token_logprobs(base, full, torch.ones_like(full), scored)[0, len(prompt):]
        torch.testing.assert_close(torch.tensor(lp), mine, rtol=0, atol=1e-4)
        assert (mine - theirs).abs().max() > 1e-3


def test_adapters_on_a_tied_head_or_embedding_are_refused_by_name(base_dir):
    """builtin:tiny ties its output head to its embeddings: adapters on one would change one use of the shared
    matrix and not the other, a policy no checkpoint (merged or vLLM's) holds."""
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(AlignflowError, match=f"target_modules=.*{target}.*tie_word_embeddings.*leave '{target}'"):
            adapted(base_dir, target_modules=["q_proj", target])
