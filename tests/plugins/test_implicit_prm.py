"""Implicit PRM: the cross-entropy loss, the step rewards, the reference its stage recorded, an rl stage."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

import alignflow.plugins.implicit_prm as implicit
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.models import load_model
from alignflow.core.train.offline import PairBatch
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.dpo import DPO
from alignflow.plugins.implicit_prm import ImplicitPRM, ImplicitProcessReward, trained_with


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def pairs(requires_grad=False):
    """Two pairs; summed log-ratios to the reference: chosen [1.0, -0.5], rejected [-0.5, 0.5]."""
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)  # noqa: E731
    return PairBatch(
        policy_chosen_logps=t([-1.0, -4.0]), policy_rejected_logps=t([-3.0, -2.0]),
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([5, 2]),
        ref_chosen_logps=torch.tensor([-2.0, -3.5], dtype=torch.float64),
        ref_rejected_logps=torch.tensor([-2.5, -2.5], dtype=torch.float64),
    )


# --- the algorithm ------------------------------------------------------------------------------

def test_flags_and_the_papers_beta():
    assert ImplicitPRM.stage == "preference" and ImplicitPRM.requires_reference and ImplicitPRM.requires_pairs
    assert not ImplicitPRM.requires_labels and ImplicitPRM().nll_scope is None
    assert ImplicitPRM().config.beta == 0.05  # run_ce.sh
    with pytest.raises(ValidationError):
        ImplicitPRM.Config(beta=0.0)
    with pytest.raises(ValidationError):
        ImplicitPRM.Config(betta=0.05)


def test_loss_is_cross_entropy_on_each_response_label():
    loss, metrics = ImplicitPRM(ImplicitPRM.Config(beta=2.0)).loss(pairs())
    # r = 2 * log-ratio: chosen [2, -1] (label 1), rejected [-1, 1] (label 0)
    # pair 0: (-log sigma(2) - log(1 - sigma(-1))) / 2 = (0.126928 + 0.313262) / 2 = 0.220095
    # pair 1: (-log sigma(-1) - log(1 - sigma(1))) / 2 = (1.313262 + 1.313262) / 2 = 1.313262
    pair0 = (-math.log(sigmoid(2.0)) - math.log(1 - sigmoid(-1.0))) / 2
    pair1 = (-math.log(sigmoid(-1.0)) - math.log(1 - sigmoid(1.0))) / 2
    assert (pair0, pair1) == pytest.approx((0.220095, 1.313262), abs=1e-6)
    assert loss.item() == pytest.approx((pair0 + pair1) / 2, rel=1e-12)  # 0.766678
    assert metrics["rewards/chosen"].item() == pytest.approx((2.0 - 1.0) / 2)
    assert metrics["rewards/rejected"].item() == pytest.approx((-1.0 + 1.0) / 2)
    assert metrics["rewards/accuracies"].item() == 0.5  # 2 > -1, -1 < 1
    assert metrics["ce/accuracy"].item() == 0.5  # pair 0 both sides right (2 > 0, -1 < 0), pair 1 neither


def test_the_papers_default_beta_and_the_official_bce_form():
    # beta 0.05: r_c = [0.05, -0.025] (label 1: log(1 + e^-r)), r_r = [-0.025, 0.025] (label 0: log(1 + e^r)):
    # (0.668460 + 0.705725 + 0.680725 + 0.705725) / 4, also the official trainer's nn.BCELoss on sigma(r)
    loss, _ = ImplicitPRM().loss(pairs())
    r = torch.tensor([0.05, -0.025, -0.025, 0.025], dtype=torch.float64)
    bce = torch.nn.BCELoss()(r.sigmoid(), torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx(bce.item(), rel=1e-12)
    assert loss.item() == pytest.approx((0.668460 + 0.705725 + 0.680725 + 0.705725) / 4, abs=1e-6)


def test_the_step_norm_counts_pairs():
    full, _ = ImplicitPRM().loss(pairs())
    share, _ = ImplicitPRM().loss(pairs(), StepNorm(num_tokens=99.0, num_seqs=4.0))  # two more pairs elsewhere
    assert share.item() == pytest.approx(full.item() / 2, rel=1e-12)


def test_gradient_anchors_each_response_at_zero_not_the_margin():
    batch = pairs(requires_grad=True)
    ImplicitPRM(ImplicitPRM.Config(beta=2.0)).loss(batch)[0].backward()
    # d/d logp_c of -log sigma(r_c) / 2 / B = -beta (1 - sigma(r_c)) / 4; of -log sigma(-r_r) / 4: beta sigma(r_r) / 4
    assert batch.policy_chosen_logps.grad.tolist() == pytest.approx(
        [-2.0 * (1 - sigmoid(2.0)) / 4, -2.0 * (1 - sigmoid(-1.0)) / 4], rel=1e-12)
    assert batch.policy_rejected_logps.grad.tolist() == pytest.approx(
        [2.0 * sigmoid(-1.0) / 4, 2.0 * sigmoid(1.0) / 4], rel=1e-12)
    # DPO sees only the margin: a shift of both log-ratios leaves it unchanged; the CE loss does not
    base = pairs()
    shifted = replace(base, policy_chosen_logps=base.policy_chosen_logps + 3,
                      policy_rejected_logps=base.policy_rejected_logps + 3)
    assert DPO().loss(shifted)[0].item() == pytest.approx(DPO().loss(pairs())[0].item(), rel=1e-12)
    assert ImplicitPRM().loss(shifted)[0].item() != pytest.approx(ImplicitPRM().loss(pairs())[0].item(), rel=1e-3)


# --- step rewards on hand-built models ----------------------------------------------------------

class Unigram(torch.nn.Module):
    """A causal LM whose next-token logits are one fixed vector: log p(x | anything) = log softmax(logits)[x]."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)
        self.config = SimpleNamespace(vocab_size=len(logits))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        out = self.logits.expand(*input_ids.shape, -1)
        return SimpleNamespace(logits=out[:, -logits_to_keep:] if logits_to_keep else out)


