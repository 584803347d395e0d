"""Packed forwards where rows share their prompt (a GRPO group): one copy of the prompt, the padded batch's numbers."""

import types

import pytest
import torch

from alignflow.core.train import packing, varlen
from alignflow.core.train.models import load_model, load_tokenizer, token_logprobs
from alignflow.core.train.packing import layout, masks_work
from helpers.load import busy_loops, torch_threads


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


class NoMasks(torch.nn.Module):
    """`model` with its attention mask dropped: every token sees all before it, the probe's failure case."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, input_ids, attention_mask=None, **kw):
        return self.inner(input_ids, **kw)


def group_batch(tok, side):
    """Two prompts with three and two completions, one prompt alone, padded on `side`; labels on completions."""
    pairs = [("12+7=", "19</s>"), ("12+7=", "91"), ("12+7=", "1+9=10</s>"), ("3*4=", "12</s>"), ("3*4=", "7"),
             ("12+8=", "20")]  # "12+8=" starts like "12+7=" but is another prompt
    tok.padding_side = side
    enc = tok([p + c for p, c in pairs], return_tensors="pt", padding=True)
    labels = torch.zeros_like(enc.input_ids)
    for row, (p, c) in enumerate(pairs):
        n_p, n = len(tok(p).input_ids), int(enc.attention_mask[row].sum())
        start = int(enc.attention_mask[row].argmax())
        labels[row, start + n_p: start + n] = 1
    return enc.input_ids, enc.attention_mask, labels


def test_rows_with_one_prompt_share_one_copy(tiny):
    tok = load_tokenizer(tiny)
    ids, attn, labels = group_batch(tok, "right")
    prompts = [len(tok(p).input_ids) for p in ["12+7="] * 3 + ["3*4="] * 2 + ["12+8="]]
    lay = layout(ids, attn, prompts)
    # 5 + (3 + 2 + 7) tokens, 4 + (3 + 1), and the lone "12+8=20" (7): 31 tokens, not the 45 real ones
    assert len(lay.target) == int(attn.sum()) - 2 * 5 - 1 * 4
    # every row's prompt tokens point at the same packed copy
    at = lay.at.view(ids.shape)
    assert at[0, :5].tolist() == at[1, :5].tolist() == at[2, :5].tolist()
    assert at[3, :4].tolist() == at[4, :4].tolist() != at[5, :4].tolist()


@pytest.mark.parametrize("side", ["right", "left"])
def test_shared_prompt_logprobs_entropy_and_gradients_equal_padded(tiny, side, monkeypatch):
    model = load_model(tiny)
    tok = load_tokenizer(tiny)
    ids, attn, labels = group_batch(tok, side)
    assert masks_work(model)
    layouts = []
    real = packing.layout
    monkeypatch.setattr(packing, "layout", lambda *a: layouts.append(real(*a)) or layouts[-1])

    def run(packed):
        model.zero_grad()
        lp, ent = token_logprobs(model, ids, attn, labels, temperature=0.7, return_entropy=True, packed=packed)
        (lp * torch.arange(1, lp.shape[1] + 1)).sum().add(ent.sum()).backward()  # weights differ by token
        return lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]

    (lp, ent, grads), (plp, pent, pgrads) = run(False), run(True)
    # the packed forward really shared: each row's prompt found, and 2 * 5 + 1 * 4 prompt tokens not repeated
    assert len(layouts) == 1 and len(layouts[0].target) == int(attn.sum()) - 2 * 5 - 1 * 4
    assert ((lp != 0) == labels.bool()).all()
    torch.testing.assert_close(plp, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(pent, ent, atol=1e-5, rtol=0)
    for g, pg in zip(grads, pgrads):
        torch.testing.assert_close(pg, g, atol=1e-4, rtol=1e-4)


def test_a_model_that_ignores_4d_masks_packs_without_sharing(tiny, monkeypatch):
    """Were the mask ignored, a completion would see its siblings: the probe fails and each row keeps its own
    prompt copy (position-id packing), with the same values."""
    model = load_model(tiny)

    wrapped = NoMasks(model)
    assert not masks_work(wrapped) and packing.packing_works(wrapped)
    seen = []
    real = packing.layout
    monkeypatch.setattr(packing, "layout", lambda *a: seen.append(a[2]) or real(*a))
    ids, attn, labels = group_batch(load_tokenizer(tiny), "right")
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(wrapped, ids, attn, labels, packed=True),
                                   token_logprobs(model, ids, attn, labels), atol=1e-5, rtol=0)
    assert seen == [None]


def test_probes_pass_a_bf16_model_and_still_catch_an_ignored_mask(tiny, monkeypatch):
    """bf16 logits of packed and apart forwards differ by rounding (8 mantissa bits), which a 1e-3 tolerance
    took for a model that cannot pack: a bf16 stage then fell back to padded batches. The tolerance follows
    the dtype, and a mask that is really ignored still fails in bf16."""
    model = load_model(tiny).to(torch.bfloat16)
    monkeypatch.setattr(packing, "_PACKING", {})
    monkeypatch.setattr(packing, "_MASKS", {})
    assert packing.packing_works(model) and masks_work(model)

    assert not masks_work(NoMasks(model))


@pytest.mark.system  # busy loops are processes
def test_shared_prompt_gradients_are_the_same_every_time_on_two_threads_under_load(tiny):
    """A shared prompt's last position predicts the first token of each of its completions, so the packed forward
    picks that row of logits once per completion. Picked by advanced indexing, the backward added those rows'
    gradients with atomic adds split across threads, in an order that timing decides: 16 of 20 repeats of this
    backward gave other bits beside busy loops, and a GRPO stage's weights drifted run to run."""
    model = load_model(tiny)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (64, 30), generator=g)
    ids[:, :6] = ids[0, :6]  # one prompt, 64 completions of 24 tokens
    attn, labels = torch.ones_like(ids), torch.zeros_like(ids)
    labels[:, 6:] = 1
    weight = torch.randn(ids.shape, generator=g)
    params = list(model.parameters())

    def grads():
        lp = token_logprobs(model, ids, attn, labels, packed=True)
        return torch.autograd.grad((lp * weight).sum(), params)

    with torch_threads(2), busy_loops(2):
        first = grads()
        for _ in range(8):
            assert all(torch.equal(a, b) for a, b in zip(first, grads()))


