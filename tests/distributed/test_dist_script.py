"""A user's training script run as ``python train.py``: the model class, the step function and
the top-level code all live in the script, written the way tutorials write it (no
``if __name__ == "__main__":`` guard). The spawned ranks must not run the script's top level
again: it printed the plan once per rank and, without a guard, spawned recursively."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import recc

    class TwoTowerCTR(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.EmbeddingBag(50, 8, mode="sum")
            self.item = nn.EmbeddingBag(40, 8, mode="sum")
            self.mlp = nn.Sequential(nn.Linear(16 + 4, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, dense, user_ids, user_offsets, item_ids, item_offsets):
            u = self.user(user_ids, user_offsets)
            i = self.item(item_ids, item_offsets)
            return torch.sigmoid(self.mlp(torch.cat([dense, u, i], dim=1))).squeeze(1)

    def batch(step, rank, world, n=8):
        g = torch.Generator().manual_seed(step)
        dense = torch.rand(n * world, 4, generator=g)
        uid = torch.randint(0, 50, (n * world,), generator=g)
        iid = torch.randint(0, 40, (n * world,), generator=g)
        y = torch.randint(0, 2, (n * world,), generator=g).float()
        s = slice(rank * n, (rank + 1) * n)
        offs = torch.arange(n)
        return dense[s], uid[s], offs, iid[s], offs, y[s]

    torch.manual_seed(0)
    model = TwoTowerCTR()
    cluster = recc.Cluster.local(2)
    program = recc.compile(model, cluster, config=recc.CompileConfig(sharding="table_wise"),
                           example_inputs=batch(0, 0, 2)[:5])
    print("TOP-LEVEL compiled", flush=True)

    def train():
        dmodel = program.instantiate()
        opt = torch.optim.SGD(dmodel.dense_parameters(), lr=0.1)
        for step in range(3):
            *x, y = batch(step, recc.rank(), recc.world_size())
            loss = F.binary_cross_entropy(dmodel(*x), y)
            loss.backward()
            opt.step(); opt.zero_grad()
        return float(loss)

    losses = recc.launch(train, cluster)
    print("LOSSES", len(losses), all(l == l for l in losses), flush=True)
''')


def test_script_top_level_runs_once_and_needs_no_main_guard(tmp_path):
    script = tmp_path / "train_ctr.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RECC_TIMEOUT_S="60")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("TOP-LEVEL compiled") == 1, out.stdout
    assert "LOSSES 2 True" in out.stdout, out.stdout