@pytest.fixture()
def unigrams(tmp_path, monkeypatch):
    """The PRM puts logit ln 2 on '1', its reference ln 3 on 'a', every other logit 0; V = 264 tokens.

    log p('1') = ln 2 - ln(V + 1), log p(other) = -ln(V + 1); log p_ref('a') = ln 3 - ln(V + 2),
    log p_ref(other) = -ln(V + 2). With c = ln((V + 2) / (V + 1)) the log-ratios are: '1' ln 2 + c,
    'a' c - ln 3, any other token (EOS included) c.
    """
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path / "prm")
    one, a = tok("1", add_special_tokens=False).input_ids[0], tok("a", add_special_tokens=False).input_ids[0]
    prm, ref = torch.zeros(len(tok)), torch.zeros(len(tok))
    prm[one], ref[a] = math.log(2), math.log(3)
    models = {str(tmp_path / "prm"): Unigram(prm), "REF": Unigram(ref)}
    monkeypatch.setattr(implicit, "load_causal_lm", lambda src: models[src])
    V = len(tok)
    assert V == 264
    return str(tmp_path / "prm"), math.log((V + 2) / (V + 1))


def test_step_rewards_are_beta_times_each_steps_log_ratio_sum_and_add_up_to_the_outcome(unigrams):
    path, c = unigrams
    reward = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference="REF", step_separator=" "))
    assert reward.beta == 0.05  # no stage recorded another
    # "12 a1 1" + EOS: the steps "12", " a1", " 1" + EOS (a separator belongs to the step after it, the EOS
    # to the last step); the prompt's '1' and 'a' count for nothing.
    ln2, ln3 = math.log(2), math.log(3)
    step1 = 0.05 * ((ln2 + c) + c)  # '1' '2' = 0.05 * 0.700680 = 0.035034
    step2 = 0.05 * (c + (c - ln3) + (ln2 + c))  # ' ' 'a' '1' = 0.05 * -0.394166 = -0.019708
    step3 = 0.05 * (c + (ln2 + c) + c)  # ' ' '1' EOS = 0.05 * 0.704447 = 0.035222
    assert (step1, step2, step3) == pytest.approx((0.035034, -0.019708, 0.035222), abs=1e-6)
    got = reward.step_rewards(["1a="], ["12 a1 1"])[0]
    assert [end for end, _ in got] == [2, 5, 7]  # where each step's text ends in the completion
    assert [r for _, r in got] == pytest.approx([step1, step2, step3], abs=1e-7)
    outcome = 0.05 * (3 * (ln2 + c) + (c - ln3) + 4 * c)  # r(y): beta * the summed log-ratio of all 8 tokens
    assert sum(r for _, r in got) == pytest.approx(outcome, abs=1e-6)  # fp32 log-probs
    assert reward(["1a="], ["12 a1 1"]) == pytest.approx([step2], abs=1e-7)  # min over steps
    summed = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference="REF", step_separator=" ",
                                                                aggregation="sum", beta=0.5))
    assert summed(["1a="], ["12 a1 1"]) == pytest.approx([10 * outcome], abs=1e-5)  # beta 0.5 = 10 x 0.05


