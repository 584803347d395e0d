"""The preference stage: losses start where the formulas say (policy = reference), the reference is scored
once and cached across a resume, a resumed run ends with the uninterrupted weights, a third-party
algorithm runs through the same loop."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import alignflow.plugins.dpo
import alignflow.plugins.kto
import alignflow.plugins.larpo
import alignflow.plugins.orpo
from alignflow.core.train.batching import collate
from alignflow.core.train.datasets import load_rows, tokenize
from alignflow.core.train.models import load_model, load_tokenizer, token_logprobs
from alignflow.core.plugins import Plugins
from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.preference import REFERENCE_CACHE, SequenceScorer, run_preference
from recording import ReferenceForwards

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "alignflow-plugin-example"
SETTINGS = {"lr": 1e-3, "max_steps": 4, "batch_size": 4, "micro_batch_size": 2, "max_length": 64,
            "save_every": 2, "log_every": 1, "lr_scheduler": "linear"}


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model):
    """A tiny model and small slices of the task's pairwise and unpaired data."""
    root = tmp_path_factory.mktemp("pref")
    data = write_datasets(root / "data")
    out = {"model": tiny_model()}
    for name, src, n in [("pairs", "pairs", 16), ("eval_pairs", "pairs", 4), ("unpaired", "unpaired", 8)]:
        lines = data[src].read_text().splitlines()
        lines = lines[-n:] if name == "eval_pairs" else lines[:n]
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("\n".join(lines) + "\n")
    return out


class Interrupted(Exception):
    pass


def plugins(*modules) -> Plugins:
    p = Plugins()
    for module in modules:
        p.add(module, module.__name__)
    return p


def context(tmp_path, plugs, algorithm, inputs, fail_at_step=None, **settings) -> tuple[StageContext, list]:
    """A stage context whose metric logger records (step, metrics) and can crash after a given step."""
    spec = parse_spec({"name": "p", "stages": {"pref": {
        "kind": "preference", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": algorithm,
        "settings": {**SETTINGS, **settings}}}}, plugins=plugs)
    stage = spec.stages["pref"]
    logged = []

    def log(metrics, step):
        logged.append((step, metrics))
        if step == fail_at_step:
            raise Interrupted  # after this step's update, before its checkpoint

    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    ctx = StageContext("pref", stage, TrainSettings.model_validate(stage.settings),
                       {k: Path(v) for k, v in inputs.items()}, work, tmp_path / "checkpoints", 0, log, plugs)
    return ctx, logged


def step_metrics(logged, step):
    return next(m for s, m in logged if s == step and "loss" in m)


def weights(result) -> dict[str, torch.Tensor]:
    return load_file(result.outputs["model"] / "model.safetensors")


def test_dpo_starts_at_log2_scores_the_reference_once_and_resumes_to_the_same_weights(tmp_path, files):
    plugs = plugins(alignflow.plugins.dpo)
    inputs = {"model": files["model"], "dataset": files["pairs"], "eval_dataset": files["eval_pairs"]}
    with ReferenceForwards() as ref:
        ctx, logged = context(tmp_path / "a", plugs, "dpo", inputs)
        full = run_preference(ctx)
    # chosen and rejected of 16 training and 4 held-out pairs, 2 per micro-batch: never again per step
    assert ref.count == 2 * (16 + 4) // 2
    first = step_metrics(logged, 1)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference: margin 0
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert step_metrics(logged, 4)["loss"] < math.log(2)  # it learns the training pairs
    assert 0.0 <= full.metrics["eval/rewards/accuracies"] <= 1.0 and full.headline == "eval/rewards/accuracies"

    ctx, _ = context(tmp_path / "b", plugs, "dpo", inputs, fail_at_step=3)
    with pytest.raises(Interrupted):
        run_preference(ctx)
    assert (ctx.checkpoint_dir / REFERENCE_CACHE).is_file()
    with ReferenceForwards() as ref:
        ctx, logged = context(tmp_path / "b", plugs, "dpo", inputs)
        resumed = run_preference(ctx)
    assert ref.count == 0  # read back from the checkpoint folder
    assert [s for s, m in logged if "loss" in m] == [3, 4]  # resumed after the step-2 checkpoint
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.metrics == pytest.approx(full.metrics)


def test_kto_scores_mismatched_pairs_per_micro_batch(tmp_path, files):
    plugs = plugins(alignflow.plugins.kto)
    with ReferenceForwards() as ref:
        ctx, logged = context(tmp_path, plugs, "kto", {"model": files["model"], "dataset": files["unpaired"]},
                              max_steps=2)
        result = run_preference(ctx)
    # 8 completions cached in 4 micro-batches, then one live "kl" pass per training micro-batch (2 x 2)
    assert ref.count == 8 // 2 + 2 * 2
    # policy = reference: every log-ratio and z_ref are 0, so each example loses 1 - sigmoid(0)
    assert step_metrics(logged, 1)["loss"] == pytest.approx(0.5, abs=1e-5)
    assert result.headline == "train/loss"


