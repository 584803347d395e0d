"""The rl stage with a teacher: on-policy distillation on the tiny model, end to end."""

import json
import math

import pytest
import torch

from alignflow.core import SpecError, hookimpl
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec, parse_spec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.plugins.distill import Distill
from helpers.plugins import registered

SEEN = []  # (old_logprobs, teacher_logprobs, advantages, response_mask) of every micro-batch the loss got


class SpyDistill(Distill):
    def loss(self, batch):
        SEEN.append((batch.old_logprobs, batch.teacher_logprobs, batch.advantages, batch.response_mask))
        return super().loss(batch)


class TestAlgorithms:  # a test-only name: the built-in `distill` is registered by its entry point
    @staticmethod
    @hookimpl
    def register_algorithms(register):
        register("distill_under_test", SpyDistill)


@pytest.fixture(scope="module")
def plugins():
    with registered(TestAlgorithms, "test_rl_distill") as p:
        yield p


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


PROMPTS = [f"{i}+{i}=" for i in range(4)]


def prefer(model_dir, chars, steps, out):
    """`model_dir` after `steps` Adam steps towards putting the first answer token among `chars`."""
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir)
    ids = torch.tensor(tokenizer(PROMPTS).input_ids)
    wanted = torch.tensor(tokenizer.convert_tokens_to_ids(list(chars)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = -model(ids).logits[:, -1].log_softmax(-1)[:, wanted].logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def student(tiny, tmp_path_factory):
    return prefer(tiny, "0123456789", 10, tmp_path_factory.mktemp("student"))  # P(a digit) ~ 0.999


@pytest.fixture(scope="module")
def teacher(student, tmp_path_factory):
    """The student refined further, as a GRPO model is from its cold start: P(0-4) ~ 0.999."""
    return prefer(student, "01234", 5, tmp_path_factory.mktemp("teacher"))


def first_token_kl(student_dir, teacher_dir) -> float:
    """Exact KL(student || teacher) of the first answer token, averaged over the prompts."""
    ids = torch.tensor(load_tokenizer(student_dir)(PROMPTS).input_ids)
    with torch.no_grad():
        p, q = (load_model(d)(ids).logits[:, -1].log_softmax(-1) for d in (student_dir, teacher_dir))
    return (p.exp() * (p - q)).sum(-1).mean().item()


def make_ctx(tmp_path, plugins, student, teacher, config=None, **settings):
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    base = dict(max_steps=2, prompts_per_step=4, group_size=4, micro_batch_size=16, lr=1e-3,
                generation={"max_new_tokens": 6}, save_every=100)
    spec = StageSpec(kind="rl", inputs={"model": str(student), "dataset": str(data), "teacher": str(teacher)},
                     algorithm={"name": "distill_under_test", "config": config or {}}, rewards=["math_accuracy"],
                     sampler="hf")
    (tmp_path / "work").mkdir(parents=True, exist_ok=True)
    log = []
    ctx = StageContext("distill", spec, RLSettings(**{**base, **settings}),
                       {"model": student, "dataset": data, "teacher": teacher}, tmp_path / "work",
                       tmp_path / "checkpoints", 0, lambda m, step: log.append((step, m)), plugins)
    return ctx, log


def test_the_teachers_logprobs_reach_the_loss_and_the_kl_to_it_falls(tmp_path, plugins, student, teacher,
                                                                      one_thread):
    SEEN.clear()
    ctx, log = make_ctx(tmp_path, plugins, student, teacher, max_steps=4, lr=1e-2, generation={"max_new_tokens": 1})
    result = run_rl(ctx)
    assert [step for step, _ in log[:-1]] == [1, 2, 3, 4]
    old, teacher_logprobs, advantages, mask = SEEN[0]
    assert teacher_logprobs is not None and mask.sum() == 16
    # the loss weighs each sampled token by log pi_teacher - log pi_old, the teacher's own log-probs
    torch.testing.assert_close(advantages, (teacher_logprobs - old) * mask)
    assert (teacher_logprobs - old)[mask.bool()].abs().min() > 0  # another model: every token is graded
    assert torch.equal(teacher_logprobs * (1 - mask), torch.zeros_like(old))  # nothing off the response
    kl = [m["distill/reverse_kl"] for _, m in log[:-1]]
    assert kl[0] > 2 and kl[-1] < 0.2 * kl[0], kl  # the sampled KL(student || teacher): 5.8 -> 0.01 measured
    before, after = first_token_kl(student, teacher), first_token_kl(result.outputs["model"], teacher)
    assert after < 0.2 * before, (before, after)  # 4.6 -> 0.02 measured


def test_a_teacher_equal_to_the_student_grades_nothing(tmp_path, plugins, tiny, one_thread):
    ctx, log = make_ctx(tmp_path, plugins, tiny, tiny, max_steps=1)
    run_rl(ctx)
    metrics = log[0][1]
    # the sampler's log-probs and the teacher's forward agree to float precision
    assert abs(metrics["distill/reverse_kl"]) < 1e-5
    assert max(abs(metrics["advantages/min"]), abs(metrics["advantages/max"])) < 1e-4


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, plugins, tiny):
    other = tmp_path / "other"
    load_model(tiny).save_pretrained(other)
    tokenizer = load_tokenizer(tiny)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    ctx, _ = make_ctx(tmp_path, plugins, tiny, other)
    with pytest.raises(SpecError, match=r"stage 'distill', inputs.teacher: the teacher's vocabulary \(265 tokens\) "
                                        r"is not the student's \(264;.*<tool>"):
        run_rl(ctx)


def test_the_spec_wants_a_teacher_exactly_for_algorithms_that_learn_from_one(plugins):
    def rl(algorithm, **inputs):
        return {"kind": "rl", "inputs": {"model": "m", "dataset": "d.jsonl", **inputs}, "algorithm": algorithm,
                "rewards": ["math_accuracy"]}

    with pytest.raises(SpecError, match="stage 'student', inputs.teacher: algorithm 'distill_under_test' learns "
                                        "from a teacher; give its model path or `stage:NAME`"):
        parse_spec({"name": "p", "stages": {"student": rl("distill_under_test")}}, plugins=plugins)
    with pytest.raises(SpecError, match="stage 'student', inputs.teacher: algorithm 'grpo' uses no teacher"):
        parse_spec({"name": "p", "stages": {"student": rl("grpo", teacher="t")}}, plugins=plugins)
    stages = {"rl": rl("grpo"), "student": rl("distill_under_test", teacher="stage:rl")}
    parsed = parse_spec({"name": "p", "stages": stages}, plugins=plugins)
    assert parsed.stages["student"].references() == {"teacher": "rl"} and parsed.order()[-1] == "student"


FORMS = [{"form": "full", "divergence": "jsd"}, {"form": "full", "divergence": "forward_kl"},
         {"form": "full", "divergence": "reverse_kl"},
         {"form": "top_k", "divergence": "jsd", "top_k": 4, "top_k_tail": "bucket"},
         {"form": "top_k", "divergence": "forward_kl", "top_k": 4, "top_k_tail": "drop"}]


@pytest.mark.parametrize("config", FORMS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_the_teacher_distribution_forms_train_the_student_towards_the_teacher(tmp_path, plugins, student, teacher,
                                                                              config, one_thread):
    SEEN.clear()
    ctx, log = make_ctx(tmp_path, plugins, student, teacher, config, max_steps=4, lr=1e-2,
                        generation={"max_new_tokens": 1})
    result = run_rl(ctx)
    assert not SEEN  # the divergence replaces the sampled-token surrogate
    div = [m[f"distill/{config['form']}_{config['divergence']}"] for _, m in log[:-1]]
    assert div[0] > 0.1 and div[-1] < 0.2 * div[0], div  # e.g. jsd 0.32 -> 0.0008, reverse_kl 5.8 -> 0.07
    before, after = first_token_kl(student, teacher), first_token_kl(result.outputs["model"], teacher)
    assert after < 0.2 * before, (before, after)  # 4.6 -> 0.01 to 0.04 measured


def test_the_teacher_runs_per_micro_batch_without_a_gradient(tmp_path, plugins, student, teacher, one_thread,
                                                              monkeypatch):
    from alignflow.flows.stages.rl import distribution

    calls = []  # (rows, gradient enabled, logits require a gradient) of every logits forward of the micro-steps

    def spy(model, ids, *args):
        out = response_logits(model, ids, *args)
        calls.append((ids.shape[0], torch.is_grad_enabled(), out.requires_grad))
        return out

    response_logits = distribution.response_logits
    monkeypatch.setattr(distribution, "response_logits", spy)
    ctx, log = make_ctx(tmp_path, plugins, student, teacher, {"form": "top_k", "top_k": 3}, max_steps=1,
                        micro_batch_size=4, generation={"max_new_tokens": 2})
    run_rl(ctx)
    # 16 rows in micro-batches of 4, each a student forward (with a gradient) then a teacher forward (none)
    assert calls == [(4, True, True), (4, False, False)] * 4
    assert 0 < log[0][1]["distill/top_k_jsd"] < math.log(2)  # JSD(0.5) is at most ln 2