def test_a_completion_without_steps_is_one_step_and_batches_do_not_mix(unigrams):
    path, c = unigrams
    reward = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference="REF", step_separator=" ",
                                                                batch_size=2))
    ln2 = math.log(2)
    got = reward.step_rewards(["x=", "y=", "z="], ["  ", "1", "11 1 2"])
    assert got[0] == [(2, pytest.approx(0.05 * 3 * c, abs=1e-7))]  # ' ' ' ' EOS: one step over the whole text
    assert got[1] == [(1, pytest.approx(0.05 * (ln2 + 2 * c), abs=1e-7))]  # '1' EOS (c for EOS, plus '1')
    assert [r for _, r in got[2]] == pytest.approx(
        [0.05 * 2 * (ln2 + c), 0.05 * (c + ln2 + c), 0.05 * 3 * c], abs=1e-7)  # "11", " 1", " 2" + EOS
    # the same batch again is not scored twice (process-supervised RL asks for the rewards, then the steps)
    assert reward.step_rewards(["x=", "y=", "z="], ["  ", "1", "11 1 2"]) is got


def test_a_recorded_or_given_reference_is_required(tmp_path, unigrams):
    path, _ = unigrams
    with pytest.raises(ValueError, match="no preference stage's manifest.*give the reward's `reference`"):
        ImplicitProcessReward(ImplicitProcessReward.Config(path=path))
    with pytest.raises(ValidationError):
        ImplicitProcessReward.Config(path=path, aggregation="prod")


# --- real tiny models: the outcome reward is the one the preference stage trains --------------------

@pytest.fixture(scope="module")
def tiny_pair(tiny_model):
    return str(tiny_model(seed=1)), str(tiny_model())


def direct_log_ratios(prm, ref, ids):
    """Per-token log-ratios of one unpadded sequence from a plain forward of each model: [len(ids) - 1]."""
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = [m(x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0] for m in (prm, ref)]
    return (lp[0] - lp[1]).double()


def test_the_sum_of_step_rewards_is_the_reward_the_preference_stage_trained(tiny_pair):
    from datasets import Dataset

    from alignflow.core.train.batching import collate
    from alignflow.core.train.datasets import tokenize
    from alignflow.flows.stages.preference import SequenceScorer

    path, ref = tiny_pair
    reward = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference=ref, step_separator=" ",
                                                                aggregation="sum"))
    prompts, chosen, rejected = ["12+34=", "5*6="], ["<think>2+4=6 1+3=4</think><answer>46</answer>", "30"], \
        ["<think>2+4=6</think> <answer>56</answer>", "<think>6*5=30 </think>"]
    rows, _ = tokenize(Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r}
                                          for p, c, r in zip(prompts, chosen, rejected)]),
                       reward.tokenizer, 96, "pairwise")
    micro = collate(rows.to_list(), reward.tokenizer.pad_token_id)
    logps = {(name, m): SequenceScorer(model, micro, "completion", torch.device("cpu"))(name, "completion").logps
             for name in ("chosen", "rejected") for m, model in (("prm", reward.model), ("ref", reward.reference))}
    batch = PairBatch(policy_chosen_logps=logps["chosen", "prm"], policy_rejected_logps=logps["rejected", "prm"],
                      chosen_lengths=None, rejected_lengths=None,
                      ref_chosen_logps=logps["chosen", "ref"], ref_rejected_logps=logps["rejected", "ref"])
    trained = ImplicitPRM().implicit_rewards(batch)  # beta 0.05, as the reward's default
    assert reward(prompts, chosen) == pytest.approx(trained[0].tolist(), abs=1e-5)
    assert reward(prompts, rejected) == pytest.approx(trained[1].tolist(), abs=1e-5)


