"""Models and jobs of the BatchNorm parity tests (``test_dist_batchnorm.py``).

The models are written as CTR libraries write them (DeepCTR / pytorch-fm): MLP blocks of
``nn.Sequential(Linear, BatchNorm1d, ReLU, Dropout(0))``, one BatchNorm with ``momentum=None``
(the cumulative average), and a ``BatchNorm1d`` over the stacked field embeddings ``[B, F, D]``
(channels = fields), so the gradient of the batch statistics reaches the embedding tables; and
the head's input normalised by a functional ``F.batch_norm(..., training=True)`` on the model's
own parameters and buffers, as some libraries write BatchNorm (it normalises by the batch in eval
mode too, as eager does).
"""
from __future__ import annotations

import copy
import sys

import cloudpickle
import torch
import torch.nn as nn
import torch.nn.functional as F

import recc
from recc.models import SyntheticData, slice_batch

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GLOBAL_BATCH = 16
STEPS = 4
LR = 0.1
ROWS = [10, 20, 30]
DIM = 4


def dnn(dims, momentum=0.1):
    """DeepCTR's DNN / pytorch-fm's MultiLayerPerceptron: Linear, BatchNorm1d, ReLU, Dropout."""
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.BatchNorm1d(b, momentum=momentum), nn.ReLU(), nn.Dropout(0.0)]
    return nn.Sequential(*layers)


class BNCTR(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.ModuleList([nn.EmbeddingBag(r, DIM, mode="sum") for r in ROWS])
        self.field_bn = nn.BatchNorm1d(len(ROWS))
        self.bottom = dnn([13, 8], momentum=None)
        self.top = dnn([8 + len(ROWS) * DIM, 16, 8])
        self.head = nn.Linear(8, 1)
        self.head_w = nn.Parameter(torch.empty(8).uniform_(0.5, 1.5))
        self.head_b = nn.Parameter(torch.empty(8).uniform_(-0.2, 0.2))
        self.register_buffer("head_mean", torch.empty(8).uniform_(-0.5, 0.5))
        self.register_buffer("head_var", torch.empty(8).uniform_(0.5, 1.5))

    def forward(self, dense_x, lS_o, lS_i):
        fields = torch.stack([e(i, o) for e, i, o in zip(self.emb, lS_i, lS_o)], dim=1)   # [B, F, D]
        fields = self.field_bn(fields)
        x = torch.cat([self.bottom(dense_x), fields.flatten(1)], dim=1)
        h = F.batch_norm(self.top(x), self.head_mean, self.head_var, self.head_w, self.head_b, training=True,
                         momentum=0.3, eps=1e-4)
        return torch.sigmoid(self.head(h))


def make_model() -> nn.Module:
    torch.manual_seed(3)
    model = BNCTR()
    with torch.no_grad():   # start from non-trivial running statistics and affine parameters
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def data() -> SyntheticData:
    return SyntheticData("tiny", batch_size=GLOBAL_BATCH, seed=7)


def compile_bn(world: int, batchnorm: str = "sync", sharding: str = "table_wise") -> recc.Program:
    example = slice_batch(data().batch(0), 0, world)[:3]
    cfg = recc.CompileConfig(optimizer="sgd", lr=LR, comm_fwd="fp32", comm_bwd="fp32", batch_size=GLOBAL_BATCH,
                             sharding=sharding, batchnorm=batchnorm)
    return recc.compile(make_model(), recc.Cluster.local(world), example_inputs=example, config=cfg)


def run_bn_job(job: dict) -> dict:
    """On every rank: train ``STEPS`` steps on this rank's slices, then one eval-mode forward."""
    dmodel = job["program"].instantiate()
    rank, world = recc.rank(), recc.world_size()
    opt = torch.optim.SGD(dmodel.dense_parameters(), lr=LR)
    outs = []
    for s in range(STEPS):
        dense_x, lS_o, lS_i, y = slice_batch(data().batch(s), rank, world)
        out = dmodel(dense_x, lS_o, lS_i)
        outs.append(out.detach().clone())
        F.binary_cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    dmodel.eval()
    with torch.no_grad():
        dense_x, lS_o, lS_i, _ = slice_batch(data().batch(STEPS), rank, world)
        evaluated = dmodel(dense_x, lS_o, lS_i)
    report = dmodel.comm_report()
    return {"state": dmodel.state_dict(), "outputs": outs, "eval": evaluated, "error": None,
            "comm": {r.collective: r.wire_bytes for r in report.rows}}


def eager_global() -> tuple[dict, list, torch.Tensor]:
    """One process on the global batch: the parity reference (tables with sparse gradients)."""
    model = make_model()
    for m in model.emb:
        m.sparse = True
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs = []
    for s in range(STEPS):
        dense_x, lS_o, lS_i, y = data().batch(s)
        out = model(dense_x, lS_o, lS_i)
        outs.append(out.detach().clone())
        F.binary_cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        dense_x, lS_o, lS_i, _ = data().batch(STEPS)
        evaluated = model(dense_x, lS_o, lS_i)
    return model.state_dict(), outs, evaluated


def eager_per_rank(world: int) -> tuple[list[dict], list]:
    """What DDP computes (``broadcast_buffers=False``, as recc's DDP runs): ``world`` replicas,
    each normalising its own slice by its own statistics, their gradients averaged (tables'
    too: each replica's mean loss, the sum of the sparse gradients divided by ``world``), the
    same update on every replica; then each replica's eval forward on its slice, as ``run_bn_job``
    ends. Returns each replica's state_dict and the outputs per step."""
    base = make_model()
    replicas = [copy.deepcopy(base) for _ in range(world)]
    outs = []
    for s in range(STEPS):
        step_outs = []
        for r, m in enumerate(replicas):
            dense_x, lS_o, lS_i, y = slice_batch(data().batch(s), r, world)
            out = m(dense_x, lS_o, lS_i)
            step_outs.append(out.detach().clone())
            (F.binary_cross_entropy(out, y) / world).backward()
        outs.append(torch.cat(step_outs))
        with torch.no_grad():
            params = [list(m.parameters()) for m in replicas]
            for group in zip(*params):
                g = sum(p.grad for p in group)
                for p in group:
                    p -= LR * g
                    p.grad = None
    for r, m in enumerate(replicas):   # the eval forward run_bn_job ends with (F.batch_norm(training=True) updates)
        m.eval()
        with torch.no_grad():
            dense_x, lS_o, lS_i, _ = slice_batch(data().batch(STEPS), r, world)
            m(dense_x, lS_o, lS_i)
    return [m.state_dict() for m in replicas], outs
