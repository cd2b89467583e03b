"""The synthetic teacher is learnable: a tiny DLRM beats chance on held-out batches quickly."""

import torch
import torch.nn.functional as F

from recc.models import DLRM, Metrics, SyntheticData


def test_tiny_dlrm_learns_the_synthetic_clicks():
    torch.manual_seed(0)
    model = DLRM.from_preset("tiny")
    data = SyntheticData("tiny", batch_size=64, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for dense_x, lS_o, lS_i, y in data.batches(300):
        loss = F.binary_cross_entropy(model(dense_x, lS_o, lS_i), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    held_out = Metrics()
    with torch.no_grad():
        for dense_x, lS_o, lS_i, y in data.batches(64, start=1_000_000):
            held_out.update(model(dense_x, lS_o, lS_i), y)
    result = held_out.compute()
    assert result["auc"] > 0.65, result