def test_scorer_runs_each_sequence_set_once_for_both_scopes(files):
    tok = load_tokenizer(files["model"])
    model = load_model(files["model"])
    rows, _ = tokenize(load_rows(files["pairs"], "pairwise").select(range(3)), tok, 64, "pairwise")
    micro = collate(rows.to_list(), tok.pad_token_id)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    score = SequenceScorer(model, micro, "sequence", torch.device("cpu"))
    completion, sequence = score("chosen", "completion"), score("chosen", "sequence")
    handle.remove()
    assert len(calls) == 1
    ids, attn = micro["chosen_input_ids"], micro["chosen_attention_mask"]
    full = token_logprobs(model, ids, attn)  # every real token after the first
    labelled = micro["chosen_labels"] != -100
    assert completion.logps.tolist() == pytest.approx((full * labelled).sum(-1).tolist(), abs=1e-5)
    assert completion.lengths.tolist() == labelled.sum(-1).tolist()
    assert sequence.logps.tolist() == pytest.approx(full.sum(-1).tolist(), abs=1e-5)
    assert sequence.lengths.tolist() == (attn.sum(-1) - 1).tolist()


def test_orpo_needs_no_reference_and_counts_sequence_tokens(tmp_path, files):
    with ReferenceForwards() as ref:
        ctx, logged = context(tmp_path, plugins(alignflow.plugins.orpo), "orpo",
                              {"model": files["model"], "dataset": files["pairs"]}, max_steps=1, micro_batch_size=4)
        run_preference(ctx)
    assert ref.count == 0
    first = step_metrics(logged, 1)
    # one micro-batch: the step loss is the NLL over the step's prompt+completion tokens (the norm counts
    # exactly the tokens the NLL sums) plus the odds-ratio loss
    assert first["loss"] == pytest.approx(first["nll_loss"] + first["or_loss"], rel=1e-4)


def test_larpo_lambdarank_trains_on_pairs_from_its_one_pair_weight(tmp_path, files):
    inputs = {"model": files["model"], "dataset": files["pairs"], "eval_dataset": files["eval_pairs"]}
    ctx, logged = context(tmp_path, plugins(alignflow.plugins.larpo), {"name": "larpo", "config": {
        "loss": "lambdarank", "beta": 0.5}}, inputs)
    result = run_preference(ctx)
    # policy = reference: s = 0, so a pair loses lambda_12 * log 2 with lambda_12 = 1 - 1/log2(3)
    start = (1 - 1 / math.log2(3)) * math.log(2)
    assert step_metrics(logged, 1)["loss"] == pytest.approx(start, abs=1e-5)
    assert step_metrics(logged, 4)["loss"] < start  # it learns the training pairs
    assert 0.0 <= result.metrics["eval/rewards/accuracies"] <= 1.0
    assert (result.outputs["model"] / "model.safetensors").is_file()


def ranked(path, pairs_file, m: int = 3, n: int = 4):
    """Lists of m from n pairs: each row's chosen, its rejected, and the next rows' rejected ones."""
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()[:n]]
    lists = [{"prompt": r["prompt"], "completions": [r["chosen"]] + [rows[(i + k) % len(rows)]["rejected"]
                                                                    for k in range(m - 1)],
              "scores": [1.0] + [0.0] * (m - 1)} for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lists))
    return path


def test_larpo_listmle_trains_on_ranked_lists_of_three(tmp_path, files):
    inputs = {"model": files["model"], "dataset": ranked(tmp_path / "lists.jsonl", files["pairs"]),
              "eval_dataset": ranked(tmp_path / "eval_lists.jsonl", files["eval_pairs"])}
    ctx, logged = context(tmp_path, plugins(alignflow.plugins.larpo), {"name": "larpo", "config": {
        "loss": "listmle", "beta": 0.5}}, inputs)
    result = run_preference(ctx)
    # policy = reference: every s = 0, so ListMLE = log 3 + log 2 + log 1 per list
    assert step_metrics(logged, 1)["loss"] == pytest.approx(math.log(6), abs=1e-5)
    assert step_metrics(logged, 4)["loss"] < 0.5 * math.log(6)  # the same 4 lists each step: it learns them
    cache = torch.load(tmp_path / "checkpoints" / REFERENCE_CACHE)
    assert sorted(cache["train"]) == ["candidate0", "candidate1", "candidate2"]
    assert len(cache["eval"]["candidate2"]) == 4
    assert 0.0 <= result.metrics["eval/rewards/accuracies"] <= 1.0


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(EXAMPLE)], check=True)
    return target


@pytest.mark.system
def test_a_third_party_algorithm_runs_through_the_same_loop(tmp_path, files, example_site, monkeypatch):
    monkeypatch.syspath_prepend(str(example_site))
    import alignflow_plugin_example.plugin as example

    ctx, logged = context(tmp_path, plugins(example), {"name": "hinge", "config": {"delta": 0.5}},
                          {"model": files["model"], "dataset": files["pairs"]}, max_steps=2)
    result = run_preference(ctx)
    assert step_metrics(logged, 1)["loss"] == pytest.approx(0.5, abs=1e-5)  # max(0, delta - 0)
    assert (result.outputs["model"] / "model.safetensors").is_file()
