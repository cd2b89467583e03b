"""Shared by the one-process parity tests: eager and recc stepped side by side."""
from __future__ import annotations

import torch


def assert_trains_like_eager(eager, dmodel, batches, lr: float) -> None:
    """SGD on the eager model (its embeddings sparse) and on the instantiated model's dense part,
    the same mean-square loss on each batch: outputs and the final state must agree."""
    opt = torch.optim.SGD(eager.parameters(), lr=lr)
    dopt = torch.optim.SGD(dmodel.dense_parameters(), lr=lr)
    for step, args in enumerate(batches):
        want, got = eager(*args), dmodel(*args)
        torch.testing.assert_close(got, want, msg=f"step {step}")
        want.square().mean().backward()
        got.square().mean().backward()
        opt.step(), dopt.step()
        opt.zero_grad(), dopt.zero_grad()
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(dmodel.state_dict()[k], v, msg=k)
