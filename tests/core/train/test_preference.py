import math

import pytest
import torch

from alignflow.core import get_plugins
from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import (
    ListBatch, Mean, OfflineAlgorithm, SequenceLogps, build_batch, example_mean, mismatched_pairs, per_token,
    reward_metrics,
)

OFFLINE = {"sft": "sft", "bradley_terry": "reward_model", "dpo": "preference", "ipo": "preference",
           "kto": "preference", "orpo": "preference", "simpo": "preference"}
PREFERENCE = sorted(name for name, stage in OFFLINE.items() if stage == "preference")


def test_sequence_logps_sum_completion_tokens_and_ignore_padding():
    token_logps = torch.tensor([[-0.5, -1.0, -2.0, -math.inf], [-0.1, -0.3, -0.2, -0.4]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    seqs = SequenceLogps.of(token_logps, mask)
    assert seqs.logps.tolist() == pytest.approx([-3.0, -1.0])
    assert seqs.lengths.tolist() == [2, 4]


def test_per_token_and_example_mean():
    assert per_token(torch.tensor([-3.0, -1.0]), torch.tensor([2, 0])).tolist() == [-1.5, -1.0]
    losses = torch.tensor([1.0, 2.0, 3.0, 6.0])
    norm = StepNorm(num_tokens=0.0, num_seqs=4.0)
    shares = example_mean(losses[:1], norm) + example_mean(losses[1:], norm)
    assert shares.item() == pytest.approx(example_mean(losses).item()) == 3.0


def test_reward_metrics():
    m = reward_metrics(torch.tensor([0.5, -0.2, 0.1]), torch.tensor([0.1, 0.3, 0.1]))
    assert m["rewards/chosen"].item() == pytest.approx(0.4 / 3)
    assert m["rewards/rejected"].item() == pytest.approx(0.5 / 3)
    assert m["rewards/margins"].item() == pytest.approx(-0.1 / 3)
    assert m["rewards/accuracies"].item() == pytest.approx(1 / 3)  # ties are not accurate


def test_mismatched_pairs_pair_each_prompt_with_another_completion():
    assert mismatched_pairs(3).tolist() == [1, 2, 0]
    assert mismatched_pairs(1).tolist() == [0]


def test_offline_algorithms_are_registered_for_their_stage():
    algorithms = get_plugins().algorithms
    for name, stage in OFFLINE.items():
        cls = algorithms.get(name)
        assert issubclass(cls, OfflineAlgorithm) and cls.stage == stage, name
        assert cls().config == cls.Config()  # paper defaults, no config needed
        assert not (cls.requires_pairs and cls.requires_labels), name


class FakeScorer:
    """Scores named sequence sets from fixed summed log-probs, recording what it was asked for."""

    def __init__(self, offset: float, requires_grad: bool):
        self.calls: list[tuple[str, str]] = []
        self.leaves: dict[tuple[str, str], torch.Tensor] = {}
        self.offset, self.requires_grad = offset, requires_grad

    def __call__(self, name: str, scope: str) -> SequenceLogps:
        self.calls.append((name, scope))
        base = {"chosen": [-4.0, -6.0, -5.0], "rejected": [-7.0, -5.5, -9.0], "completion": [-3.0, -8.0, -4.0],
                "kl": [-9.0, -6.0, -7.0]}[name]
        extra = 2.0 if scope == "sequence" else 0.0  # prompt tokens make the sequence log-prob lower
        leaf = torch.tensor(base, dtype=torch.float64, requires_grad=self.requires_grad)
        self.leaves[name, scope] = leaf
        # `* 1.0` runs inside the caller's grad mode, as a model forward pass would.
        return SequenceLogps(leaf * 1.0 - extra - self.offset, torch.tensor([3, 4, 5]) + int(extra))


@pytest.mark.parametrize("name", PREFERENCE)
def test_one_generic_builder_serves_every_preference_algorithm(name):
    algo = get_plugins().algorithms.get(name)()
    policy, reference = FakeScorer(0.0, requires_grad=True), FakeScorer(0.5, requires_grad=False)
    batch = build_batch(algo, policy, reference, labels=torch.tensor([1, 0, 1]))
    assert isinstance(batch, algo.batch_type)
    assert bool(reference.calls) == algo.requires_reference
    assert any(c[0] == "kl" for c in policy.calls) == algo.needs_kl_pairs
    assert any(scope == "sequence" for _, scope in policy.calls) == (algo.nll_scope == "sequence")

    loss, metrics = algo.loss(batch, StepNorm(num_tokens=12.0, num_seqs=3.0))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        value = metrics[key].value if isinstance(metrics.get(key), Mean) else metrics.get(key)
        assert value is not None and not value.requires_grad, key
    trained = policy.leaves.get(("chosen", "completion"), policy.leaves.get(("completion", "completion")))
    assert trained.grad is not None and trained.grad.abs().sum() > 0
    if algo.needs_kl_pairs:
        assert policy.leaves["kl", "completion"].grad is None  # scored without gradient


def test_ranked_lists_build_a_list_batch_for_an_algorithm_that_accepts_them():
    larpo, dpo = get_plugins().algorithms.get("larpo")(), get_plugins().algorithms.get("dpo")()
    policy, reference = FakeScorer(0.0, requires_grad=True), FakeScorer(0.5, requires_grad=False)
    scores = torch.tensor([[1.0, 0.0], [1.0, 0.5], [2.0, 0.0]])
    batch = build_batch(larpo, policy, reference, candidates=["chosen", "rejected"], scores=scores)
    assert isinstance(batch, ListBatch)
    assert batch.policy_logps.tolist() == [[-4.0, -7.0], [-6.0, -5.5], [-5.0, -9.0]]
    assert batch.ref_logps.tolist() == [[-4.5, -7.5], [-6.5, -6.0], [-5.5, -9.5]]
    assert batch.lengths.tolist() == [[3, 3], [4, 4], [5, 5]] and torch.equal(batch.scores, scores)
    loss, metrics = larpo.loss(batch)
    pairs = build_batch(larpo, FakeScorer(0.0, False), FakeScorer(0.5, False))  # a list of two is a pair
    pair_loss, pair_metrics = larpo.loss(pairs)
    assert loss.item() == pytest.approx(pair_loss.item(), rel=1e-12)
    assert {k: v.item() for k, v in metrics.items()} == pytest.approx({k: v.item() for k, v in pair_metrics.items()})
    with pytest.raises(ValueError, match="DPO trains on pairs, not ranked lists"):
        build_batch(dpo, policy, reference, candidates=["chosen", "rejected"])


def test_builder_rejects_missing_reference_and_labels():
    algorithms = get_plugins().algorithms
    with pytest.raises(ValueError, match="reference"):
        build_batch(algorithms.get("dpo")(), FakeScorer(0.0, False))
    with pytest.raises(ValueError, match="label"):
        build_batch(algorithms.get("kto")(), FakeScorer(0.0, False), FakeScorer(0.5, False))
