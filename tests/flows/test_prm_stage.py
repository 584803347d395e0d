"""Process reward models: the step labels by rollouts, the prm stage, the prm reward, best-of-n."""

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import alignflow.plugins.math_shepherd
import alignflow.plugins.pqm
from alignflow.core import Sampler, hookimpl
from alignflow.core.train.datasets import IGNORE_INDEX
from alignflow.core.train.models import load_value_model, token_values
from alignflow.core.plugins import Plugins
from alignflow.core.rewards import RewardOutput
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import PRMSettings, StepLabelSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.flows.launch.ranks import run_in_processes
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.evaluate import best_of_n, grouped_selection
from alignflow.flows.stages.prm import run_prm, step_major
from alignflow.flows.stages.scoring import Scored
from alignflow.flows.stages.step_labels import prefix, run_step_labels
from alignflow.plugins.prm import ProcessReward


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def context(tmp_path, name, kind_settings, stage, inputs, plugs, seed=0):
    (tmp_path / name).mkdir()
    return StageContext(name, stage, kind_settings.model_validate(stage.settings), inputs, tmp_path / name,
                        tmp_path / f"{name}-ckpt", seed, lambda m, s: None, plugs)


def test_step_major_reads_each_step_end_in_order():
    values = torch.arange(12.0).reshape(2, 6)
    labels = torch.full((2, 6), float(IGNORE_INDEX))
    labels[0, 1], labels[0, 4], labels[1, 5] = 1.0, 0.0, 0.5
    b = step_major(values, labels)
    assert torch.where(b.mask, b.scores, 0.0).tolist() == [[1.0, 4.0], [11.0, 0.0]]  # row 1: one step
    assert b.labels.tolist() == [[1.0, 0.0], [0.5, 0.0]]
    assert b.mask.tolist() == [[True, True], [True, False]]


def test_prefix_joins_steps_with_their_separators():
    assert prefix(["a", "b", "c"], 1, " ") == "a b "
    assert prefix(["a"], 0, "\n") == "a\n"


# --- step labels by rollouts ------------------------------------------------------------------

def starts_even(prompts, completions, **_):
    """1 when a completion's first character has an even code: the tests can recount it."""
    return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


def ends_even(prompts, completions, **_):
    """1 when a completion's last character has an even code: decided by the rollout, not the prefix."""
    return [float(bool(c) and ord(c[-1]) % 2 == 0) for c in completions]


class Scripted(Sampler):
    """Solutions of 1-3 steps drawn from a few words, joined by "1": seeded, and sure to have steps."""

    WORDS = ["ab", "ba", "cd", "dc", "xy"]

    def load(self, model, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, n, gen, seed):
        if "CALLS_FILE" in os.environ:  # which rank sampled how many prompts (children inherit it)
            with open(os.environ["CALLS_FILE"], "a") as f:
                f.write(f"{os.environ.get('RANK', '0')} {len(prompt_ids)}\n")
        rng = random.Random(seed)
        texts = ["1".join(rng.choice(self.WORDS) for _ in range(rng.randint(1, 3)))
                 for _ in range(len(prompt_ids) * n)]
        ids = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        return Generation([i for i in range(len(prompt_ids)) for _ in range(n)], ids, texts, [False] * len(texts))


class Plugs:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("starts_even", starts_even)
        register("ends_even", ends_even)

    @staticmethod
    @hookimpl
    def register_samplers(register):
        register("scripted", Scripted)


def label_stage(tmp_path, model, reward, label, name="labels", prompts=4, ranks=None):
    """Run a step_labels stage here, or in `ranks` data-parallel children."""
    plugs = Plugins()
    plugs.add(Plugs, "plugs")
    data = write(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(prompts)])
    inputs = {"model": model, "dataset": data}
    spec = parse_spec({"name": "sl", "stages": {"sl": {
        "kind": "step_labels", "inputs": {k: str(v) for k, v in inputs.items()}, "rewards": [reward],
        "sampler": "scripted", "settings": {"n": 3, "rollouts": 4, "label": label, "step_separator": "1"}}}},
        plugins=plugs)
    ctx = context(tmp_path, name, StepLabelSettings, spec.stages["sl"], inputs, plugs, seed=5)
    return run_step_labels(ctx) if ranks is None else run_in_processes("step_labels", ctx, threads=1, ranks=ranks)


def rows_of(result) -> list[dict]:
    return [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]


def even(char: str) -> float:
    return float(ord(char) % 2 == 0)


@pytest.mark.parametrize("label", ["hard", "soft"])
def test_a_step_is_labelled_by_its_rollouts_and_the_last_step_by_the_outcome(tmp_path, label, tiny_model):
    # starts_even judges a completion of a prefix by the prefix's first character, so every rollout of a
    # prefix agrees and the labels are exactly knowable: the parity of the first step's first character.
    result = label_stage(tmp_path, tiny_model(seed=1), "starts_even", label)
    rows = rows_of(result)
    assert rows and any(len(r["steps"]) > 1 for r in rows)
    for r in rows:
        assert r["correct"] == bool(even(r["completion"][0]))
        assert r["step_labels"] == [even(r["steps"][0][0])] * (len(r["steps"]) - 1) + [int(r["correct"])]
    assert result.metrics["solutions"] == len(rows)
    assert len({(r["prompt"], r["completion"]) for r in rows}) == len(rows)  # distinct solutions only


