import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignflow.core.errors import AlignflowError
from alignflow.core.train.models import (
    build_tiny, load_model, load_tokenizer, load_value_model, logprobs_from_logits, position_ids, sequence_scores,
    token_logprobs, token_values,
)
from alignflow.core.train.logits import entropy_from_logits
from alignflow.core.train.packing import pack_rows, packing_works


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def _batch(tok, texts, side):
    tok.padding_side = side
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def test_parameter_count_and_architecture(tiny):
    model = load_model(tiny)
    n = sum(p.numel() for p in model.parameters())
    assert 900_000 < n < 1_100_000
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(tiny))


def test_build_is_deterministic_and_overridable(tiny, tmp_path):
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(build_tiny(tmp_path / "again", seed=0)) == digest(tiny)
    assert digest(build_tiny(tmp_path / "seed1", seed=1)) != digest(tiny)
    before = torch.random.get_rng_state()
    wide = load_model(build_tiny(tmp_path / "wide", hidden_size=64, num_hidden_layers=2))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert (wide.config.hidden_size, wide.config.num_hidden_layers) == (64, 2)


def test_save_load_round_trip_gives_identical_logits(tiny, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    ids = torch.tensor([[5, 9, 77, 12, 85, 100]])
    model.save_pretrained(tmp_path / "copy")
    again = load_model(tmp_path / "copy")
    assert torch.equal(model(ids).logits, again(ids).logits)


def test_load_model_bf16_and_bad_dtype(tiny):
    assert next(load_model(tiny, dtype="bf16").parameters()).dtype == torch.bfloat16
    with pytest.raises(AlignflowError, match="dtype 'fp16'"):
        load_model(tiny, dtype="fp16")


def test_load_tokenizer_pad_fallback_and_chat_template(tiny, tmp_path):
    tok = load_tokenizer(tiny, padding_side="left")
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "nopad")
    assert load_tokenizer(tmp_path / "nopad").pad_token == "</s>"
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}!")
    for template in ("{{ messages[0]['content'] }}!", str(tmp_path / "t.jinja")):
        tok = load_tokenizer(tiny, chat_template=template)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"


def test_token_logprobs_matches_hand_computation(tiny):
    model = load_model(tiny)
    tok = load_tokenizer(tiny)
    ids, attn = _batch(tok, ["12+3=<think>", "7+8=15"], "right")
    labels = torch.zeros_like(ids)
    labels[:, 3:] = 1
    got, ent = token_logprobs(model, ids, attn, labels, return_entropy=True)
    with torch.no_grad():
        logp = model(ids, attention_mask=attn).logits.log_softmax(-1)
    want = torch.zeros_like(got)
    for b in range(ids.shape[0]):
        for t in range(3, ids.shape[1]):
            if attn[b, t]:
                want[b, t] = logp[b, t - 1, ids[b, t]]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[:, :3] == 0).all() and (got[1, 6:] == 0).all()  # prompt and right padding
    p = logp.exp()
    torch.testing.assert_close(ent[0, 3:], -(p * logp).sum(-1)[0, 2:-1], atol=1e-5, rtol=0)
    # Temperature divides the logits before the softmax.
    hot = token_logprobs(model, ids, attn, labels, temperature=2.0)
    with torch.no_grad():
        hot_logp = (model(ids, attention_mask=attn).logits / 2).log_softmax(-1)
    torch.testing.assert_close(hot[0, 4], hot_logp[0, 3, ids[0, 4]], atol=1e-5, rtol=0)


def test_token_logprobs_ignore_left_padding(tiny):
    model = load_model(tiny)
    tok = load_tokenizer(tiny)
    texts = ["905-18=", "7+8="]
    r_ids, r_attn = _batch(tok, texts, "right")
    l_ids, l_attn = _batch(tok, texts, "left")
    right, left = token_logprobs(model, r_ids, r_attn), token_logprobs(model, l_ids, l_attn)
    torch.testing.assert_close(right[1, 1:4], left[1, 4:7], atol=1e-5, rtol=0)
    assert left[1, :4].abs().sum() == 0


def test_logprobs_from_logits_bf16_matches_fp32():
    logits = torch.randn(2, 5, 50, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    want = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, tokens), want)
    low = logprobs_from_logits(logits.bfloat16(), tokens)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, want, atol=0.05, rtol=0)
    uniform = entropy_from_logits(torch.zeros(1, 1, 50))
    torch.testing.assert_close(uniform, torch.tensor([[torch.log(torch.tensor(50.0))]]))


def test_value_model_from_causal_lm(tiny, tmp_path):
    value = load_value_model(tiny)
    assert value.score.out_features == 1 and value.score.weight.abs().sum() == 0
    tok = load_tokenizer(tiny)
    ids, attn = _batch(tok, ["1+2=", "35+7="], "right")
    assert token_values(value, ids, attn).shape == ids.shape
    torch.nn.init.normal_(value.score.weight, generator=torch.Generator().manual_seed(0))
    # token_values runs the same head as the transformers forward, at every position.
    full = token_values(value, ids, attn)
    torch.testing.assert_close(value(ids[:1, :4]).logits[0, 0], full[0, 3], atol=1e-5, rtol=0)
    # A trained reward model keeps its head on reload (only a missing head starts at zero).
    value.save_pretrained(tmp_path / "rm")
    assert torch.equal(load_value_model(tmp_path / "rm").score.weight, value.score.weight)
    with pytest.raises(AlignflowError, match="no `score` head"):
        token_values(load_model(tiny), ids, attn)