def test_padded_batches_and_a_left_cut_score_what_a_plain_forward_does(tiny_pair):
    path, ref = tiny_pair
    prm_model, ref_model = load_model(path), load_model(ref)
    tok = build_char_tokenizer()
    prompt, completion = "12+34=", "<think>2+4=6 1+3=4</think><answer>46</answer>"
    ids = tok(prompt).input_ids + tok(completion, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ratios = direct_log_ratios(prm_model, ref_model, ids)  # ratios[k] is token k + 1's
    start = len(tok(prompt).input_ids)
    # steps "<think>2+4=6" (ids: <think> + 5 chars = 6 tokens), " 1+3=4</think><answer>46</answer>" + EOS
    first = 0.05 * ratios[start - 1: start - 1 + 6].sum().item()
    second = 0.05 * ratios[start - 1 + 6:].sum().item()
    for batch_size in (1, 3):  # padded beside shorter and longer completions, or alone
        reward = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference=ref, step_separator=" ",
                                                                    batch_size=batch_size))
        got = reward.step_rewards(["1=", prompt, "9-1="], ["1", completion, completion + " 8 8 8"])[1]
        assert got == [(12, pytest.approx(first, abs=1e-5)), (len(completion), pytest.approx(second, abs=1e-5))]
    # cut to its last 10 tokens: the first step falls off; the second is scored on what is left
    short = ImplicitProcessReward(ImplicitProcessReward.Config(path=path, reference=ref, step_separator=" ",
                                                               max_length=10))
    cut = direct_log_ratios(prm_model, ref_model, ids[-10:])
    assert short.step_rewards([prompt], [completion])[0] == [(len(completion), pytest.approx(
        0.05 * cut.sum().item(), abs=1e-5))]  # the first kept token has no prefix: nothing to score


def test_the_preference_stage_trains_it_from_log2(tmp_path, tiny_pair):
    """Through the preference stage's loop: at step 1 the policy is its reference, so every r = 0 and every
    response's cross-entropy is -log sigma(0) = ln 2; the held-out pairs report the classifier's accuracy."""
    from alignflow.core.plugins import Plugins
    from alignflow.core.spec.settings import TrainSettings
    from alignflow.core.spec.schema import parse_spec
    from alignflow.core.task.arithmetic import write_datasets
    from alignflow.flows.stages import StageContext
    from alignflow.flows.stages.preference import run_preference

    lines = write_datasets(tmp_path / "data")["pairs"].read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:8]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(lines[-4:]) + "\n")
    inputs = {"model": tiny_pair[1], "dataset": str(tmp_path / "train.jsonl"),
              "eval_dataset": str(tmp_path / "eval.jsonl")}
    plugs = Plugins()
    plugs.add(implicit, "implicit_prm")
    spec = parse_spec({"name": "p", "stages": {"pref": {
        "kind": "preference", "inputs": inputs, "algorithm": "implicit_prm",
        "settings": {"lr": 1e-3, "max_steps": 2, "batch_size": 4, "micro_batch_size": 2, "max_length": 64,
                     "log_every": 1}}}}, plugins=plugs)
    logged = []
    (tmp_path / "work").mkdir()
    ctx = StageContext("pref", spec.stages["pref"], TrainSettings.model_validate(spec.stages["pref"].settings),
                       inputs, tmp_path / "work", tmp_path / "ckpt", 0, lambda m, step: logged.append(m), plugs)
    result = run_preference(ctx)
    first = next(m for m in logged if "loss" in m)  # the first step's metrics, after the data counts
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6) and first["ce/accuracy"] == 0.0  # r = 0: no side
    assert 0.0 <= result.metrics["eval/ce/accuracy"] <= 1.0 and result.headline == "eval/rewards/accuracies"


