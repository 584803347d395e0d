"""Off-policy GRPO: whitening under alpha, the clipped surrogate against alpha, the replay buffer, exact
resume of a replaying stage, and Kimi k1.5's prioritised prompt draw."""

import json
import math

import pytest
import torch

from alignflow.core import hookimpl
from alignflow.core.rl.aggregation import aggregate
from alignflow.core.train.models import load_model
from alignflow.core.plugins import get_plugins
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.prompts import PromptDraw
from alignflow.flows.stages.rl.replay import ReplayBuffer, replay_metrics, restore, with_replayed
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.plugins import offpolicy_grpo
from alignflow.plugins.grpo import GRPO
from alignflow.plugins.offpolicy_grpo import OffPolicyGRPO, OffPolicyGRPOConfig

LENGTHS = [2, 1, 3, 2]
MASK = torch.tensor([[1] * n + [0] * (3 - n) for n in LENGTHS])


def test_defaults():
    algo = OffPolicyGRPO()
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, c.kl_loss_estimator) == (0.2, 0.2, 0.04, "k3")
    assert algo.loss_agg_mode == "seq-mean-token-mean" and algo.requires_reference
    assert (c.replay_fraction, c.buffer_steps, c.var_eps) == (0.5, 1, 1e-6)
    # half of r1-tiny's 64 groups are generated, the other half replayed; at least one is always fresh
    assert algo.fresh_groups(64) == 32 and algo.buffer_steps == 1
    assert OffPolicyGRPO(OffPolicyGRPOConfig(replay_fraction=0.9)).fresh_groups(1) == 1
    assert GRPO().fresh_groups(64) == 64 and GRPO().buffer_steps == 0  # on-policy: nothing replayed


