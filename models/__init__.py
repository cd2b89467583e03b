"""Recommendation models as users write them, their presets, a synthetic click log, readers for
the Criteo logs (``recc.models.criteo``) and a streaming loader (``recc.models.click_log``).

Nothing here depends on the rest of recc: these are the plain PyTorch models recc compiles,
the data that feeds them, and the metrics used to check that training works.
"""

from recc.models.click_log import BatchStream, ClickLog, ClickLogData, convert
from recc.models.criteo import DataError, Hashing, ReadReport, Vocabulary, build_vocabulary
from recc.models.data import SyntheticData, slice_batch
from recc.models.dcnv2 import DCNv2
from recc.models.dlrm import DLRM
from recc.models.metrics import Metrics, auc, log_loss
from recc.models.presets import build_model, list_presets, load_preset

__all__ = [
    "DLRM",
    "DCNv2",
    "load_preset",
    "build_model",
    "list_presets",
    "SyntheticData",
    "slice_batch",
    "ClickLog",
    "ClickLogData",
    "BatchStream",
    "convert",
    "DataError",
    "Hashing",
    "Vocabulary",
    "ReadReport",
    "build_vocabulary",
    "log_loss",
    "auc",
    "Metrics",
]