# --- the reference the preference stage recorded -------------------------------------------------

def finished(root, stage, digest, inputs, config):
    """A finished artifact with a model output, as the pipeline's artifact store writes it."""
    from alignflow.flows.store.artifacts import ArtifactStore

    store = ArtifactStore(root)
    work = store.fresh_work_dir(stage, digest)
    (work / "model").mkdir()
    manifest = {"digest": digest, "stage": stage, "kind": config["kind"], "config": config, "inputs": inputs}
    store.finalise(stage, digest, {"model": work / "model"}, manifest, {})
    return store.folder(stage, digest) / "out" / "model"


def test_the_reference_and_beta_come_from_the_preference_stages_manifest(tmp_path):
    cold = finished(tmp_path / "artifacts", "cold_start", "c0", {}, {"kind": "sft"})
    entry = lambda path, spec, digest: {"resolved": str(path), "spec": spec, "digest": digest}  # noqa: E731
    inputs = {"model": entry(cold, "stage:cold_start", "stage:c0"), "dataset": entry("d", "d", "file:x")}
    config = {"kind": "preference", "algorithm": {"name": "implicit_prm", "config": {"beta": 0.2}}}
    prm = finished(tmp_path / "artifacts", "prm", "p0", inputs, config)
    assert trained_with(str(prm)) == (str(cold), 0.2)  # no `reference` input: the initial model
    assert trained_with(str(cold)) == (None, None)  # not a preference stage
    assert trained_with(str(tmp_path)) == (None, None)  # no manifest at all
    # a `reference` input wins over the initial model; a built-in model stays as it is
    with_ref = finished(tmp_path / "artifacts", "prm2", "p1", {**inputs, "reference": entry(
        "builtin:tiny", "builtin:tiny", "builtin:tiny")}, config)
    assert trained_with(str(with_ref)) == ("builtin:tiny", 0.2)
    # artifacts moved: the recorded path is gone, the upstream stage's artifact is found under the new root
    (tmp_path / "artifacts").rename(tmp_path / "moved")
    assert trained_with(str(tmp_path / "moved" / "prm" / "p0" / "out" / "model")) == (
        str(tmp_path / "moved" / "cold_start" / "c0" / "out" / "model"), 0.2)
    assert json.loads((tmp_path / "moved" / "prm" / "p0" / "manifest.json").read_text())["outputs"] == {
        "model": "out/model"}


# --- in an rl stage ------------------------------------------------------------------------------

def run_rl_stage(tmp_path, algorithm, prm, policy):
    """One step of an rl stage on the tiny model: the verifier first (0 for every sample), then the implicit
    PRM (weight 0) reading the stage's `prm` and `reference` inputs."""
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec.settings import RLSettings
    from alignflow.core.spec.schema import StageSpec
    from alignflow.flows.stages import StageContext
    from alignflow.flows.stages.rl.stage import run_rl

    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "dead"}) + "\n" for i in range(4)))
    inputs = {"model": policy, "dataset": str(data), "prm": prm, "reference": policy}
    spec = StageSpec(kind="rl", inputs=inputs, algorithm=algorithm, sampler="hf", rewards=[
        {"name": "math_accuracy"},
        {"name": "implicit_prm", "weight": 0.0, "config": {
            "path": "${inputs.prm}", "reference": "${inputs.reference}", "step_separator": "a"}}])
    settings = RLSettings(max_steps=1, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-3,
                          generation={"max_new_tokens": 24}, save_every=1)
    log = []
    (tmp_path / "work").mkdir()
    ctx = StageContext("rl", spec, settings, inputs, tmp_path / "work", tmp_path / "ckpt", 0,
                       lambda m, step: log.append(m), get_plugins())
    result = run_rl(ctx)
    before, after = load_model(policy).state_dict(), load_model(result.outputs["model"]).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(math.isfinite(v) for v in log[0].values())
    return log[0]