def test_sequence_scores_identical_under_left_and_right_padding(tiny):
    value = load_value_model(tiny)
    torch.nn.init.normal_(value.score.weight, generator=torch.Generator().manual_seed(0))
    tok = load_tokenizer(tiny)
    texts = ["905-18=<think>", "7+8=", "12*3=36"]
    right = sequence_scores(value, *_batch(tok, texts, "right"))
    left = sequence_scores(value, *_batch(tok, texts, "left"))
    alone = torch.stack([sequence_scores(value, *_batch(tok, [t], "right"))[0] for t in texts])
    torch.testing.assert_close(right, left, atol=1e-5, rtol=0)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=0)
    assert len(set(alone.tolist())) == 3


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_pack_rows_first_fit_decreasing():
    bins = pack_rows([5, 2, 7, 3, 1, 4], width=8)
    assert sorted(r for b in bins for r in b) == list(range(6))  # every row once
    assert bins == [[2, 4], [0, 3], [5, 1]]  # 7+1, 5+3, 4+2: three rows of 8 instead of six
    assert pack_rows([8, 8], width=8) == [[0], [1]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_logprobs_entropy_and_gradients_equal_padded(tiny, side):
    """Packing rows end to end (positions restarting per sequence) gives the padded batch's log-probs,
    entropies and parameter gradients: no token sees another sequence."""
    model = load_model(tiny)
    tok = load_tokenizer(tiny)
    texts = ["905-18=887", "7+8=15", "12*3=36</s>", "1=", "400-399=1", "6*7=42"]
    ids, attn = _batch(tok, texts, side)
    labels = torch.zeros_like(ids)
    labels[:, 2:] = 1
    assert packing_works(model)

    def run(packed):
        model.zero_grad()
        lp, ent = token_logprobs(model, ids, attn, labels, temperature=0.7, return_entropy=True, packed=packed)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]

    (lp, ent, grads), (plp, pent, pgrads) = run(False), run(True)
    torch.testing.assert_close(plp, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(pent, ent, atol=1e-5, rtol=0)
    assert ((plp != 0) == (lp != 0)).all()
    for g, pg in zip(grads, pgrads):
        torch.testing.assert_close(pg, g, atol=1e-4, rtol=1e-4)


def test_packing_falls_back_for_attention_that_mixes_sequences(tiny):
    """A model whose attention ignores restarting position ids would let packed sequences see each other:
    the probe notices and the padded path is used, with the same values."""
    model = load_model(tiny)

    class Mixing(torch.nn.Module):  # causal attention over the whole row, whatever the positions
        def __init__(self):
            super().__init__()
            self.inner, self.config = model, model.config

        @property
        def device(self):
            return model.device

        def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
            return self.inner(input_ids, attention_mask=attention_mask, **kw)

    mixing = Mixing()
    assert not packing_works(mixing)
    ids, attn = _batch(load_tokenizer(tiny), ["905-18=887", "7+8=15"], "right")
    torch.testing.assert_close(token_logprobs(mixing, ids, attn, packed=True), token_logprobs(model, ids, attn))


def test_half_precision_logits_upcast_in_blocks_give_the_fp32_values(monkeypatch):
    """bf16 logits are upcast a block of rows at a time (packed [tokens, V] logits too): the log-probs and
    entropies are those of the fp32 upcast of the whole tensor, whatever the block size."""
    import alignflow.core.train.logits as lg

    torch.manual_seed(0)
    logits = torch.randn(7, 5, 11).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (7, 5))
    whole = logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    entropy = -(logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)
    for block in (1 << 24, 2 * 5 * 11, 11):  # one block; two rows a block; one token a block (flattened)
        monkeypatch.setattr(lg, "UPCAST_ELEMENTS", block)
        for x, t, w, e in ((logits, tokens, whole, entropy), (logits.flatten(0, 1), tokens.flatten(), whole.flatten(),
                                                               entropy.flatten())):
            torch.testing.assert_close(lg.logprobs_from_logits(x, t), w, atol=1e-5, rtol=0)
            torch.testing.assert_close(lg.entropy_from_logits(x), e, atol=1e-5, rtol=0)
            both = lg.logprobs_and_entropy(x, t)
            torch.testing.assert_close(both[0], w, atol=1e-5, rtol=0)
            torch.testing.assert_close(both[1], e, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_share_one_log_softmax_and_only_the_log_probs_carry_a_gradient(dtype):
    """The pair equals the two functions apart; the log-probs' gradient is the one-hot minus the softmax (per
    token, weighted), the entropy has none."""
    from alignflow.core.train.logits import logprobs_and_entropy

    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    tokens = torch.tensor([0, 8, 3, 3, 5, 1])
    weights = torch.arange(1.0, 7.0)
    logprobs, entropy = logprobs_and_entropy(logits, tokens)
    assert logprobs.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(logprobs, logprobs_from_logits(logits, tokens), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, entropy_from_logits(logits).detach(), atol=1e-5, rtol=0)
    (logprobs * weights).sum().backward()
    p = logits.detach().float().softmax(-1)
    want = (torch.nn.functional.one_hot(tokens, 9) - p) * weights[:, None]
    torch.testing.assert_close(logits.grad.float(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