def test_a_group_longer_than_the_width_splits_into_units_each_with_its_prompt(tiny, monkeypatch):
    """At width 9 the "12+7=" group (prompt 5, completions 3, 2, 7) splits into [5+3] ... units of at most 9
    tokens where it can ("1+9=10</s>" alone is wider: its row is 12), and the values stay the padded ones."""
    tok = load_tokenizer(tiny)
    ids, attn, labels = group_batch(tok, "left")
    prompts = [len(tok(p).input_ids) for p in ["12+7="] * 3 + ["3*4="] * 2 + ["12+8="]]
    lay = layout(ids, attn, prompts, width=9)
    at = lay.at.view(ids.shape)
    starts = attn.int().argmax(-1)
    first = [at[r, starts[r]].item() for r in range(6)]  # where each row's prompt copy starts
    assert first[0] != first[1] != first[2] and first[3] == first[4]  # 5+3, 5+2, 5+7 alone; 4+3+1 together
    assert lay.width == 12  # the widest unit, "12+7=" + "1+9=10</s>"
    model = load_model(tiny)
    monkeypatch.setattr(packing, "pack_width", lambda m: 9)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, ids, attn, labels, packed=True),
                                   token_logprobs(model, ids, attn, labels), atol=1e-5, rtol=0)


def test_packed_rows_on_a_cpu_come_in_a_multiple_of_cpu_rows(tiny):
    """Empty rows pad the packed batch to a multiple of CPU_ROWS (few matrix shapes for the CPU's matmul
    library); the real tokens stay where they were, and the values stay the padded batch's (test above)."""
    tok = load_tokenizer(tiny)
    ids, attn, _ = group_batch(tok, "left")
    prompts = [len(tok(p).input_ids) for p in ["12+7="] * 3 + ["3*4="] * 2 + ["12+8="]]
    bare, padded = layout(ids, attn, prompts, width=9), layout(ids, attn, prompts, width=9, row_multiple=4)
    assert (bare.rows, padded.rows) == (5, 8)
    assert torch.equal(padded.at, bare.at) and torch.equal(padded.target, bare.target)
    assert len(padded.positions) == 8 * padded.width and len(padded.unit) == 8 * padded.width
    model = load_model(tiny)
    assert packing.pack_shape(model) == (64, packing.CPU_ROWS) and packing.CPU_ROWS == 4
    engine = types.SimpleNamespace(module=model)  # what the stage passes: DeepSpeed's engine, the model inside
    assert packing.pack_shape(engine) == packing.pack_shape(model)  # H/2 = 64 on the tiny model, not 256


def test_the_packed_forward_takes_its_rows_in_a_multiple_of_cpu_rows(tiny, monkeypatch):
    """transformers' forward of the packed rows (where the forward on real tokens only does not run,
    tests/core/train/test_varlen.py) gets the padded row count, at the CPU's width."""
    monkeypatch.setattr(varlen, "unsupported", lambda model: "transformers' forward")
    tok = load_tokenizer(tiny)
    ids, attn, labels = group_batch(tok, "right")
    model, shapes = load_model(tiny), []
    model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(args[0].shape)), with_kwargs=True)
    with torch.no_grad():
        token_logprobs(model, ids, attn, labels, packed=True)
    rows, width = shapes[-1]
    assert width == 64 and rows % packing.CPU_ROWS == 0 and rows > 0
