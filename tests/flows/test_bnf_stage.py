"""The preference stage with a per-token algorithm (BNF): the reference's per-token log-probs are cached once
and read back in any micro-batch layout, and training on the tiny model widens the chosen/rejected margin."""

from pathlib import Path

import pytest
import torch

import alignflow.plugins.bnf
from alignflow.core.train.batching import collate
from alignflow.core.train.datasets import load_rows, tokenize
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.plugins import Plugins
from alignflow.core.train.offline import SequenceLogps, build_batch
from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.preference import (REFERENCE_CACHE, TOKENS, CachedReference, SequenceScorer,
                                               reference_logps, run_preference)
from alignflow.plugins.bnf import BNF
from alignflow.plugins.dpo import DPO
from recording import ReferenceForwards

SETTINGS = {"lr": 1e-3, "max_steps": 4, "batch_size": 4, "micro_batch_size": 2, "max_length": 64,
            "save_every": 2, "log_every": 1, "lr_scheduler": "linear"}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model):
    """A tiny model and 16 training, 4 held-out pairs of the task."""
    root = tmp_path_factory.mktemp("bnf")
    lines = write_datasets(root / "data")["pairs"].read_text().splitlines()
    out = {"model": tiny_model()}
    for name, part in [("pairs", lines[:16]), ("eval_pairs", lines[-4:])]:
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("\n".join(part) + "\n")
    return out


def pair_rows(files, n):
    tok = load_tokenizer(files["model"])
    rows, _ = tokenize(load_rows(files["pairs"], "pairwise").select(range(n)), tok, 64, "pairwise")
    return rows.add_column("row", list(range(n))), tok.pad_token_id


def test_cached_reference_tokens_match_a_live_forward_in_another_layout(files):
    model = load_model(files["model"])
    rows, pad_id = pair_rows(files, 5)
    cache = reference_logps(model, rows, ["chosen", "rejected"], 2, pad_id, CPU, tokens=True)
    micro = collate(rows.select([3, 0, 4]).to_list(), pad_id)  # other rows, other padding than when cached
    cached = CachedReference(cache, micro, None, CPU)
    with torch.no_grad():
        live = SequenceScorer(model, micro, "completion", CPU, entropy=True)
        for name in ("chosen", "rejected"):
            got, want = cached.tokens(name), live.tokens(name)
            assert torch.equal(got.mask, want.mask) and want.mask.sum() > 3 * 3
            assert torch.allclose(got.logps, want.logps, atol=1e-6)
            assert torch.allclose(cached(name, "completion").logps, want.logps.sum(-1), atol=1e-5)
            assert got.entropy is None  # the reference's entropy is never needed

    # the policy's entropy: H(softmax(logits)) at each completion token, from the same forward pass
    ids, attn = micro["chosen_input_ids"], micro["chosen_attention_mask"]
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits[:, :-1].double()  # position t predicts token t + 1
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    tokens = SequenceScorer(model, micro, "completion", CPU, entropy=True).tokens("chosen")
    assert torch.allclose(tokens.entropy[:, 1:][tokens.mask[:, 1:]], entropy[tokens.mask[:, 1:]].float(), atol=1e-5)
    assert tokens.logps.requires_grad and not tokens.entropy.requires_grad


class NamingScorer:
    """A `Scorer` whose per-token terms are the set's name, recording which sets were asked for."""

    def __init__(self):
        self.asked = []

    def __call__(self, name, scope):
        return SequenceLogps(torch.zeros(2), torch.ones(2))

    def tokens(self, name):
        self.asked.append(name)
        return name


def test_builder_gives_per_token_terms_only_to_algorithms_that_ask():
    policy, ref = NamingScorer(), NamingScorer()
    batch = build_batch(BNF(), policy, ref)
    assert (batch.chosen_tokens, batch.rejected_tokens) == ("chosen", "rejected")
    assert (batch.ref_chosen_tokens, batch.ref_rejected_tokens) == ("chosen", "rejected")
    policy, ref = NamingScorer(), NamingScorer()
    batch = build_batch(DPO(), policy, ref)
    assert policy.asked == ref.asked == [] and batch.chosen_tokens is None

    class Unpaired(BNF):
        requires_pairs, requires_labels = False, True

    with pytest.raises(ValueError, match="pairs only"):
        build_batch(Unpaired(), NamingScorer(), NamingScorer(), torch.tensor([1, 0]))


def context(tmp_path, inputs) -> tuple[StageContext, list]:
    plugs = Plugins()
    plugs.add(alignflow.plugins.bnf, "alignflow.plugins.bnf")
    spec = parse_spec({"name": "p", "stages": {"pref": {
        "kind": "preference", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": "bnf",
        "settings": SETTINGS}}}, plugins=plugs)
    stage = spec.stages["pref"]
    logged = []
    work = tmp_path / "work"
    work.mkdir(parents=True)
    ctx = StageContext("pref", stage, TrainSettings.model_validate(stage.settings),
                       {k: Path(v) for k, v in inputs.items()}, work, tmp_path / "checkpoints", 0,
                       lambda metrics, step: logged.append((step, metrics)), plugs)
    return ctx, logged


@torch.no_grad()
def mean_margin(model, files) -> float:
    """Mean over the 16 training pairs of log pi(y_w|x) - log pi(y_l|x), summed over completion tokens."""
    rows, pad_id = pair_rows(files, 16)
    score = SequenceScorer(model, collate(rows.to_list(), pad_id), "completion", CPU)
    return (score("chosen", "completion").logps - score("rejected", "completion").logps).mean().item()


def test_bnf_stage_scores_the_reference_once_and_widens_the_margin(tmp_path, files, one_thread):
    inputs = {"model": files["model"], "dataset": files["pairs"], "eval_dataset": files["eval_pairs"]}
    with ReferenceForwards() as ref:
        ctx, logged = context(tmp_path, inputs)
        result = run_preference(ctx)
    # chosen and rejected of 16 + 4 pairs, 2 per micro-batch, per-token terms included: never again per step
    assert ref.count == 2 * (16 + 4) // 2
    cache = torch.load(ctx.checkpoint_dir / REFERENCE_CACHE)
    assert cache["train"][TOKENS.format("chosen")].numel() > 16

    first = next(m for s, m in logged if s == 1 and "loss" in m)
    last = next(m for s, m in logged if s == 4 and "loss" in m)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # policy = reference
    assert last["rewards/margins"] > 0.1  # after 3 updates: chosen up relative to rejected
    trained = load_model(result.outputs["model"])
    before, after = mean_margin(load_model(files["model"]), files), mean_margin(trained, files)
    assert after > before + 1.0
    assert "eval/rewards/margins" in result.metrics
