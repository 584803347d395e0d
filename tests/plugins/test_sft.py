import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import TokenBatch
from alignflow.plugins.sft import SFT

INF = math.inf


def tokens(requires_grad=False):
    """Row 0: one prompt token, two completion tokens, padding (-inf); row 1: three completion tokens."""
    logps = torch.tensor([[-0.5, -1.0, -2.0, -INF], [-0.1, -0.3, -0.2, -INF]], requires_grad=requires_grad)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0]])
    correct = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]]).bool()
    return TokenBatch(logps, mask, correct)


def test_flags():
    assert SFT.stage == "sft" and not SFT.requires_reference and not SFT.requires_pairs


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1.0 + 2.0 + 0.1 + 0.3 + 0.2) / 5),
    ("seq-mean-token-mean", ((1.0 + 2.0) / 2 + (0.1 + 0.3 + 0.2) / 3) / 2),
    ("seq-mean-token-sum", ((1.0 + 2.0) + (0.1 + 0.3 + 0.2)) / 2),
])
def test_masked_nll_per_aggregation_mode(mode, expected):
    loss, metrics = SFT(SFT.Config(loss_agg_mode=mode)).loss(tokens())
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["loss"].item() == pytest.approx(3.6 / 5, rel=1e-6)
    assert metrics["token_accuracy"].item() == pytest.approx(3 / 5)  # (1, 0) and (1, 0, 1)


def test_micro_batch_shares_add_up_and_padding_stays_finite():
    full = tokens(requires_grad=True)
    norm = StepNorm.of([full.mask[:1], full.mask[1:]])
    parts = [SFT().loss(TokenBatch(full.logps[i : i + 1], full.mask[i : i + 1]), norm)[0] for i in (0, 1)]
    total = parts[0] + parts[1]
    total.backward()
    assert total.item() == pytest.approx(3.6 / 5, rel=1e-6)
    assert torch.isfinite(full.logps.grad).all()
    assert full.logps.grad[0].tolist() == pytest.approx([0.0, -0.2, -0.2, 0.0])
