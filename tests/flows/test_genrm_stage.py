"""GenRM end to end on the tiny model: genrm_examples rows, the sft stage, the genrm reward on held-out samples."""

import json
import random

import pytest

from alignflow.core.spec.settings import PolicySettings
from alignflow.core.task.arithmetic import draw
from alignflow.flows.stages.sft import run_sft
from alignflow.plugins.genrm import GenerativeVerifier
from alignflow.plugins.genrm_examples import GenRMExamples
from helpers.stages import stage_context


def samples(n: int, seed: str) -> list[dict]:
    """Labelled samples, half right (the worked solution) and half wrong (the answer alone, one too high): a sign a
    tiny model learns in a few steps, so a failure here is the plumbing (row text, verdict position), not skill."""
    rows = []
    for i, p in enumerate(draw(n, random.Random(seed))):
        right = i % 2 == 0
        completion = p.completion() if right else f"<think></think><answer>{int(p.answer) + 1}</answer>"
        rows.append({"prompt": p.prompt, "completion": completion, "correct": right})
    return rows


@pytest.mark.stage
def test_a_trained_direct_verifier_ranks_held_out_right_answers_above_wrong_ones(tmp_path):
    train = GenRMExamples(GenRMExamples.Config(rationale="none"))(samples(192, "train"), random.Random(0))
    assert [r["completion"] for r in train[:2]] == [" Yes", " No"]
    data = tmp_path / "genrm.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train))
    spec = {"name": "g", "stages": {"genrm": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": str(data)}, "algorithm": "sft",
        "settings": {"lr": 3e-3, "max_steps": 40, "batch_size": 32, "micro_batch_size": 32, "max_length": 96,
                     "save_every": 100, "lr_scheduler": "constant"}}}}
    result = run_sft(stage_context(tmp_path, spec, settings_model=PolicySettings))
    verifier = GenerativeVerifier(GenerativeVerifier.Config(path=str(result.outputs["model"]), batch_size=64,
                                                            device="cpu"))
    held_out = samples(64, "held-out")  # prompts drawn apart from the training ones
    scores = verifier([r["prompt"] for r in held_out], [r["completion"] for r in held_out])
    right = [s for s, r in zip(scores, held_out) if r["correct"]]
    wrong = [s for s, r in zip(scores, held_out) if not r["correct"]]
    auc = sum((a > b) + 0.5 * (a == b) for a in right for b in wrong) / (len(right) * len(wrong))
    assert auc > 0.9, (auc, right[:4], wrong[:4])  # chance: 0.5
    assert sum(right) / len(right) > 0.5 > sum(wrong) / len(wrong)
