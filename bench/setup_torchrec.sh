#!/usr/bin/env bash
# Installs TorchRec + FBGEMM (CPU build) next to the already-installed torch, for running
# bench/train_throughput.py side by side with recc. TorchRec is never a runtime dependency of
# recc; nothing outside bench/ imports it.
#
# The versions are pinned together: fbgemm-gpu-cpu 1.8.0 / torchrec 1.8.0 are the pair built
# against the torch on this machine (2.13 CPU). torchrec is installed with --no-deps so pip does
# not try to replace torch or pull the CUDA fbgemm-gpu wheel; its pure-Python dependencies are
# installed explicitly afterwards.
#
#   bash bench/setup_torchrec.sh            # uses the `python` on PATH
#   PYTHON=/path/to/python bash bench/setup_torchrec.sh
set -euo pipefail

PY="${PYTHON:-python}"

"$PY" -c "import torch; print('torch', torch.__version__)"

"$PY" -m pip install "fbgemm-gpu-cpu==1.8.0"
"$PY" -m pip install --no-deps "torchrec==1.8.0"
"$PY" -m pip install tensordict "torchmetrics==1.0.3" tqdm pyre-extensions iopath

# Smoke check: the modules the benchmark uses must import, and FBGEMM's CPU TBE must run.
"$PY" - <<'PY'
import torch
import torchrec
import torchrec.distributed  # noqa: F401
import torchrec.modules.embedding_modules  # noqa: F401
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType

tbe = SplitTableBatchedEmbeddingBagsCodegen(
    [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
    optimizer=EmbOptimType.EXACT_SGD,
    learning_rate=0.1,
)
out = tbe(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3]))
out.sum().backward()
print("torchrec", getattr(torchrec, "__version__", "?"), "| fbgemm CPU TBE ok:", tuple(out.shape))
PY
