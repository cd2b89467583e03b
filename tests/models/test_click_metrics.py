"""log_loss and exact AUC against direct computations."""

import math

import torch
import torch.nn.functional as F

from recc.models import Metrics, auc, log_loss


def brute_force_auc(pred, y):
    pos = [p for p, t in zip(pred.tolist(), y.tolist()) if t == 1]
    neg = [p for p, t in zip(pred.tolist(), y.tolist()) if t == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_auc_matches_pairwise_count_with_ties():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        pred = torch.randint(0, 10, (300,), generator=g).float() / 10  # many ties
        y = torch.bernoulli(torch.full((300,), 0.3), generator=g)
        assert math.isclose(auc(pred, y), brute_force_auc(pred, y), rel_tol=1e-12)
        assert math.isclose(auc(pred.view(-1, 1), y.view(-1, 1)), brute_force_auc(pred, y), rel_tol=1e-12)


def test_auc_edge_cases():
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), y) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), y) == 0.0
    assert auc(torch.full((4,), 0.5), y) == 0.5
    assert math.isnan(auc(torch.rand(4), torch.zeros(4)))


def test_log_loss_matches_bce_and_clamps():
    pred, y = torch.rand(100, 1), torch.bernoulli(torch.full((100, 1), 0.4))
    assert math.isclose(log_loss(pred, y), F.binary_cross_entropy(pred.double(), y.double()).item(), rel_tol=1e-9)
    assert math.isfinite(log_loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])))


def test_metrics_accumulate_over_batches():
    pred, y = torch.rand(200, 1), torch.bernoulli(torch.full((200, 1), 0.4))
    m = Metrics()
    for chunk in range(4):
        m.update(pred[chunk * 50 : (chunk + 1) * 50], y[chunk * 50 : (chunk + 1) * 50])
    assert m.compute() == {"log_loss": log_loss(pred, y), "auc": auc(pred, y)}
    m.reset()
    m.update(pred[:10], y[:10])
    assert m.compute()["auc"] == auc(pred[:10], y[:10])
