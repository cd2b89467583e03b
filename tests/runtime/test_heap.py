"""A CPU program's training steps reuse their memory instead of faulting it in every step.

glibc's defaults give a step's freed activations back to the OS, so the next step page-faults
every one of them in again (recc.heap). Each case runs in a fresh interpreter: the setting is
process-wide, and another test's program would already have made it here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A user's CTR model, written the way public code writes one: nn.EmbeddingBag per feature with
# offsets, a wide MLP, BCE loss. At B=2048 its activations are 4-8 MiB tensors.
SCRIPT = textwrap.dedent("""
    import resource, torch, torch.nn as nn, torch.nn.functional as F
    import recc

    class CTR(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.ModuleList(nn.EmbeddingBag(1000, 16, mode="sum") for _ in range(4))
            self.mlp = nn.Sequential(nn.Linear(13 + 64, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                                     nn.Linear(512, 1))

        def forward(self, dense, offsets, ids):
            pooled = [e(i, o) for e, i, o in zip(self.emb, ids, offsets)]
            return torch.sigmoid(self.mlp(torch.cat([dense] + pooled, dim=1))).squeeze(1)

    torch.manual_seed(0)
    B = 2048
    dense = torch.randn(B, 13)
    offsets = [torch.arange(B) for _ in range(4)]
    ids = [torch.randint(0, 1000, (B,)) for _ in range(4)]
    y = torch.rand(B).round()
    program = recc.compile(CTR(), recc.Cluster.local(1), config=recc.CompileConfig(lr=0.01),
                           example_inputs=(dense, offsets, ids))
    model = program.instantiate()
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.01)
    def step():
        F.binary_cross_entropy(model(dense, offsets, ids), y).backward()
        opt.step(); opt.zero_grad()
    for _ in range(10):
        step()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
""")


def _faults_per_step(keep: str) -> float:
    env = dict(os.environ, RECC_KEEP_HEAP=keep, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_training_steps_reuse_their_memory():
    # A step's activations here are ~30 MiB, ~7,500 pages. glibc's defaults fault 1,200-3,000 of
    # them in again every step (the count follows the allocation history); kept, 0-110 once the
    # heap has settled (the first steps still grow it).
    kept = _faults_per_step("1")
    if kept >= 400:
        released = _faults_per_step("0")
        raise AssertionError(f"kept heap: {kept:.0f} minor faults per step ({released:.0f} with RECC_KEEP_HEAP=0)")