def test_soft_labels_are_shares_of_rollouts_hard_labels_are_any_and_both_are_seeded(tmp_path, tiny_model):
    soft = label_stage(tmp_path, tiny_model(seed=1), "ends_even", "soft", "soft")
    shares = {v * 4 for r in rows_of(soft) for v in r["step_labels"][:-1]}
    assert shares <= {0, 1, 2, 3, 4} and len(shares) > 2  # a share of 4 rollouts, not always 0 or 1
    assert label_stage(tmp_path, tiny_model(seed=1), "ends_even", "soft", "again").outputs["dataset"].read_text() == \
        soft.outputs["dataset"].read_text()
    hard = rows_of(label_stage(tmp_path, tiny_model(seed=1), "ends_even", "hard", "hard"))
    assert [r["completion"] for r in hard] == [r["completion"] for r in rows_of(soft)]  # the same solutions
    assert {v for r in hard for v in r["step_labels"]} == {0, 1}
    for r in hard:  # a correct solution is itself a correct completion of each of its prefixes
        assert not r["correct"] or r["step_labels"] == [1] * len(r["steps"])


@pytest.mark.system
def test_two_ranks_label_what_one_process_does(tmp_path, monkeypatch, tiny_model):
    """100 prompts: two chunks of solutions and several of prefixes to roll out, shared by two ranks that
    each judge their own rollouts; rank 0 writes the rows one process writes, byte for byte."""
    one = label_stage(tmp_path, tiny_model(seed=1), "ends_even", "soft", "one", prompts=100, ranks=1)
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    two = label_stage(tmp_path, tiny_model(seed=1), "ends_even", "soft", "two", prompts=100, ranks=2)
    calls = [line.split() for line in (tmp_path / "calls").read_text().splitlines()]
    assert ["1", "36"] in calls  # rank 1 sampled the second chunk of solutions, prompts 64-99
    assert {rank for rank, _ in calls} == {"0", "1"} and sum(rank == "1" for rank, _ in calls) > 1
    assert one.metrics == two.metrics and one.metrics["rollouts"] > 4 * 64 * 2
    assert two.outputs["dataset"].read_bytes() == one.outputs["dataset"].read_bytes()


# --- the prm stage and the prm reward ---------------------------------------------------------

def step_rows(n: int, offset: int) -> list[dict]:
    """Solutions whose steps say their own label: a step ending in 'y' is correct, in 'n' wrong."""
    return [{"prompt": f"{a}=", "steps": ["ay", "by" if a % 2 else "bn"], "step_labels": [1, a % 2]}
            for a in range(offset, offset + n)]


@pytest.mark.parametrize("algorithm", ["math_shepherd", "pqm"])
def test_prm_stage_learns_step_labels_and_the_reward_scores_what_it_trained_on(tmp_path, algorithm, tiny_model):
    plugs = Plugins()
    plugs.add(alignflow.plugins.math_shepherd, "math_shepherd")
    plugs.add(alignflow.plugins.pqm, "pqm")
    held_out = step_rows(8, 100)
    inputs = {"model": tiny_model(), "dataset": write(tmp_path / "t.jsonl", step_rows(32, 0)),
              "eval_dataset": write(tmp_path / "e.jsonl", held_out)}
    spec = parse_spec({"name": "prm", "stages": {"prm": {
        "kind": "prm", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": algorithm,
        "settings": {"lr": 3e-3, "max_steps": 12, "batch_size": 8, "micro_batch_size": 4, "max_length": 32,
                     "lr_scheduler": "constant", "step_separator": " "}}}}, plugins=plugs)
    result = run_prm(context(tmp_path, "work", PRMSettings, spec.stages["prm"], inputs, plugs))
    assert result.metrics["eval/accuracy"] == 1.0 and result.headline == "eval/accuracy"

    path = str(result.outputs["model"])
    reward = ProcessReward(ProcessReward.Config(path=path))
    assert reward.separator == " "  # from the checkpoint's config
    prompts = [r["prompt"] for r in held_out]
    completions = [" ".join(r["steps"]) for r in held_out]
    scores = reward.step_scores(prompts, completions)
    assert [[p > 0.5 for p in s] for s in scores] == [[bool(v) for v in r["step_labels"]] for r in held_out]

    # the same numbers as the value head on the text the stage tokenised: "4=" "ay " "bn "
    tok, model = build_char_tokenizer(), load_value_model(path)
    ids = torch.tensor([tok("4=ay bn ").input_ids])
    values = torch.sigmoid(token_values(model, ids, torch.ones_like(ids)))[0]
    ends = [len(tok("4=ay ").input_ids) - 1, len(tok("4=ay bn ").input_ids) - 1]
    assert reward.step_scores(["4="], ["ay bn"])[0] == pytest.approx(values[ends].tolist(), abs=1e-6)

    p = scores[0]
    for aggregation, expected in [("min", min(p)), ("prod", p[0] * p[1]), ("last", p[1]), ("mean", sum(p) / 2)]:
        r = ProcessReward(ProcessReward.Config(path=path, aggregation=aggregation))
        assert r(prompts[:1], completions[:1])[0] == pytest.approx(expected, rel=1e-6)
    assert reward(["4="], ["  "]) == [0.0]  # no step: nothing is right
    # the same batch again (process-supervised RL: the reward, then the steps) is not scored twice
    first = reward.step_scores(prompts, completions)
    assert reward.step_scores(list(prompts), list(completions)) is first
    assert reward.step_scores(prompts[:1], completions[:1])[0] == pytest.approx(first[0], abs=1e-6)  # rescored
    # for process supervision: each step's score with where the step ends in the completion
    assert reward.step_rewards(["4="], ["ay bn"]) == [list(zip([2, 5], reward.step_scores(["4="], ["ay bn"])[0]))]
    # cut from the left: the prompt and the first step's end fall off, the second step is still scored
    short = ProcessReward(ProcessReward.Config(path=path, max_length=8))
    assert len(short.step_scores(["100="], ["ay bbbbbbn"])[0]) == 1
    assert len(reward.step_scores(["100="], ["ay bbbbbbn"])[0]) == 2