def test_process_supervised_grpo_runs_on_the_implicit_prms_step_rewards(tmp_path, tiny_pair, monkeypatch):
    from alignflow.plugins.grpo_process import ProcessGRPO

    returned, placed = [], []
    step_rewards, advantages = ImplicitProcessReward.step_rewards, ProcessGRPO.advantages
    monkeypatch.setattr(ImplicitProcessReward, "step_rewards",
                        lambda self, p, c: returned.append(step_rewards(self, p, c)) or returned[-1])
    monkeypatch.setattr(ProcessGRPO, "advantages",
                        lambda self, rollout: placed.append(rollout.step_rewards.clone()) or advantages(self, rollout))
    metrics = run_rl_stage(tmp_path, "grpo_process", *tiny_pair)
    # the outcome reward is 0 for every sample: the implicit PRM's steps alone spread the advantages
    assert metrics["reward/total/std"] == 0 and metrics["advantages/std"] > 0
    # every step's reward sits at one token of the rollout: the rollout holds exactly what the reward gave
    steps = [r for batch in returned for completion in batch for _, r in completion]
    assert len(steps) >= 8 and any(len(c) > 1 for batch in returned for c in batch)  # some completion has steps
    assert sum(placed[0].flatten().tolist()) == pytest.approx(sum(steps), abs=1e-5)
    assert int((placed[0] != 0).sum()) == sum(r != 0 for r in steps)
    assert metrics["reward/implicit_prm/mean"] == pytest.approx(
        sum(min(r for _, r in c) for c in returned[0]) / len(returned[0]), abs=1e-6)  # min over steps


def test_step_by_step_ppo_adds_the_implicit_prms_step_rewards_to_its_token_rewards(tmp_path, tiny_pair, monkeypatch):
    from alignflow.plugins.ppo_process import ProcessPPO

    returned, added = [], []
    step_rewards, token_rewards = ImplicitProcessReward.step_rewards, ProcessPPO.step_token_rewards
    monkeypatch.setattr(ImplicitProcessReward, "step_rewards",
                        lambda self, p, c: returned.append(step_rewards(self, p, c)) or returned[-1])
    monkeypatch.setattr(ProcessPPO, "step_token_rewards",
                        lambda self, rollout: added.append(token_rewards(self, rollout)) or added[-1])
    run_rl_stage(tmp_path, "ppo_process", *tiny_pair)
    steps = [r for batch in returned for completion in batch for _, r in completion]
    assert sum(added[0].flatten().tolist()) == pytest.approx(sum(steps), abs=1e-5) and any(steps)


def test_the_reward_reads_the_recorded_reference_and_says_when_it_is_gone(tmp_path, monkeypatch):
    entry = {"resolved": str(tmp_path / "gone"), "spec": str(tmp_path / "gone"), "digest": "file:x"}
    config = {"kind": "preference", "algorithm": {"name": "dpo", "config": {"beta": 0.1}}}
    prm = finished(tmp_path / "artifacts", "dpo", "d0", {"model": entry}, config)
    build_char_tokenizer().save_pretrained(prm)
    loaded = []

    def load(src):
        loaded.append(src)
        if src != str(prm.resolve()) and src != str(prm):
            raise OSError(f"no model at {src}")
        return Unigram(torch.zeros(264))

    monkeypatch.setattr(implicit, "load_causal_lm", load)
    with pytest.raises(ValueError, match=f"the reference its stage recorded, {tmp_path / 'gone'}, does not load"):
        ImplicitProcessReward(ImplicitProcessReward.Config(path=str(prm)))
    reward = ImplicitProcessReward(ImplicitProcessReward.Config(path=str(prm), reference=str(prm)))
    assert reward.beta == 0.1  # a DPO model's implicit reward is DPO's beta times the log-ratio
    assert loaded == [str(prm), str(tmp_path / "gone"), str(prm), str(prm)]