def test_advantages_whiten_with_eps_inside_the_square_root():
    # group 0: rewards 2, 0, 0, 0: mean 0.5, unbiased var (1.5^2 + 3 x 0.5^2) / 3 = 1,
    # sigma_eps = sqrt(1 + 0.21) = 1.1, so A = (1.5, -0.5, -0.5, -0.5) / 1.1 = (15, -5, -5, -5) / 11
    # (std + eps would give 1.21 instead). Group 1 has no variance: A = 0. Group 2 is one response: A = 0.
    r = Rollout(rewards=torch.tensor([2.0, 0, 0, 0, 1, 1, 7]), group=torch.tensor([5, 5, 5, 5, 9, 9, 3]),
                response_mask=torch.ones(7, 1), old_logprobs=torch.zeros(7, 1), max_new_tokens=1)
    adv, returns = OffPolicyGRPO(OffPolicyGRPOConfig(var_eps=0.21)).advantages(r)
    torch.testing.assert_close(adv[:, 0], torch.tensor([15, -5, -5, -5, 0, 0, 0]) / 11)
    assert returns is None
    centred, _ = OffPolicyGRPO(OffPolicyGRPOConfig(scale_rewards=False)).advantages(r)
    torch.testing.assert_close(centred[:4, 0], torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_surrogate_clips_the_ratio_to_the_behaviour_policy():
    """pi_theta / alpha per token, alpha = the replayed rows' old_logprobs, clipped as off-policy PPO."""
    algo = OffPolicyGRPO(OffPolicyGRPOConfig(var_eps=0.21, kl_loss_coef=0.0))
    alpha = torch.full((4, 3), -2.0)
    r = Rollout(rewards=torch.tensor([2.0, 0, 0, 0]), group=torch.zeros(4, dtype=torch.long), response_mask=MASK,
                old_logprobs=alpha, max_new_tokens=3)
    adv, _ = algo.advantages(r)  # (15, -5, -5, -5) / 11
    log_ratio = torch.tensor([0.5, -0.5, 0.1, 0.3])[:, None]
    logprobs = (alpha + log_ratio).requires_grad_()
    per_token, metrics = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    # row 0, A = 15/11 > 0, r = e^0.5 = 1.6487 > 1.2: clipped, -1.2 x 15/11 = -1.636364
    # row 1, A = -5/11, r = e^-0.5 = 0.6065 < 0.8: clipped, 0.8 x 5/11 = 0.363636
    # row 2, A = -5/11, r = e^0.1: 5/11 x 1.105171 = 0.502350
    # row 3, A = -5/11, r = e^0.3 = 1.3499 > 1.2 but A < 0: the pessimistic bound keeps r, 5/11 x 1.349859 = 0.613572
    # seq-mean-token-mean (each row's tokens share one value): (-1.636364 + 0.363636 + 0.502350 + 0.613572) / 4
    assert loss.item() == pytest.approx(-0.0392012, abs=1e-6)
    # gradient: 0 on clipped rows; d/dlogp (-A r) = -A r on the others, times 1 / (4 |o_i|)
    expected = torch.tensor([0.0, 0.0, 5 / 11 * math.exp(0.1) / (4 * 3), 5 / 11 * math.exp(0.3) / (4 * 2)])
    torch.testing.assert_close(logprobs.grad, expected[:, None] * MASK)
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(2 / 8)  # row 0's two tokens of 8
    assert metrics["actor/clip_low_frac"].item() == pytest.approx(1 / 8)


def samples(groups, completions, logprobs, correct):
    """One row per completion; `groups[i]` its prompt group."""
    return Samples(prompt_ids=[[7, 8] for _ in groups], completion_ids=completions, logprobs=logprobs,
                   group=list(groups), reward=[float(c) for c in correct], correct=list(correct),
                   truncated=[False] * len(groups), values={"r": [float(c) for c in correct]},
                   counts={"reward/r/x": 1.0})


def step_samples(step):
    """Two groups of two completions; log-probs that name the step and row (-step - row/10)."""
    completions = [[1, 2], [3], [4, 5, 6], [9]]
    logprobs = [[-step - i / 10] * len(c) for i, c in enumerate(completions)]
    return samples([0, 0, 1, 1], completions, logprobs, [True, False, True, True])


def train_on(buffer, step, fresh, recomputed=-9.0):
    """What rl_step does around the buffer: join, tensorise, a pi_old recompute (every old log-prob set to
    `recomputed`), restore, keep. Returns the batch and what was replayed."""
    picked = buffer.draw(step)
    batch = to_batch(with_replayed(fresh, picked), 0, 3)
    batch.rollout.old_logprobs = torch.where(batch.rollout.response_mask.bool(), recomputed, 0.0)
    batch = restore(batch, len(fresh), picked)
    buffer.add(step, fresh, batch.rollout)
    return batch, picked


def test_replayed_groups_keep_the_log_probs_they_were_trained_on():
    algo = OffPolicyGRPO(OffPolicyGRPOConfig(buffer_steps=2))
    buffer = ReplayBuffer(algo, prompts_per_step=4, seed=0)
    assert (buffer.fresh, buffer.replayed, buffer.keep) == (2, 2, 2)
    batch0, picked = train_on(buffer, 0, step_samples(0), recomputed=-0.5)  # step 0: nothing to replay
    assert picked == [] and len(batch0.rollout.rewards) == 4 and len(buffer.entries) == 2
    assert buffer.entries[0]["behaviour"] == [[-0.5, -0.5], [-0.5]]  # pi_old as trained at step 0
    assert buffer.entries[0]["samples"].counts == {}  # the round's counts were reported at step 0

    batch1, picked = train_on(buffer, 1, step_samples(1))
    r = batch1.rollout
    assert [e["step"] for e in picked] == [0, 0] and len(r.rewards) == 8
    # fresh groups 0 and 1 keep their ids; the replayed ones follow as 2 and 3, never sharing an id
    assert r.group.tolist()[:4] == [0, 0, 1, 1] and sorted(set(r.group.tolist()[4:])) == [2, 3]
    mask = r.response_mask.bool()
    assert (r.old_logprobs[:4][mask[:4]] == -9.0).all()  # fresh rows: this step's recomputed pi_old
    assert (r.old_logprobs[4:][mask[4:]] == -0.5).all()  # replayed rows: step 0's pi_old, not recomputed
    # ... and their sampler log-probs (mu) are step 0's own, -0 - row/10 (step 1's are -1 - row/10)
    mu = torch.cat([r.sampler_logprobs[4 + i][mask[4 + i]] for i in range(4)])
    torch.testing.assert_close(mu.sort().values, torch.tensor([-0.3, -0.2, -0.2, -0.2, -0.1, 0.0, 0.0]))
    assert replay_metrics(1, picked, step_samples(1)) == {"rollout/replay_frac": 0.5, "rollout/staleness_mean": 0.5}

    # step 2: groups of steps 0 (age 2) and 1 (age 1) are live; two are picked, the same ones on every call
    picked = buffer.draw(2)
    assert len(picked) == 2 and {e["step"] for e in buffer.entries} == {0, 1}
    assert [id(e) for e in buffer.draw(2)] == [id(e) for e in picked]
    again = ReplayBuffer(algo, 4, 0, state=buffer.state())  # from a checkpoint: the same draw
    assert [(e["step"], e["behaviour"]) for e in again.draw(2)] == [(e["step"], e["behaviour"]) for e in picked]
    train_on(buffer, 2, step_samples(2))
    assert {e["step"] for e in buffer.entries} == {1, 2}  # step 0's groups are too old for step 3
    assert all(3 - e["step"] in (1, 2) for e in buffer.draw(3))


def test_an_on_policy_algorithm_keeps_nothing():
    buffer = ReplayBuffer(GRPO(), prompts_per_step=4, seed=0)
    train_on(buffer, 0, step_samples(0))
    assert buffer.fresh == 4 and buffer.entries == [] and buffer.draw(1) == []


def test_prioritized_draw_follows_one_minus_success():
    draw = PromptDraw(n_rows=3, per_step=1, seed=0, mode="prioritized")
    # prompt 0 never solved (s = 0), prompt 1 half the time (s = 0.5), prompt 2 always (s = 1)
    draw.record([0] * 4 + [1] * 4 + [2] * 4, [False] * 4 + [True, False] * 2 + [True] * 4)
    torch.testing.assert_close(draw.success(), torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    counts = torch.zeros(3)
    for step in range(3000):
        counts[draw.rows(step, 0)] += 1
    # P(i) = (1 - s_i) / sum_j (1 - s_j) = 1 / 1.5, 0.5 / 1.5, 0 (plus 1e-6: drawn rarely, not never)
    assert counts[0] / 3000 == pytest.approx(2 / 3, abs=0.03) and counts[1] / 3000 == pytest.approx(1 / 3, abs=0.03)
    assert counts[2] <= 1
    same = PromptDraw(3, 1, 0, "prioritized", state=draw.state())  # the success table of a checkpoint
    assert [same.rows(s, 0) for s in range(20)] == [draw.rows(s, 0) for s in range(20)]
    assert draw.metrics() == {"sampling/prompts_seen": 1.0, "sampling/success_tracked": 0.5}
    # unseen prompts count as unsolved, so a fresh table draws uniformly; `epochs` walks a permutation
    assert PromptDraw(3, 1, 0, "prioritized").weights().tolist() == pytest.approx([1.0] * 3)
    epochs = PromptDraw(6, 2, 0)
    assert sorted(sum((epochs.rows(s, 0) for s in range(3)), [])) == list(range(6))


# -- through the stage: exact resume with a replay buffer and a success table ------------------------

ASCII = 128  # the tiny tokenizer's ids below 128 are ASCII bytes


def ascii_first(prompts, completions, completion_ids, answer, **columns):
    """1 when the completion starts with an ASCII byte: success rates that differ between prompts."""
    return [float(ids[0] < ASCII) for ids in completion_ids]


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("ascii_first", ascii_first)


@pytest.fixture(scope="module")
def plugins():
    p, added = get_plugins(), ["test_offpolicy_rewards"]
    p.add(Rewards, added[0])
    if "offpolicy_grpo" not in p.algorithms:  # until the entry point is installed
        p.add(offpolicy_grpo, "test_offpolicy_grpo")
        added.append("test_offpolicy_grpo")
    yield p
    for name in added:
        p.remove(name)


def make_ctx(root, plugins, model, dataset, log, **extra):
    settings = RLSettings(max_steps=3, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-2,
                          generation={"max_new_tokens": 4}, save_every=1, recompute_old_logprobs=True,
                          prompt_sampling="prioritized", **extra)
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(dataset)}, algorithm="offpolicy_grpo",
                     rewards=["ascii_first"], sampler="hf")
    (root / "work").mkdir(parents=True, exist_ok=True)
    return StageContext("rl", spec, settings, {"model": model, "dataset": dataset}, root / "work",
                        root / "checkpoints", 0, lambda m, step: log.append((step, m)), plugins)