def test_prm_stage_under_zero3_takes_the_zero0_steps(tmp_path, sgd_two_micro_batches, tiny_model):
    """Two micro-batches a step (SGD, so weights move by exactly lr x the gradient): ZeRO-3 = ZeRO-0."""
    plugs = Plugins()
    plugs.add(alignflow.plugins.math_shepherd, "math_shepherd")
    inputs = {"model": tiny_model(), "dataset": write(tmp_path / "t.jsonl", step_rows(16, 0))}
    out = {}
    for zero in (0, 3):
        spec = parse_spec({"name": "prm", "stages": {"prm": {
            "kind": "prm", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": "math_shepherd",
            "settings": {**sgd_two_micro_batches, "max_length": 32, "step_separator": " ", "zero_stage": zero}}}},
            plugins=plugs)
        (tmp_path / f"zero{zero}").mkdir()  # the engine keeps its checkpoints beside checkpoint_dir
        result = run_prm(context(tmp_path / f"zero{zero}", "work", PRMSettings, spec.stages["prm"], inputs, plugs))
        out[zero] = load_file(result.outputs["model"] / "model.safetensors")
    assert load_value_model(result.outputs["model"]).config.step_separator == " "
    for k in out[0]:
        torch.testing.assert_close(out[3][k], out[0][k], rtol=1e-4, atol=1e-6)


def test_the_reward_refuses_a_model_without_a_step_separator(tiny_model):
    with pytest.raises(ValueError, match="no step_separator"):
        ProcessReward(ProcessReward.Config(path=str(tiny_model())))


# --- best-of-n --------------------------------------------------------------------------------

def test_best_of_n_keeps_each_prompts_top_scored_completion():
    # p0: the verifier's favourite is correct; p1: it picks a wrong one; p2: a tie and a None
    values = [0.9, 0.1, 0.2, 0.8, 0.5, 0.5, None]
    generation = Generation([0, 0, 1, 1, 2, 2, 2], [[0]] * 7, list("abcdefg"), [False] * 7)
    scored = Scored([{"prompt": f"p{i}"} for i in range(3)], 0, generation,
                    RewardOutput([0.0] * 7, {"rm": values}), [True, False, True, False, True, False, True])
    assert best_of_n(scored, "rm") == pytest.approx(2 / 3)  # a, d (wrong), e (first of the tie)


def test_best_of_n_pass_at_n_per_task_count_each_tasks_prompts():
    # p0, p1: task a; p2: task b. rm picks a (right), d (wrong), e (right); the oracle finds one in each
    values = [0.9, 0.1, 0.2, 0.8, 0.5, 0.1]
    generation = Generation([0, 0, 1, 1, 2, 2], [[0]] * 6, list("abcdef"), [False] * 6)
    rows = [{"prompt": "p0", "task": "a"}, {"prompt": "p1", "task": "a"}, {"prompt": "p2", "task": "b"}]
    scored = Scored(rows, 2, generation, RewardOutput([0.0] * 6, {"rm": values}),
                    [True, False, True, False, True, False])
    assert grouped_selection(scored, "task", ["rm"]) == {
        "pass_at_2/task_a": 1.0, "best_of_2/rm/task_a": 0.5, "pass_at_2/task_b": 1.0, "best_of_2/rm/task_b": 1.0}
    scored.correct = [False, False, True, False, True, False]
    assert grouped_selection(scored, "task", [])["pass_at_2/task_a"] == 0.5