def weights(path):
    return {k: v.clone() for k, v in load_model(path).state_dict().items()}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy CPU: OpenMP's spinning threads slow each step down
    yield tiny_model()
    torch.set_num_threads(before)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "x"}) + "\n" for i in range(4)))
    return path


def test_resume_with_a_replay_buffer_gives_the_uninterrupted_weights(tmp_path, plugins, tiny, data):
    """Killed after step 2 of 3, resumed from step 1's checkpoint: step 2 must replay step 1's group with its
    step-1 log-probs and draw prompts from step 1's success table, or the weights differ."""
    log = []
    whole = run_rl(make_ctx(tmp_path / "a", plugins, tiny, data, log))
    steps = dict(log[:-1])
    assert [steps[s]["rollout/replay_frac"] for s in (1, 2, 3)] == [0.0, 0.5, 0.5]  # 1 fresh + 1 replayed
    assert [steps[s]["rollout/staleness_mean"] for s in (1, 2, 3)] == [0.0, 0.5, 0.5]
    # pi_old is recomputed, so fresh rows have ratio 1; replayed rows keep step k-1's pi_old: ratio != 1
    assert steps[1]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(steps[2]["actor/ratio_mean"] - 1.0) > 1e-4
    saved = last_data_state(tmp_path / "a")
    assert [e["step"] for e in saved["replay"]] == [2]  # buffer_steps = 1: only the last step's group
    assert saved["prompts"]["trials"].sum().item() == 3 * 1 * 4  # 3 steps x 1 fresh prompt x G = 4

    def crash(metrics, step):
        if step == 2:
            raise KeyboardInterrupt

    ctx = make_ctx(tmp_path / "b", plugins, tiny, data, [])
    ctx.log_metrics = crash
    with pytest.raises(KeyboardInterrupt):
        run_rl(ctx)
    resumed_log = []
    resumed = run_rl(make_ctx(tmp_path / "b", plugins, tiny, data, resumed_log))
    assert [step for step, _ in resumed_log[:-1]] == [2, 3]
    a, b = weights(whole.outputs["model"]), weights(resumed.outputs["model"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the resumed run counted step 1's completions too: its table is the uninterrupted one
    table = last_data_state(tmp_path / "b")["prompts"]
    assert all(torch.equal(table[k], saved["prompts"][k]) for k in ("trials", "hits"))


def last_data_state(root):
    """The rl stage's data state in its step-3 checkpoint (DeepSpeed keeps the client state with the model)."""
    path = root / "checkpoints" / "step-00000003" / "ds" / "mp_rank_00_model_states.pt"
    return torch.load(path, weights_only=False)["data"]


@pytest.mark.system
def test_overlapped_rollouts_prefetch_the_prompts_the_step_draws(tmp_path, plugins, tiny, data):
    """The worker generates step k+1's fresh prompts while step k trains: the prioritised draw for k+1 must
    already count step k's completions, or the step regenerates instead (staleness 0)."""
    log = []
    run_rl(make_ctx(tmp_path, plugins, tiny, data, log, async_rollouts=True))
    assert [m["rollout/staleness"] for _, m in log[:-1]] == [0.0, 1.0, 1.0]
